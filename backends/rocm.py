"""ROCm backend: attention in plain PyTorch, for AMD GPUs through a HIP build of torch.

Numba has no AMD GPU target, so on AMD hardware the work is done by torch itself:

* ``torch.nn.functional.scaled_dot_product_attention`` where its semantics are exactly the contract's: no sliding
  window, no softcap, no lse asked for, and causal only when Sq == Sk (SDPA aligns ``is_causal`` to the top-left
  corner, the contract to the bottom-right; the two agree only on square masks). The scale is always passed.
* otherwise a blockwise online-softmax written with torch ops: query blocks and key blocks in Python loops, running
  max and sum in float32 (float64 for float64 inputs), at most one block of scores alive per head, and key blocks
  outside the causal/window band never computed. Each block's scores go through ``numba_flash.score_pipeline``
  (softcap, ALiBi, attn_bias, the mods), the description the CUDA and CPU kernels compile too (``_Terms``).
  The backward recomputes each block of probabilities from the lse.
  Dropout makes each block's mask from the Philox counters of ``numba_flash.dropout``, in the forward and again in
  the backward; SDPA, whose dropout has its own generator, is not used with it.

Non-finite values follow the contract (``numba_flash.reference`` spells the rule out). One reduction per input
tensor per call (``_clean``) tells whether any value is non-finite or any score could overflow; only then do the
blockwise loops poison rows, keep masked pairs out of every product and report non-finite results as NaN, and SDPA,
which would drop a key whose score is -inf, is not used.

Grouped-query attention never repeats K/V: the ``g = Hq // Hkv`` query heads of a group are folded into the rows of
the query block, ``(B, Hkv, Sq_block * g, D)``, which multiplies against the group's single ``(B, Hkv, Sk_block, D)``
key block. Every tensor op here works on any torch device, so forcing ``backend="rocm"`` runs it on CPU or NVIDIA
tensors too (and on numpy arrays, through CPU tensors); without forcing it is chosen only for tensors on a HIP GPU.
torch is imported inside functions: importing this module or registering the backend does not import it.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import numpy as np

from numba_flash.arrays import as_result_kind, is_torch_tensor
from numba_flash.semantics import key_range
from numba_flash.validation import AttentionCall

from . import kvcache, varlen
from .base import Backend

# Elements of one block of scores (B * Hq * block_q * block_k); 2**24 float32 is 64 MiB. The backward keeps about
# four such blocks alive (scores/probabilities, dP, dS and a product), the forward two.
SCORE_BLOCK_ELEMENTS = 1 << 24
# On a GPU each block costs a dozen kernel launches, so blocks are large; query blocks stay well below the sequence
# so that causal calls still skip about half the key blocks. On a CPU the elementwise passes over the scores
# dominate and blocks that stay in cache win (on 2 cores, S=2048: 256 x 256 took 1.5x to 3x less time than
# 2048 x 512).
GPU_BLOCK_Q, GPU_BLOCK_K = 1024, 1024
CPU_BLOCK_Q, CPU_BLOCK_K = 256, 256
MIN_BLOCK_Q = 16


def block_sizes(call: AttentionCall) -> tuple[int, int]:
    """(block_q, block_k) for ``call``: the device's preferred sizes, with fewer query rows where needed to keep
    one block of scores within ``SCORE_BLOCK_ELEMENTS``. A narrow sliding window shrinks the query block so that
    the band, not the rectangle around it, sets the work."""
    on_cpu = call.device == "cpu"
    block_q, block_k = (CPU_BLOCK_Q, CPU_BLOCK_K) if on_cpu else (GPU_BLOCK_Q, GPU_BLOCK_K)
    block_k = min(block_k, call.seqlen_k)
    block_q = min(block_q, max(MIN_BLOCK_Q, SCORE_BLOCK_ELEMENTS // (call.batch * call.nheads_q * block_k)))
    if call.window_left >= 0 and call.window_right >= 0:
        block_q = min(block_q, max(MIN_BLOCK_Q, call.window_left + call.window_right + 1))
    return min(block_q, call.seqlen_q), block_k


def _hip_runtime_reasons() -> list[str]:
    """Why this process cannot run torch on a HIP GPU (read at call time, so that tests can fake a HIP build)."""
    try:
        import torch
    except ImportError:
        return ["torch is not installed"]
    if getattr(torch.version, "hip", None) is None:
        return ["not a HIP device (torch.version.hip is None)"]
    if not torch.cuda.is_available():
        return ["no HIP GPU (torch.cuda.is_available() is False)"]
    return []


def _as_torch(x: Any) -> Any:
    """``x`` as a torch tensor without copying where possible (numpy arrays become CPU tensors sharing memory)."""
    import torch

    if isinstance(x, np.ndarray):
        if any(s < 0 for s in x.strides):  # torch.from_numpy refuses negative strides
            x = np.ascontiguousarray(x)
        with warnings.catch_warnings():
            # A read-only array gives a warning about writes; nothing here writes to the inputs.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    x = x.detach()
    # Compute on plain tensors: a subclass's __torch_function__ would run on every op of the blockwise loops.
    return x if type(x) is torch.Tensor else x.as_subclass(torch.Tensor)


def _to_kind(ref: Any, t: Any) -> Any:
    """``t`` (a plain torch tensor) back as the array kind of ``ref``: numpy for numpy inputs, the tensor type
    torch would return for a torch subclass."""
    if isinstance(ref, np.ndarray):
        return t.numpy()
    if t is not None and is_torch_tensor(ref):
        return as_result_kind(ref, t)
    return t


def _compute_dtype(dtype: Any) -> Any:
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_view(x: Any, layout: str) -> Any:
    """(B, H, S, D) view of a tensor in ``layout``; no copy."""
    return x.permute(0, 2, 1, 3) if layout == "bshd" else x


def _grouped_view(x: Any, layout: str, nheads_kv: int) -> Any:
    """(B, Hkv, S, g, D) view of a query-shaped tensor: query head h = kv * g + r sits at [:, kv, :, r]. No copy
    (splitting one dimension in two is always a view), so it can be read from and written to."""
    return _heads_view(x, layout).unflatten(1, (nheads_kv, -1)).permute(0, 1, 3, 2, 4)


def _lse_view(lse: Any, nheads_kv: int) -> Any:
    """(B, Hkv, Sq, g) view of an lse of shape (B, Hq, Sq)."""
    return lse.unflatten(1, (nheads_kv, -1)).permute(0, 1, 3, 2)


class _Band:
    """The key blocks each query block must visit, and whether a block needs the mask, from the contract's
    visibility rule (``numba_flash.semantics.key_range``). Row i sees keys [lo_i, hi_i); lo_i and hi_i never
    decrease with i, so a query block [q0, q1) sees at most keys [lo_q0, hi_{q1-1}) and sees all of a key block
    [k0, k1) iff lo_{q1-1} <= k0 and k1 <= hi_q0."""

    def __init__(self, call: AttentionCall):
        self.sq, self.sk = call.seqlen_q, call.seqlen_k
        self.left, self.right = call.window_left, call.window_right

    def key_blocks(self, q0: int, q1: int, block_k: int) -> list[tuple[int, int, bool]]:
        lo_first, hi_first = key_range(q0, self.sq, self.sk, self.left, self.right)
        lo_last, hi_last = key_range(q1 - 1, self.sq, self.sk, self.left, self.right)
        blocks = []
        for k0 in range(lo_first, hi_last, block_k):
            k1 = min(k0 + block_k, hi_last)
            blocks.append((k0, k1, not (lo_last <= k0 and k1 <= hi_first)))
        return blocks

    def visible(self, q0: int, q1: int, k0: int, k1: int, device: Any) -> Any:
        """Boolean (q1 - q0, 1, k1 - k0) mask, True where row i sees key j (the 1 broadcasts over a group)."""
        import torch

        i = torch.arange(q0 + self.sk - self.sq, q1 + self.sk - self.sq, device=device)[:, None, None]
        j = torch.arange(k0, k1, device=device)[None, None, :]
        ok = torch.ones((q1 - q0, 1, k1 - k0), dtype=torch.bool, device=device)
        if self.left >= 0:
            ok &= j >= i - self.left
        if self.right >= 0:
            ok &= j <= i + self.right
        return ok


def _results_shapes(call: AttentionCall) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype: "q" for q's, "lse" for the lse's) of a forward's results, out and lse."""
    q_shape = tuple(int(s) for s in call.q.shape)
    lse = (call.nheads_q, q_shape[0]) if call.is_varlen else (call.batch, call.nheads_q, call.seqlen_q)
    return [("out", q_shape[:-1] + (call.head_dim_v,), "q"), ("lse", lse, "lse")]


