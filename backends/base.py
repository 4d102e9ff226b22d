"""The base class every attention backend derives from.

Capabilities are plain class attributes (as in xformers' fmha operators) and ``not_supported_reasons`` turns them
into human-readable reasons; the dispatcher takes the first backend, by priority, that has none. A backend module
is the only place that knows its device, and it imports torch or numba.cuda inside its methods, never at import.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from numba_flash.validation import AttentionCall


class Backend:
    """One way to run attention. Subclasses set the class attributes and implement ``forward``/``backward``."""

    name: ClassVar[str] = ""
    OPS: ClassVar[tuple[str, ...]] = ("flash",)
    PRIORITY: ClassVar[int] = 0                      # higher is tried first
    SUPPORTED_KINDS: ClassVar[tuple[str, ...]] = ()  # array kinds, see numba_flash.arrays.array_kind
    SUPPORTED_DEVICES: ClassVar[tuple[str, ...]] = ()
    SUPPORTED_DTYPES: ClassVar[tuple[str, ...]] = ()
    # "thd" (packed sequences) only for backends that run them, e.g. through ``backends.varlen``
    SUPPORTED_LAYOUTS: ClassVar[tuple[str, ...]] = ("bshd", "bhsd")
    SUPPORTED_MAX_HEAD_DIM: ClassVar[int] = 256      # for q and k, and for v
    SUPPORTS_HEAD_DIM_V: ClassVar[bool] = False      # v's head dim Dv different from q's and k's D
    SUPPORTS_WINDOW: ClassVar[bool] = True
    SUPPORTS_SOFTCAP: ClassVar[bool] = True
    SUPPORTS_BACKWARD: ClassVar[bool] = True
    SUPPORTS_KVCACHE: ClassVar[bool] = False         # ``with_kvcache`` (decoding with a KV cache)
    SUPPORTS_ALIBI: ClassVar[bool] = False           # ``alibi_slopes``
    SUPPORTS_BIAS: ClassVar[bool] = False            # ``attn_bias``
    SUPPORTS_DBIAS: ClassVar[bool] = False           # its gradient (``return_dbias``)
    SUPPORTS_MODS: ClassVar[bool] = False            # ``bias_mod``, ``mask_mod``, ``score_mod`` (numba_flash.mods)
    SUPPORTS_DROPOUT: ClassVar[bool] = False         # ``dropout_p`` > 0 (masks from ``numba_flash.dropout``)
    IS_DETERMINISTIC: ClassVar[bool] = True

    def unavailable_reasons(self, forced: bool = False) -> list[str]:
        """Why this machine cannot run the backend at all (no GPU, a package missing); empty when it can.
        ``forced`` is True when the user named this backend, which may unlock paths (e.g. the CUDA simulator)."""
        return []

    def not_supported_reasons(self, call: AttentionCall, forced: bool = False) -> list[str]:
        """Why this backend cannot serve ``call``; empty when it can. Cheap checks first, machine checks last, so
        that a call turned down for its dtype never pays for probing a GPU."""
        reasons = []
        if self.SUPPORTED_KINDS and call.kind not in self.SUPPORTED_KINDS:
            reasons.append(f"{call.kind} arrays not supported")
        elif self.SUPPORTED_DEVICES and call.device not in self.SUPPORTED_DEVICES:
            reasons.append(f"{call.device} tensors not supported (runs on {', '.join(self.SUPPORTED_DEVICES)})")
        if self.SUPPORTED_DTYPES and call.dtype not in self.SUPPORTED_DTYPES:
            reasons.append(f"{call.dtype} not supported")
        reasons.extend(self.feature_reasons(call))
        if not reasons:
            reasons.extend(self.unavailable_reasons(forced))
        return reasons

    def feature_reasons(self, call: AttentionCall) -> list[str]:
        """Which of the call's features (layout, head dims, window, softcap, backward, ALiBi, attn_bias, KV cache)
        the class attributes say this backend lacks; backends with their own kind and device checks call it too."""
        reasons = []
        if call.layout not in self.SUPPORTED_LAYOUTS:
            reasons.append(f"layout {call.layout!r} not supported")
        if max(call.head_dim, call.head_dim_v) > self.SUPPORTED_MAX_HEAD_DIM:
            reasons.append(f"head dim {max(call.head_dim, call.head_dim_v)} > {self.SUPPORTED_MAX_HEAD_DIM}")
        if call.head_dim_v != call.head_dim and not self.SUPPORTS_HEAD_DIM_V:
            reasons.append(f"v's head dim Dv={call.head_dim_v} different from D={call.head_dim} not supported")
        if call.has_window and not self.SUPPORTS_WINDOW:
            reasons.append("sliding window not supported")
        if call.softcap and not self.SUPPORTS_SOFTCAP:
            reasons.append("softcap not supported")
        if call.is_backward and not self.SUPPORTS_BACKWARD:
            reasons.append("backward not supported")
        if call.alibi is not None and not self.SUPPORTS_ALIBI:
            reasons.append("ALiBi not supported")
        if call.bias is not None and not self.SUPPORTS_BIAS:
            reasons.append("attn_bias not supported")
        elif call.return_dbias and not self.SUPPORTS_DBIAS:
            reasons.append("attn_bias's gradient (return_dbias) not supported")
        if call.mods is not None and not self.SUPPORTS_MODS:
            reasons.append("bias_mod, mask_mod and score_mod not supported")
        if call.dropout_p and not self.SUPPORTS_DROPOUT:
            reasons.append("dropout not supported")
        if call.kvcache is not None and not self.SUPPORTS_KVCACHE:
            reasons.append("KV cache (with_kvcache) not supported")
        return reasons

    def last_resort_reasons(self, call: AttentionCall) -> list[str] | None:
        """Whether this backend serves ``call`` when no backend would otherwise (the dispatcher asks only then):
        None if it never steps in for such a call, else why it cannot (empty: it can). No backend does by default;
        the torch path steps in for torch tensors on a GPU that the GPU's own backend cannot serve."""
        return None

    def notes(self, call: AttentionCall) -> list[str]:
        """What ``explain()`` should say about a call this backend can serve besides "can serve" (e.g. that a
        kernel failed its self-check and a fallback serves instead); empty by default. Must be cheap."""
        return []

    def supports(self, call: AttentionCall, forced: bool = False) -> bool:
        return not self.not_supported_reasons(call, forced)

    def forward(self, call: AttentionCall) -> tuple[Any, Any]:
        """Return ``(out, lse)``: out shaped like q, same array kind, device and dtype; lse (B, Hq, Sq) float32,
        ``call.lse_shape``: (Hq, total_q) for packed sequences.
        May raise ``numba_flash.errors.BackendDeclined``, before writing anything, when the backend finds out only
        while running that it cannot serve the call; the dispatcher then picks again."""
        raise NotImplementedError

    def backward(self, call: AttentionCall) -> tuple[Any, Any, Any]:
        """Return ``(dq, dk, dv)`` shaped like q, k, v, same kind, device and dtype as q."""
        raise NotImplementedError

    def with_kvcache(self, call: AttentionCall) -> tuple[Any, Any]:
        """Decoding with a KV cache: ``call.kvcache`` is the validated ``numba_flash.kvcache.KVCacheCall``. Append
        its new keys to the caches in place, then return ``(out, lse)``: out (B, Sq, Hq, D) like q, lse
        (B, Hq, Sq) float32. ``backends.kvcache`` has the pieces. Raise ``BackendDeclined`` only before writing."""
        raise NotImplementedError

    def forward_step(self, call: AttentionCall) -> Callable[..., tuple[Any, Any]] | None:
        """A function that runs the forwards of a plan made for validated ``call`` faster than ``forward``, having
        decided once what the plan fixes; or None (the default) where ``forward`` serves every call. The function
        takes ``(q, k, v)`` of the planned signatures and returns what ``forward`` would for the planned call with
        them in place; it must not hold ``call``'s arrays (a kept plan lets go of them)."""
        return None

    def kvcache_step(self, kv: Any) -> Callable[[Any], tuple[Any, Any]] | None:
        """A function that runs the steps of a ``with_kvcache`` plan made for validated call ``kv`` (a
        ``KVCacheCall``) faster than ``with_kvcache``, having decided once what the plan fixes; or None (the
        default) where ``with_kvcache`` serves every step. The function takes a step's ``KVCacheCall`` (the
        plan's, with the step's arrays and lengths: the same signatures) and returns what ``with_kvcache`` would,
        writing the same append; it must not hold ``kv``'s arrays (a kept plan lets go of them)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.PRIORITY}>"