def _meta_like(q: Any, shape: tuple[int, ...], dtype: str) -> Any:
    import torch

    return torch.empty(shape, dtype=q.dtype if dtype == "q" else _compute_dtype(q.dtype), device="meta")


def _check_fits(results: list[tuple[str, tuple[int, ...], str]], q: Any) -> None:
    """MemoryError naming the size when the results cannot fit in the memory of q's device, raised before any
    input is read: ``_clean`` reads every element, and broadcast views of a huge shape hold few bytes but take
    minutes to scan before the allocation would fail anyway."""
    import torch

    sizes = {"q": q.element_size(), "lse": torch.empty((), dtype=_compute_dtype(q.dtype)).element_size()}
    need = {name: math.prod(shape) * sizes[dt] for name, shape, dt in results}
    if q.device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):   # no sysconf (Windows): the allocation will tell
            return
    elif q.device.type == "cuda":
        total = torch.cuda.get_device_properties(q.device).total_memory
    else:
        return
    if sum(need.values()) > total:
        name, shape, _ = max(results, key=lambda r: need[r[0]])
        raise MemoryError(f"{name}: {shape} {str(q.dtype).replace('torch.', '')} needs "
                          f"{need[name] / 2**30:.0f} GiB, and the results {sum(need.values()) / 2**30:.0f} GiB, "
                          f"more than the {total / 2**30:.0f} GiB of memory of {q.device}")


def _clean(call: AttentionCall, cdt: Any, *tensors: Any) -> bool:
    """Whether the plain paths give the contract's answer: every value of ``tensors`` (q, k, v first) finite, and
    no score ``scale * q.k`` (at most ``scale * D * max|q| * max|k|``) or output sum (at most ``Sk * max|v|``) able
    to overflow. One max-abs reduction per tensor (NaN when it holds one) and one device sync per call."""
    import torch

    # One stack, one sync; the inputs share a dtype (and float64 is not on every device, e.g. MPS).
    maxes = torch.stack([torch.linalg.vector_norm(x, float("inf")) for x in tensors]).tolist()
    if not all(math.isfinite(x) for x in maxes):
        return False
    qmax, kmax, vmax = maxes[:3]
    # Headroom of 4 for rounding; the input dtype's range for the scores, which SDPA may hold in that dtype.
    score_limit = float(torch.finfo(tensors[0].dtype).max) / 4
    return (call.softmax_scale * call.head_dim * qmax * kmax <= score_limit
            and call.seqlen_k * vmax <= float(torch.finfo(cdt).max) / 4)


def _bias_finite(call: AttentionCall) -> bool:
    """True when the call has no ``attn_bias`` or every entry of it is finite (else the careful paths run: -inf
    hides keys, NaN poisons rows)."""
    import torch

    return call.bias is None or bool(torch.isfinite(_as_torch(call.bias.array)).all())


def _nan_if_not_finite_(x: Any) -> Any:
    """In place: every non-finite value of ``x`` (a tensor this module allocated) becomes NaN."""
    import torch

    return x.masked_fill_(~torch.isfinite(x), float("nan"))


def _visible_matmul(a: Any, b: Any, vis: Any) -> Any:
    """``a @ b`` over visible pairs only, for a masked block (``a`` is 0 where ``vis`` is False): non-finite
    entries of ``b`` are left out of the product (a plain one adds 0 * nan = nan to rows that do not see them) and
    marked NaN in every row that sees them. a (..., r, m), b (..., m, D), vis (r, m) bool."""
    import torch

    bad = ~torch.isfinite(b)
    res = a @ b.masked_fill(bad, 0.0)
    hits = vis.to(b.dtype) @ bad.to(b.dtype)
    return res.masked_fill_(hits > 0, float("nan"))


def _alibi_slopes(call: AttentionCall, cdt: Any, device: Any) -> Any:
    """ALiBi slopes as a (B, Hkv, 1, g) tensor, laid out like a query block's rows; None without ALiBi."""
    import torch

    if call.alibi is None:
        return None
    slopes = torch.as_tensor(np.array(call.alibi), dtype=cdt, device=device)
    return slopes.view(call.batch, call.nheads_kv, 1, call.group_size)


def _dropout_factors(call: AttentionCall, q0: int, q1: int, k0: int, k1: int, cdt: Any, device: Any) -> Any:
    """(B, Hkv, n*g, m) factors of a block's probabilities, 1 / (1 - p) where ``numba_flash.dropout`` keeps the
    pair and 0 where it drops it, made from the counters (b, h, i, j) each time (forward and backward alike, so the
    mask is never stored); None without dropout."""
    import torch

    from numba_flash.dropout import dropout_keep_torch, dropout_scale, dropout_threshold

    if not call.dropout_p:
        return None
    idx = lambda lo, hi: torch.arange(lo, hi, dtype=torch.int64, device=device)  # noqa: E731
    b = idx(call.dropout_batch0, call.dropout_batch0 + call.batch).view(-1, 1, 1, 1, 1)
    h = idx(0, call.nheads_q).view(1, call.nheads_kv, 1, call.group_size, 1)   # query head kv * g + r
    i, j = idx(q0, q1).view(1, 1, -1, 1, 1), idx(k0, k1).view(1, 1, 1, 1, -1)
    keep = dropout_keep_torch(call.dropout_seed, dropout_threshold(call.dropout_p), b, h, i, j)
    return keep.to(cdt).mul_(dropout_scale(call.dropout_p)).flatten(2, 3)


def _select(cond: Any, if_true: Any, if_false: Any) -> Any:
    """The score pipeline's select on blocks: a bool tensor picks per pair, a Python bool (a block where the stage
    hides nothing) picks the whole."""
    import torch

    if isinstance(cond, torch.Tensor):
        return torch.where(cond, if_true, if_false)
    return if_true if cond else if_false


def _logical_not(flag: Any) -> Any:
    return ~flag if not isinstance(flag, bool) else not flag


class _Terms:
    """What a call does to its scores: the score pipeline of ``numba_flash.score_pipeline`` (softcap, ALiBi,
    attn_bias as a ``backends.torch_scores.BlockBias``, bias_mod and mask_mod, score_mod, as ``BlockMods``) run on
    whole blocks with torch ops, built per call with the call's switches."""

    def __init__(self, call: AttentionCall, cdt: Any, device: Any) -> None:
        from backends.torch_scores import BlockBias, BlockMods

        self.call = call
        self.alibi = _alibi_slopes(call, cdt, device)
        self.bias = None if call.bias is None else BlockBias(call, _as_torch(call.bias.array))
        self.mods = None if call.mods is None else BlockMods(call)
        mods = call.mods
        self.index_mods = mods is not None and (mods.mask_mod is not None or mods.bias_mod is not None)
        self.score_mod = mods is not None and mods.score_mod is not None
        self.staged = call.softcap > 0 or self.alibi is not None or self.bias is not None or mods is not None
        self._pipelines: dict[tuple[bool, bool], Any] = {}

    def keep(self, q0: int, q1: int, k0: int, k1: int, like: Any) -> Any:
        """mask_mod's verdict on the block (B, Hkv, n*g, m) bool, or None when it hides nothing there."""
        return None if self.mods is None else self.mods.keep(q0, q1, k0, k1, like)

    def pipeline(self, grad: bool, careful: bool) -> Any:
        """The pipeline for a forward (``grad`` False: no chain factors) or a backward, ``careful`` or not: the
        forward makes a visible non-finite score NaN (``finite``), the backward reads it only under score_mod (where
        a -inf product must poison, not hide; elsewhere its rows are NaN through the forward's lse)."""
        import torch

        key = (grad, careful)
        if key not in self._pipelines:
            from numba_flash.score_pipeline import compile_with

            mods = self.mods

            def hook(x, apply, b, h, q0, k0, q1, k1):
                return mods.score(x, apply, q0, q1, k0, k1, grad)

            # The block of raw scores is this module's own; the pipeline reads it after softcap's tanh only to
            # tell which products were finite, so without that check tanh may overwrite it.
            check = careful and (not grad or self.score_mod)
            tanh = (lambda raw, qmult: torch.tanh(raw * qmult)) if check else \
                (lambda raw, qmult: raw.mul_(qmult).tanh_())
            self._pipelines[key] = compile_with(
                lambda f: f, tanh, float, 1.0,
                softcap=self.call.softcap > 0, alibi=self.alibi is not None, bias=self.bias is not None,
                index_mods=self.index_mods, score_mod=hook if self.score_mod else None, select=_select,
                logical_not=_logical_not, scaled=True, bias_hides=self.bias is not None and self.bias.hides,
                chain=grad, check_finite=check)
        return self._pipelines[key]

    def slopes(self, q0: int, q1: int) -> Any:
        """ALiBi's slopes for a query block's rows, (B, Hkv, n*g, 1)."""
        b, h, _, g = self.alibi.shape
        return self.alibi.expand(b, h, q1 - q0, g).reshape(b, h, (q1 - q0) * g, 1)

    def distance(self, q0: int, q1: int, k0: int, k1: int, like: Any) -> Any:
        """ALiBi's ``i + Sk - Sq - j`` for a block, (n*g, m) in ``like``'s dtype (each query's row repeated for the
        g heads of a group)."""
        import torch

        call = self.call
        i = torch.arange(q0 + call.seqlen_k - call.seqlen_q, q1 + call.seqlen_k - call.seqlen_q, device=like.device)
        dist = (i[:, None] - torch.arange(k0, k1, device=like.device)[None, :]).to(like.dtype)
        return dist.repeat_interleave(call.group_size, dim=0)


def _scores(qb: Any, kb: Any, call: AttentionCall, band: _Band, q0: int, q1: int, k0: int, k1: int,
            need_mask: bool, careful: bool, terms: _Terms, keep: Any = None,
            grad: bool = False) -> tuple[Any, Any, Any, Any]:
    """Scores of a query block against a key block through the call's score pipeline (``_Terms``), masked to -inf.

    qb: (B, Hkv, n*g, D) compute dtype, already multiplied by the softmax scale; kb: (B, Hkv, m, D); ``keep``: the
    block's mask_mod verdict (``_Terms.keep``). Returns s (B, Hkv, n*g, m); with ``grad`` and softcap, d score / d
    scaled q.k (softcap's ``1 - tanh**2``) else None; where a term hid a key the band shows ((B, Hkv, n*g, m) bool)
    else None; and with ``grad`` and a score_mod, d score_mod / d score, else None.
    With ``careful`` (inputs that are not ``_clean``) the forward's visible scores that are not finite become NaN,
    so that -inf means masked and nothing else and the NaN poisons its row through the max; with softcap the raw
    score decides, since tanh would map an inf to a finite +-1. (The backward's rows that see such a score are NaN
    through the forward's lse already.)
    """
    s = qb @ kb.transpose(-1, -2)
    dcap = hidden = dmod = None
    if terms.staged or careful:
        pipeline = terms.pipeline(grad, careful)
        slope = terms.slopes(q0, q1) if terms.alibi is not None else 0.0
        distance = terms.distance(q0, q1, k0, k1, s) if terms.alibi is not None else 0.0
        bias = terms.bias.block(q0, q1, k0, k1, s.dtype) if terms.bias is not None else 0.0
        extra = terms.mods.bias(q0, q1, k0, k1, s) if terms.mods is not None else None
        s, dcap, dmod, shown, finite = pipeline(
            s, 1.0 / call.softcap if call.softcap > 0 else 1.0, call.softcap, slope, distance, bias,
            0.0 if extra is None else extra, False if keep is None else ~keep, True, None, None, q0, k0, q1, k1)
        if careful and not grad and not isinstance(finite, bool):
            s.masked_fill_(~finite, float("nan"))
        if not isinstance(shown, bool):
            hidden = ~shown
            s.masked_fill_(hidden, float("-inf"))  # hidden, whatever the score was (a NaN there reaches nothing)
        dcap = dcap if grad and call.softcap > 0 else None
        dmod = dmod if grad and terms.score_mod else None
    if need_mask:
        b, h, rows, m = s.shape
        s.view(b, h, q1 - q0, rows // (q1 - q0), m).masked_fill_(
            ~band.visible(q0, q1, k0, k1, s.device), float("-inf"))
    return s, dcap, hidden, dmod


def _block_visible(band: _Band, q0: int, q1: int, k0: int, k1: int, group: int, device: Any,
                   hidden: Any = None) -> Any:
    """(n*g, m) bool: row r of a query block (query q0 + r // g) sees key k0 + c; (B, Hkv, n*g, m) when a term
    ``hidden`` some keys (``_scores``)."""
    import torch

    ok = band.visible(q0, q1, k0, k1, device) | torch.zeros((1, group, 1), dtype=torch.bool, device=device)
    ok = ok.reshape((q1 - q0) * group, k1 - k0)
    return ok if hidden is None else ok & ~hidden


def _forward_sdpa(q: Any, k: Any, v: Any, call: AttentionCall) -> Any:
    """Output of ``scaled_dot_product_attention`` in the call's layout, contiguous, q's dtype."""
    import torch.nn.functional as F

    qh, kh, vh = (_heads_view(x, call.layout) for x in (q, k, v))
    kwargs = {"enable_gqa": True} if call.nheads_q != call.nheads_kv else {}
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=call.window_right == 0,
                                         scale=call.softmax_scale, **kwargs)
    return _heads_view(out, call.layout).contiguous()


def sdpa_fits(call: AttentionCall) -> bool:
    """True when ``scaled_dot_product_attention`` computes exactly what the contract asks for ``call``."""
    if (call.return_lse or call.is_backward or call.softcap > 0 or call.window_left >= 0 or call.alibi is not None
            or call.bias is not None or call.mods is not None
            or call.dropout_p):   # SDPA's dropout draws from torch's generator, not from numba_flash.dropout
        return False
    if call.window_right >= 0:
        # SDPA's is_causal keeps j <= i (top-left); the contract keeps j <= i + Sk - Sq. Equal only when Sq == Sk.
        return call.window_right == 0 and call.seqlen_q == call.seqlen_k
    return True


def _sdpa_has_gqa() -> bool:
    """SDPA learnt ``enable_gqa`` in torch 2.5; before that, GQA calls take the blockwise path."""
    import torch

    return torch.__version__ >= "2.5"  # TorchVersion compares as a version, not as a string


def _blockwise_into(careful: bool) -> Any:
    """``run(call, q, k, v, out, lse)`` for the varlen and KV-cache drivers: ``forward_blockwise`` on one dense
    call's views, its results copied into ``out`` and ``lse``."""
    def run(c: AttentionCall, q_b: Any, k_b: Any, v_b: Any, out_b: Any, lse_b: Any) -> None:
        o, l = forward_blockwise(q_b, k_b, v_b, c, careful=careful)
        out_b.copy_(o)
        lse_b.copy_(l)

    return run


def forward_blockwise(q: Any, k: Any, v: Any, call: AttentionCall, careful: bool = True) -> tuple[Any, Any]:
    """Blockwise online-softmax forward.

    q: (B, Sq, Hq, D) ["bshd"] or (B, Hq, Sq, D) ["bhsd"]; k: (B, Sk, Hkv, D) or (B, Hkv, Sk, D); v likewise with
    head dim Dv; torch tensors of one dtype on one device, any strides. Returns out shaped like q with head dim Dv,
    contiguous, q's dtype, and lse
    (B, Hq, Sq) float32 (float64 for float64 inputs), +inf for rows that see no key, NaN for poisoned rows.
    ``careful=False`` skips the non-finite handling, for inputs known to be ``_clean``.
    """
    import torch

    cdt = _compute_dtype(q.dtype)
    B, Hkv, D, Dv, g = call.batch, call.nheads_kv, call.head_dim, call.head_dim_v, call.group_size
    out = torch.empty(q.shape[:-1] + (Dv,), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, call.nheads_q, call.seqlen_q), dtype=cdt, device=q.device)
    qv, ov, lv = _grouped_view(q, call.layout, Hkv), _grouped_view(out, call.layout, Hkv), _lse_view(lse, Hkv)
    kv, vv = _heads_view(k, call.layout), _heads_view(v, call.layout)
    band = _Band(call)
    terms = _Terms(call, cdt, q.device)
    block_q, block_k = block_sizes(call)
    for q0 in range(0, call.seqlen_q, block_q):
        q1 = min(q0 + block_q, call.seqlen_q)
        rows = (q1 - q0) * g
        qb = (qv[:, :, q0:q1].to(cdt) * call.softmax_scale).reshape(B, Hkv, rows, D)
        m = torch.full((B, Hkv, rows), float("-inf"), dtype=cdt, device=q.device)
        l = torch.zeros((B, Hkv, rows), dtype=cdt, device=q.device)
        acc = torch.zeros((B, Hkv, rows, Dv), dtype=cdt, device=q.device)
        for k0, k1, need_mask in band.key_blocks(q0, q1, block_k):
            keep = terms.keep(q0, q1, k0, k1, qb)
            if keep is not None and not bool(keep.any()):
                continue  # mask_mod hides every key of the block: it adds nothing
            s, _, hidden, _ = _scores(qb, kv[:, :, k0:k1].to(cdt), call, band, q0, q1, k0, k1, need_mask, careful,
                                      terms, keep)
            # amax and maximum propagate NaN: a poisoned row's max, sum and accumulator become NaN and stay so.
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row with every key so far masked keeps max -inf; shift it by 0 so that exp gives 0, not NaN.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = s.sub_(m_safe[..., None]).exp_()
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1)   # the sum before dropout: lse is the softmax's own
            drop = _dropout_factors(call, q0, q1, k0, k1, cdt, q.device)
            if drop is not None:
                p.mul_(drop)
            vb = vv[:, :, k0:k1].to(cdt)
            if careful and (need_mask or hidden is not None):
                pv = _visible_matmul(p, vb, _block_visible(band, q0, q1, k0, k1, g, q.device, hidden))
            else:
                pv = p @ vb
            acc.mul_(alpha[..., None]).add_(pv)
            m = m_new
        # l > 0 is False for a row that saw no key (l = 0) and for a poisoned one (l = NaN); only the first is
        # 0 with lse = +inf.
        seen = l > 0
        poisoned = torch.isnan(l)
        l_safe = torch.where(seen, l, torch.ones_like(l))
        o = acc / l_safe[..., None]
        if careful:
            _nan_if_not_finite_(o.masked_fill_(poisoned[..., None], float("nan")))
        ov[:, :, q0:q1] = o.view(B, Hkv, q1 - q0, g, Dv)
        m_fin = m.masked_fill(~seen, 0.0)
        row_lse = torch.where(seen, m_fin + torch.log(l_safe), float("inf")).masked_fill_(poisoned, float("nan"))
        lv[:, :, q0:q1] = row_lse.view(B, Hkv, q1 - q0, g)
    return out, lse


def backward_blockwise(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                       call: AttentionCall, careful: bool = True) -> tuple[Any, ...]:
    """Blockwise backward from the forward's lse: P is recomputed per block as exp(s - lse), never S x S.

    dout, out, q: (B, Sq, Hq, D) ["bshd"] or (B, Hq, Sq, D); k, v: (B, Sk, Hkv, D) or (B, Hkv, Sk, D); lse
    (B, Hq, Sq). Returns dq, dk, dv shaped like q, k, v, contiguous, q's dtype; dk, dv summed over each group; with
    ``call.return_dbias`` also dbias shaped like the bias, in the bias's dtype.
    With ``careful`` (inputs or lse not finite), P and dS are forced to 0 where a row does not see a key (a
    poisoned row's lse is NaN, and exp(-inf - nan) is NaN) and no product lets a non-finite row reach those pairs.
    """
    import torch

    cdt = _compute_dtype(q.dtype)
    B, Hkv, D, Dv, g = call.batch, call.nheads_kv, call.head_dim, call.head_dim_v, call.group_size
    dev = q.device
    dq = torch.empty(q.shape, dtype=q.dtype, device=dev)
    dk_acc = torch.zeros((B, Hkv, call.seqlen_k, D), dtype=cdt, device=dev)
    dv_acc = torch.zeros((B, Hkv, call.seqlen_k, Dv), dtype=cdt, device=dev)
    qv, dqv = _grouped_view(q, call.layout, Hkv), _grouped_view(dq, call.layout, Hkv)
    dov, ov = _grouped_view(dout, call.layout, Hkv), _grouped_view(out, call.layout, Hkv)
    lv = _lse_view(lse, Hkv)
    kv, vv = _heads_view(k, call.layout), _heads_view(v, call.layout)
    band = _Band(call)
    terms = _Terms(call, cdt, dev)
    dbias = terms.bias.new_grad(cdt, dev) if call.return_dbias else None
    block_q, block_k = block_sizes(call)
    for q0 in range(0, call.seqlen_q, block_q):
        q1 = min(q0 + block_q, call.seqlen_q)
        rows = (q1 - q0) * g
        qb = (qv[:, :, q0:q1].to(cdt) * call.softmax_scale).reshape(B, Hkv, rows, D)
        dob = dov[:, :, q0:q1].to(cdt).reshape(B, Hkv, rows, Dv)
        delta = (dob * ov[:, :, q0:q1].to(cdt).reshape(B, Hkv, rows, Dv)).sum(dim=-1)
        lse_b = lv[:, :, q0:q1].to(cdt).reshape(B, Hkv, rows)
        dq_acc = torch.zeros((B, Hkv, rows, D), dtype=cdt, device=dev)
        for k0, k1, need_mask in band.key_blocks(q0, q1, block_k):
            kb, vb = kv[:, :, k0:k1].to(cdt), vv[:, :, k0:k1].to(cdt)
            keep = terms.keep(q0, q1, k0, k1, qb)
            if keep is not None and not bool(keep.any()):
                continue
            s, dcap, hidden, dmod = _scores(qb, kb, call, band, q0, q1, k0, k1, need_mask, careful, terms, keep,
                                            grad=True)
            # lse is +inf on rows that see nothing: exp(s - inf) = 0 there, so those rows add no gradient.
            p = s.sub_(lse_b[..., None]).exp_()
            careful_block = careful and (need_mask or hidden is not None)
            if careful_block:
                vis = _block_visible(band, q0, q1, k0, k1, g, dev, hidden)
                p.masked_fill_(~vis, 0.0)
            # With dropout out = (P * drop) V: dV takes the dropped P, dP the factors, and delta = dout . out is
            # still sum_j P dP.
            drop = _dropout_factors(call, q0, q1, k0, k1, cdt, dev)
            p_out = p if drop is None else p * drop
            if careful_block:
                dv_acc[:, :, k0:k1] += _visible_matmul(p_out.transpose(-1, -2), dob, vis.transpose(-1, -2))
            else:
                dv_acc[:, :, k0:k1] += p_out.transpose(-1, -2) @ dob
            dp = dob @ vb.transpose(-1, -2)
            if drop is not None:
                dp.mul_(drop)
            ds = dp.sub_(delta[..., None]).mul_(p)
            if dmod is not None:
                ds.mul_(dmod)  # through score_mod, to the biased score
            if careful_block:
                ds.masked_fill_(~vis, 0.0)
            elif hidden is not None:
                ds.masked_fill_(hidden, 0.0)
            if dbias is not None:
                # The bias enters after softcap: its gradient is the score's, before softcap's chain factor.
                terms.bias.add_grad(dbias, ds, q0, q1, k0, k1)
            if dcap is not None:
                # tanh of a NaN raw score is NaN: 0 instead, so that a masked pair's dS stays 0 (a visible one's P is
                # NaN already, its row poisoned)
                ds.mul_(dcap.nan_to_num_(0.0))
            if careful_block:
                dq_acc += _visible_matmul(ds, kb, vis)
                dk_acc[:, :, k0:k1] += _visible_matmul(ds.transpose(-1, -2), qb, vis.transpose(-1, -2))
            else:
                dq_acc += ds @ kb
                # qb carries the softmax scale, so this is scale * dS^T q; summing the g rows of a group sums the
                # heads.
                dk_acc[:, :, k0:k1] += ds.transpose(-1, -2) @ qb
        dqv[:, :, q0:q1] = _nan_if_not_finite_(dq_acc * call.softmax_scale).view(B, Hkv, q1 - q0, g, D)
    dk = torch.empty(k.shape, dtype=k.dtype, device=dev)
    dv = torch.empty(v.shape, dtype=v.dtype, device=dev)
    _heads_view(dk, call.layout).copy_(_nan_if_not_finite_(dk_acc))
    _heads_view(dv, call.layout).copy_(_nan_if_not_finite_(dv_acc))
    if dbias is None:
        return dq, dk, dv
    return dq, dk, dv, _nan_if_not_finite_(dbias).reshape(tuple(call.bias.array.shape)).to(terms.bias.grouped.dtype)


class RocmBackend(Backend):
    """Torch attention for AMD GPUs: SDPA where it fits the contract exactly, a blockwise online softmax elsewhere.

    Chosen automatically for torch tensors on a HIP GPU, and as the last resort for torch tensors on any other GPU
    that no backend serves (``last_resort_reasons``); forced (``backend="rocm"``) it serves torch tensors on any
    device and numpy arrays (run as CPU tensors, returned as numpy).
    """

    name = "rocm"
    PRIORITY = 40
    SUPPORTED_KINDS = ("torch", "numpy")
    SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "float64")
    SUPPORTED_LAYOUTS = ("bshd", "bhsd", "thd")
    SUPPORTS_KVCACHE = True
    SUPPORTS_ALIBI = True
    SUPPORTS_BIAS = True
    SUPPORTS_DBIAS = True
    SUPPORTED_MAX_HEAD_DIM = 576
    SUPPORTS_HEAD_DIM_V = True
    SUPPORTS_MODS = True
    SUPPORTS_DROPOUT = True

    def unavailable_reasons(self, forced: bool = False) -> list[str]:
        if forced:
            try:
                import torch  # noqa: F401
            except ImportError:
                return ["torch is not installed"]
            return []
        return _hip_runtime_reasons()

    def not_supported_reasons(self, call: AttentionCall, forced: bool = False) -> list[str]:
        # Cheap facts first: a numpy call that is not forced here is turned down without importing torch.
        if call.kind == "numpy" and not forced:
            return ["numpy input: rocm takes host arrays only when forced, backend='rocm'"]
        reasons = super().not_supported_reasons(call, forced)
        if call.kind == "numpy" and call.dtype == "bfloat16":
            reasons.append("bfloat16 numpy arrays not supported (pass a torch tensor)")
        if reasons or forced:
            return reasons
        # A HIP build of torch names its GPU device "cuda"; _hip_runtime_reasons has already ruled out NVIDIA.
        if call.device != "cuda":
            return [f"{call.device} tensors not supported (runs on HIP GPUs unless forced with backend='rocm')"]
        return []

    def last_resort_reasons(self, call: AttentionCall) -> list[str] | None:
        """Torch tensors on a GPU that no backend serves (on an NVIDIA GPU: head dims past the cuda kernels' 256,
        Dv != D, attn_bias's gradient, a kernel whose every tile config failed its self-check) run here, in torch
        on their own device, rather than fail. Host arrays and CPU tensors keep the cpu backend's verdict (and
        NoBackendError's hint to name this backend), and so do meta tensors, which hold no data to attend over."""
        if call.kind != "torch" or call.device in ("cpu", "meta"):
            return None
        return self.not_supported_reasons(call, forced=True)

    def forward(self, call: AttentionCall) -> tuple[Any, Any]:
        """Return ``(out, lse)``: out like q (kind, device, dtype, layout), contiguous; lse (B, Hq, Sq) float32
        (float64 for float64 inputs), or None when the call did not ask for it and SDPA served it."""
        import torch

        q, k, v = (_as_torch(x) for x in (call.q, call.k, call.v))
        results = _results_shapes(call)
        if q.device.type == "meta":   # shape inference: a meta tensor has no data, its results none either
            return tuple(_meta_like(q, shape, dt) for _, shape, dt in results)
        _check_fits(results, q)
        with torch.no_grad():
            clean = _clean(call, _compute_dtype(q.dtype), q, k, v) and _bias_finite(call)
            if call.is_varlen:
                return self._forward_varlen(call, q, k, v, careful=not clean)
            if clean and sdpa_fits(call) and (call.nheads_q == call.nheads_kv or _sdpa_has_gqa()):
                return _to_kind(call.q, _forward_sdpa(q, k, v, call)), None
            out, lse = forward_blockwise(q, k, v, call, careful=not clean)
        return _to_kind(call.q, out), _to_kind(call.q, lse)

    def backward(self, call: AttentionCall) -> tuple[Any, Any, Any]:
        """Return ``(dq, dk, dv)`` shaped like q, k, v, same kind, device and dtype as q, contiguous."""
        import torch

        dout, q, k, v, out, lse = (_as_torch(x) for x in (call.dout, call.q, call.k, call.v, call.out, call.lse))
        results = [(("dq", "dk", "dv")[i], tuple(x.shape), "q") for i, x in enumerate((q, k, v))]
        if q.device.type == "meta":
            return tuple(_meta_like(q, shape, dt) for _, shape, dt in results)
        _check_fits(results, q)
        with torch.no_grad():
            # lse is +inf for rows that see no key: only a NaN in it (a poisoned row) needs the careful path.
            clean = (_clean(call, _compute_dtype(q.dtype), q, k, v, dout, out) and not bool(torch.isnan(lse).any())
                     and _bias_finite(call))
            if call.is_varlen:
                grads = self._backward_varlen(call, dout, q, k, v, out, lse, careful=not clean)
            else:
                grads = backward_blockwise(dout, q, k, v, out, lse, call, careful=not clean)
        return tuple(_to_kind(call.q, gr) for gr in grads)

    def with_kvcache(self, call: AttentionCall) -> tuple[Any, Any]:
        """Rotary and the append in torch on the caches' device, then the blockwise forward per sequence and key
        part (``backends.kvcache``), partial results kept in the compute dtype until the merge."""
        import torch

        kv = call.kvcache
        q, k_cache, v_cache = (_as_torch(x) for x in (kv.q, kv.k_cache, kv.v_cache))
        cdt, dev = _compute_dtype(q.dtype), q.device
        with torch.no_grad():
            new = [_as_torch(x) for x in (kv.k_new, kv.v_new)] if kv.seqlen_new else [None, None]
            q = kvcache.rotate_and_append_torch(kv, q, k_cache, v_cache, *new)
            for theirs, mine in ((kv.k_cache, k_cache), (kv.v_cache, v_cache)):
                if kv.seqlen_new and isinstance(theirs, np.ndarray) and any(s < 0 for s in theirs.strides):
                    theirs[...] = mine.numpy()  # _as_torch copied it (torch has no negative strides): write back
            out = torch.empty(q.shape, dtype=cdt, device=dev)
            lse = torch.empty((kv.batch, kv.nheads_q, kv.seqlen_q), dtype=cdt, device=dev)

            workers = (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda"
                       else torch.get_num_threads())
            gather = lambda c, blocks: c[torch.as_tensor(blocks, device=c.device)].flatten(0, 1)  # noqa: E731
            kvcache.forward(kv, _blockwise_into(careful=True), q, out, lse, kvcache.choose_num_splits(kv, workers),
                            empty_like=torch.empty_like, keys=kvcache.cache_keys(kv, k_cache, v_cache, gather))
        return _to_kind(kv.q, out.to(q.dtype)), _to_kind(kv.q, lse)

    @staticmethod
    def _forward_varlen(call: AttentionCall, q: Any, k: Any, v: Any, careful: bool) -> tuple[Any, Any]:
        """Packed sequences: the blockwise forward per sequence (it gives the lse that SDPA does not), each result
        copied into the packed out (total_q, Hq, D) and lse (Hq, total_q)."""
        import torch

        out = torch.empty(q.shape[:-1] + (call.head_dim_v,), dtype=q.dtype, device=q.device)
        lse = torch.empty(call.lse_shape, dtype=_compute_dtype(q.dtype), device=q.device)
        varlen.forward(call, _blockwise_into(careful), q, k, v, out, lse)
        return _to_kind(call.q, out), _to_kind(call.q, lse)

    @staticmethod
    def _backward_varlen(call: AttentionCall, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                         careful: bool) -> tuple[Any, Any, Any]:
        """Packed sequences: the blockwise backward per sequence, copied into packed dq, dk, dv like q, k, v."""
        import torch

        grads = tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v))

        def run(c: AttentionCall, dout_b: Any, q_b: Any, k_b: Any, v_b: Any, out_b: Any, lse_b: Any, dq_b: Any,
                dk_b: Any, dv_b: Any) -> None:
            parts = backward_blockwise(dout_b, q_b, k_b, v_b, out_b, lse_b, c, careful=careful)
            for packed, part in zip((dq_b, dk_b, dv_b), parts):
                packed.copy_(part)

        varlen.backward(call, run, dout, q, k, v, out, lse, *grads)
        return grads


__all__ = ["RocmBackend", "block_sizes", "sdpa_fits", "forward_blockwise", "backward_blockwise"]
