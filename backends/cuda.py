"""CUDA backend: the ``numba.cuda`` kernels of ``numba_flash.cuda`` on NVIDIA GPUs.

Takes GPU arrays zero-copy: torch CUDA tensors, numba device arrays, CuPy and other ``__cuda_array_interface__``
exporters, and DLPack exporters on a CUDA device (through torch). It returns the kind it was given (torch for
torch and DLPack inputs, CuPy for CuPy, numba device arrays otherwise), and launches on torch's current stream for
torch inputs. numpy inputs are copied to the GPU and back only when the backend is forced (``backend="cuda"``).

Dtypes: float32, float16, and bfloat16 on GPUs of compute capability >= 8.0. bfloat16 comes as torch tensors (or
DLPack, through torch): numpy and ``__cuda_array_interface__`` have no bfloat16 type. The kernels get bfloat16
tensors viewed zero-copy as int16 bit patterns (``numba_flash.cuda.device.dtypes``) and bfloat16 outputs the same way.

Several GPUs: a call runs on the GPU that holds its inputs (a torch tensor's device, CuPy's ``.device``, a DLPack
exporter's device id, else the device the driver reports for the data pointer), whatever numba's current device
is; its outputs are allocated there. Inputs on different GPUs are refused with ``AttentionInputError``.

Self-check: on a real GPU each kernel specialisation checks itself against the reference on its first launch
(``numba_flash.cuda.selfcheck``; ``NUMBA_FLASH_SELFCHECK=0`` turns that off). A failed check is replaced by a
smaller tile config that passes, which ``explain()`` notes; when no config of a kernel passes, the backend
declines calls that need it, with the failures as reasons.

The Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) runs these kernels too, slowly, for tests: the registry
never picks the backend there on its own, only when forced. Its "device memory" is host memory, so when forced it
also takes torch CPU tensors (copied in and out like numpy arrays): the only host arrays that can hold bfloat16.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_flash.arrays import is_torch_tensor
from numba_flash.cuda.host.config import MIN_COMPUTE_CAPABILITY, dtype_supported_on
from numba_flash.cuda.host import row_stats
from numba_flash.errors import AttentionInputError
from numba_flash.validation import AttentionCall

from . import cuda_thin, kvcache, varlen
from .base import Backend
from .cuda_io import Session, bshd_view, dbias_like, device_index, is_numba_device_array, lead_axis

HOST_REASON = "host (numpy) input: GPU backends take it only when forced, backend='cuda'"
BF16_HOST_REASON = "bfloat16 numpy arrays not supported (numpy has no bfloat16: pass torch CUDA tensors)"
BF16_CAI_REASON = ("bfloat16 __cuda_array_interface__ arrays not supported (the interface has no bfloat16 type: "
                   "pass torch CUDA tensors or DLPack)")
BF16_CC_REASON = "bfloat16 needs a GPU of compute capability >= {need}, this one is {have}"
SIM_REASON = "CUDA simulator (NUMBA_ENABLE_CUDASIM=1): used only when forced, backend='cuda'"


def _simulating() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def _gpu_compute_capability(x: Any) -> tuple[int, int]:
    """Compute capability of the GPU holding ``x`` (a torch tensor or DLPack exporter on CUDA), else of numba's
    current device."""
    try:
        import torch

        index = x.device if is_torch_tensor(x) else int(x.__dlpack_device__()[1])
        major, minor = torch.cuda.get_device_capability(index)
        return (int(major), int(minor))
    except Exception:  # no torch, or a DLPack exporter torch cannot place: numba knows the current device
        from numba_flash.cuda.host.devices import compute_capability

        return compute_capability()


def _packed(call: AttentionCall) -> tuple | None:
    """The launch functions' ``packed``: a packed call's (cu_seqlens_q, cu_seqlens_k) host arrays, else None."""
    return (call.packing.cu_seqlens_q, call.packing.cu_seqlens_k) if call.is_varlen else None


class CudaBackend(Backend):
    """``numba.cuda`` FlashAttention kernels. ``config`` overrides tile sizes for every call made through this
    instance (see ``numba_flash.cuda.tile_config_override`` for a scoped override)."""

    name = "cuda"
    PRIORITY = 30
    SUPPORTED_KINDS = ("torch", "cuda_array", "dlpack", "numpy")
    SUPPORTED_DEVICES = ("cuda",)
    SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
    SUPPORTED_LAYOUTS = ("bshd", "bhsd", "thd")
    IS_DETERMINISTIC = True
    SUPPORTS_KVCACHE = True
    SUPPORTS_ALIBI = True
    SUPPORTS_BIAS = True
    SUPPORTS_DBIAS = True  # any broadcast (numba_flash/cuda/host/launch_dbias.py), user mods too
    SUPPORTS_DROPOUT = True
    SUPPORTS_MODS = True   # compiled into the kernels as device functions (numba_flash/cuda/device/user_mods.py)
    SUPPORTS_HEAD_DIM_V = True   # kernels built for the bucket of max(D, Dv); the tensor-core backward needs Dv = D
    SUPPORTED_MAX_HEAD_DIM = 576   # past 256 on the SIMT kernels, from sm_80 on (config.WIDE_HEAD_DIM_BUCKETS)

    def __init__(self, config: Any = None):
        self.config = config
        self._availability: tuple[bool, str | None] | None = None

    def _probe(self) -> tuple[bool, str | None]:
        """(is it the simulator, reason it cannot run at all or None); probed once."""
        if self._availability is None:
            try:
                from numba import config as numba_config
                from numba import cuda
            except Exception as exc:  # numba-cuda missing or broken
                self._availability = (False, f"numba.cuda cannot be imported ({type(exc).__name__}: {exc})")
            else:
                if numba_config.ENABLE_CUDASIM:
                    self._availability = (True, None)
                else:
                    try:
                        ok = cuda.is_available()
                    except Exception:
                        ok = False
                    self._availability = (False, None if ok else "no CUDA GPU")
        return self._availability

    def unavailable_reasons(self, forced: bool = False) -> list[str]:
        simulator, reason = self._probe()
        if reason:
            return [reason]
        if simulator and not forced:
            return [SIM_REASON]
        return []

    def not_supported_reasons(self, call: AttentionCall, forced: bool = False) -> list[str]:
        reasons = []
        if call.kind == "numpy":
            if not forced:
                reasons.append(HOST_REASON)
        elif is_numba_device_array(call.q):
            pass  # a real or simulated numba device array
        elif call.kind not in self.SUPPORTED_KINDS:
            reasons.append(f"{call.kind} arrays not supported")
        elif call.device != "cuda" and not (forced and call.kind == "torch" and call.device == "cpu"
                                            and _simulating()):
            reasons.append(f"{call.device} tensors not supported (runs on cuda)")
        elif call.kind == "torch":
            import torch

            if getattr(torch.version, "hip", None):
                reasons.append("HIP (ROCm) tensors not supported (runs on NVIDIA CUDA)")
        if call.dtype not in self.SUPPORTED_DTYPES:
            reasons.append(f"{call.dtype} not supported")
        elif call.dtype == "bfloat16" and call.kind == "numpy":
            reasons.append(BF16_HOST_REASON)
        elif call.dtype == "bfloat16" and call.kind == "cuda_array":
            reasons.append(BF16_CAI_REASON)
        reasons.extend(self.feature_reasons(call))
        if call.kvcache is not None and call.kind not in ("numpy", "torch"):
            reasons.append("KV cache only as torch tensors or numpy arrays (the append writes through them)")
        if not reasons:
            reasons.extend(self.unavailable_reasons(forced))
        if not reasons:
            reasons.extend(self._selfcheck_problems(call)[1])
        if not reasons and call.dtype == "bfloat16" and not self._probe()[0]:
            # The kernels only shift and round bfloat16 bits, which any GPU could do, but the contract offers
            # bfloat16 where the hardware has it (sm_80 on). The simulator has no compute capability to speak of.
            have = _gpu_compute_capability(call.q)
            if not dtype_supported_on(call.dtype, have):
                need = MIN_COMPUTE_CAPABILITY[call.dtype]
                reasons.append(BF16_CC_REASON.format(need=f"{need[0]}.{need[1]}", have=f"{have[0]}.{have[1]}"))
        if not reasons and call.kvcache is None and max(call.head_dim, call.head_dim_v) > 256:
            from numba_flash.cuda.host.config import head_dim_reason, smem_limit_for
            from numba_flash.cuda.kernels.registry import kernel_name

            limit = smem_limit_for(_gpu_compute_capability(call.q))
            roles = ("dkdv", "dq") if call.is_backward else ("forward",)
            kernels = tuple(kernel_name(role) for role in roles)
            why = (head_dim_reason(max(call.head_dim, call.head_dim_v), kern, limit) for kern in kernels)
            reasons.extend(dict.fromkeys(w for w in why if w))
        return reasons

    def _selfcheck_problems(self, call: AttentionCall) -> tuple[list[str], list[str]]:
        """(notes, reasons) from the self-checks already run for the kernels this call would use; runs none. The
        notes cover the backward kernels of a forward call too, since explain() shows them ahead of a backward."""
        from numba_flash.cuda import selfcheck

        if not selfcheck.has_failures():   # the common case: keep the per-call cost at one lookup
            return [], []
        from numba_flash.cuda.host.devices import configs_for
        from numba_flash.cuda.host.plan import backward_kernels, forward_kernel
        from numba_flash.cuda.kernels.registry import kernel_name

        flags = (call.window_left >= 0, call.window_right >= 0, call.softcap > 0)
        try:
            if call.kvcache is not None:
                kernels = (kernel_name("decode"),)
            else:
                cc = _gpu_compute_capability(call.q)
                dims = dict(head_dim_v=call.head_dim_v)
                kernels = (forward_kernel(call.dtype, call.head_dim, self.config, cc=cc, precision=call.precision,
                                          bias=call.bias is not None, **dims),
                           *backward_kernels(call.dtype, call.head_dim, self.config, cc=cc, **dims))
            cfgs = configs_for(max(call.head_dim, call.head_dim_v), call.dtype, self.config, kernels)
        except AttentionInputError:       # a bad tile override: the call itself will say so
            return [], []
        used = kernels[1:] if call.is_backward else kernels[:1]
        index = device_index(call.q)
        device = selfcheck.current_device() if index is None else index
        notes, reasons = [], []
        for kern, cfg in cfgs.items():
            n, r = selfcheck.problems([cfg], *flags, call.dtype, device=device, alibi=call.alibi is not None,
                                      bias=call.bias is not None, dropout=bool(call.dropout_p))
            notes.extend(n)
            (reasons if kern in used else notes).extend(r)
        return notes, reasons

    def notes(self, call: AttentionCall) -> list[str]:
        """Which kernels serve the call (tensor cores or the float32 SIMT kernels, and why not tensor cores), and
        self-check failures that it works around (a fallback tile config serves instead)."""
        if self._probe()[1]:    # no GPU, nothing was checked
            return []
        thin = cuda_thin.note(call)
        return self._kernels_note(call) + self._selfcheck_problems(call)[0] + ([thin] if thin else [])

    def _kernels_note(self, call: AttentionCall) -> list[str]:
        """For float16 and bfloat16, which kernels run the call, and its backward (explain() describes forward
        calls, which a training step's backward follows); for float32 that allows TF32, whether the forward runs
        on it. Other float32 calls always run on the SIMT kernels."""
        from numba_flash.cuda.host.config import TC_DTYPES
        from numba_flash.cuda.host.plan import tensor_core_reason, tf32_reason, wgmma_reason

        if call.kvcache is not None:
            return []
        cc = _gpu_compute_capability(call.q)
        if call.dtype == "float32" and not call.is_backward:
            try:
                why = tf32_reason(call.head_dim, self.config, cc, head_dim_v=call.head_dim_v,
                                  bias=call.bias is not None)
            except AttentionInputError as exc:
                return [str(exc)]
            if call.precision != "tf32":   # say where the opt-in would help: users ask for it by name
                return [] if why else ["float32 SIMT kernels; precision='tf32' would run the forward on TF32 "
                                       "tensor cores"]
            if why is not None:
                return [f"SIMT kernels (float32): TF32 allowed, not used: {why}"]
            return ["TF32 tensor-core forward (mma.sync m16n8k8); the backward on the float32 SIMT kernels"]
        if call.dtype not in TC_DTYPES:
            return []
        args = (call.dtype, call.head_dim, self.config)
        try:
            dims = dict(head_dim_v=call.head_dim_v)
            why = tensor_core_reason(*args, cc=cc, backward=call.is_backward, dbias=call.return_dbias, **dims)
            why_backward = why if call.is_backward else tensor_core_reason(*args, cc=cc, backward=True, **dims)
        except AttentionInputError as exc:
            return [str(exc)]
        if why is not None:
            return [f"SIMT kernels: {why}"]
        try:   # the call raises where wgmma=True asks for what it cannot have: say so here too
            wgmma_why = call.is_backward or wgmma_reason(call.dtype, call.head_dim, self.config, cc, call.head_dim_v)
        except AttentionInputError as exc:
            return [str(exc)]
        wgmma = [] if wgmma_why else [
            f"the forward on Hopper's wgmma kernel ({call.dtype}; asked for by tile_config_override(wgmma=True))"]
        if why_backward is not None:
            return wgmma + [f"tensor-core kernels (mma.sync, {call.dtype}); the backward on the SIMT kernels: "
                            f"{why_backward}"]
        return wgmma + [f"tensor-core kernels (mma.sync, {call.dtype}), forward and backward"]

    def forward(self, call: AttentionCall) -> tuple[Any, Any]:
        """out like q (same kind, dtype, layout); lse (B, Hq, Sq) float32."""
        if cuda_thin.enabled():   # opt-in: launches planned per call signature, replayed through the driver
            # Without the row statistics: a replay would write the one buffer the plan kept for every call.
            return cuda_thin.forward(call, self.config, lambda c: self._dispatch_forward(c, keep_stats=False))
        return self._dispatch_forward(call)

    def _dispatch_forward(self, call: AttentionCall, keep_stats: bool = True) -> tuple[Any, Any]:
        """``forward`` through numba's dispatcher; ``keep_stats``: keep the SIMT forward's row statistics for the
        backward given the lse it returns (host/row_stats.py)."""
        io = Session(call)
        with io.on_device():
            return self._forward(call, io, keep_stats)

    def _forward_runner(self, io: Session, kept: list | None = None) -> Any:
        """``run(call, q, k, v, out, lse)``: the forward kernel on (B, S, H, D) device views, on io's stream. With
        ``kept`` (a list), the SIMT kernel also writes the row statistics into an array it allocates, appended to
        ``kept`` as (the array's owner, the device array)."""
        from numba_flash.cuda.host.flash import flash_forward
        from numba_flash.cuda.host.launch import alibi_arg, dropout_arg
        from numba_flash.cuda.device.user_mods import cuda_mods

        def alloc(shape: tuple[int, ...]) -> Any:
            owner, dev = io.empty(shape, "float32")
            kept.append((owner, dev))
            return dev

        def run(c: AttentionCall, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
            flash_forward(q, k, v, out, lse, softmax_scale=c.softmax_scale, window_left=c.window_left,
                          window_right=c.window_right, softcap=c.softcap, dtype=c.dtype,
                          alibi=alibi_arg(c.alibi, io.stream), bias=io.bias(c),
                          dropout=dropout_arg(c.dropout_p, c.dropout_seed, c.dropout_batch0),
                          mods=cuda_mods(c.mods), block_mask=c.mods and c.mods.block_mask, override=self.config,
                          packed=_packed(c), stream=io.stream, precision=c.precision,
                          stats_alloc=None if kept is None else alloc)

        return run

    def _forward(self, call: AttentionCall, io: Session, keep_stats: bool = True) -> tuple[Any, Any]:
        q, k, v = (io.device(x, n) for x, n in ((call.q, "q"), (call.k, "k"), (call.v, "v")))
        out_shape = tuple(int(s) for s in call.q.shape[:-1]) + (call.head_dim_v,)
        out_user, out = io.empty(out_shape, call.dtype)
        lse_user, lse = io.empty(call.lse_shape, "float32")
        kept: list | None = [] if keep_stats else None
        run = self._forward_runner(io, kept)

        if call.is_varlen:   # one launch over every sequence's tiles
            varlen.forward_once(call, run, q, k, v, out, lse, lead_axis=lead_axis, fill=io.fill)
        else:
            lay = call.layout
            run(call, bshd_view(q, lay), bshd_view(k, lay), bshd_view(v, lay), bshd_view(out, lay), lse)
        result = io.result(out_user, out), io.result(lse_user, lse)
        if kept and len(kept) == 1:
            row_stats.keep(result[1], kept[0][1], owner=kept[0][0])
        io.finish()
        return result

    def with_kvcache(self, call: AttentionCall) -> tuple[Any, Any]:
        """Rotary and the append through the caller's tensors (torch on their GPU, numpy on the host), then one
        launch of the decode kernel over (sequence, kv head, split), reading the cache in place (paged or not; a
        host cache is copied to the GPU whole, once), and one launch of the merge of the splits
        (``numba_flash.cuda.kernels.decode``). Splits are float32 partials, so every dtype splits."""
        from numba_flash.cuda.host.launch import alibi_arg
        from numba_flash.cuda.host.flash import decode_config
        from numba_flash.cuda.host.launch_decode import flash_decode

        kv = call.kvcache
        left, right = kv.window_for(max(1, int(kv.seqlens_k.max())))   # capped: the same mask for every sequence
        io = Session(call)
        with io.on_device():
            def device_caches() -> dict[str, Any]:
                return {name: io.device(x, name) for name, x in (("k_cache", kv.k_cache), ("v_cache", kv.v_cache))}

            # A GPU cache is viewed in place; a host one is copied after the append, below.
            caches = None if io.host else device_caches()
            # Chosen (and self-checked on a GPU's first use) before the append: a refusal leaves the cache as it was.
            cfg = decode_config(kv.head_dim, kv.dtype, window_left=left, window_right=right, softcap=kv.softcap,
                                alibi=kv.alibi is not None, override=self.config, like=caches)
            q_rot = self._rotate_and_append(kv)
            caches = caches or device_caches()
            q = io.device(q_rot, "q")
            out_user, out = io.empty(tuple(int(s) for s in kv.q.shape), kv.dtype)
            lse_user, lse = io.empty((kv.batch, kv.nheads_q, kv.seqlen_q), "float32")
            splits = max(1, min(kvcache.choose_num_splits(kv, self._multiprocessors()), int(kv.seqlens_k.max())))
            _, part_out = io.empty((splits, kv.batch, kv.nheads_q, kv.seqlen_q, kv.head_dim), "float32")
            _, part_lse = io.empty((splits, kv.batch, kv.nheads_q, kv.seqlen_q), "float32")
            rows = kv.cache_rows if kv.cache_rows is not None else np.zeros(kv.batch, np.int64)
            seqinfo = np.stack([rows, kv.key_start, kv.key_end], axis=1).astype(np.int32)
            table = kv.block_table if kv.paged else np.zeros((1, 1), np.int64)
            flash_decode(cfg, q, caches["k_cache"], caches["v_cache"],
                         io.cuda.to_device(seqinfo, stream=io.stream),
                         io.cuda.to_device(np.ascontiguousarray(table, np.int32), stream=io.stream), out, lse,
                         part_out, part_lse, page_size=kv.page_size, softmax_scale=kv.softmax_scale,
                         window_left=left, window_right=right, softcap=kv.softcap, dtype=kv.dtype,
                         alibi=alibi_arg(kv.alibi, io.stream), stream=io.stream)
            result = io.result(out_user, out), io.result(lse_user, lse)
            io.finish()
        return result

    @staticmethod
    def _rotate_and_append(kv: Any) -> Any:
        """Rotary on q and the new keys and the append, through the caller's arrays; q rotated, in q's kind."""
        if kv.kind == "torch" and kv.device != "cpu":
            import torch

            with torch.no_grad():
                # bfloat16 as bfloat16, not as its int16 bits: rotary computes with the values.
                plain = [None if x is None else x.detach() for x in (kv.q, kv.k_cache, kv.v_cache, kv.k_new, kv.v_new)]
                return kvcache.rotate_and_append_torch(kv, *plain)
        q_rot = kvcache.rotate_and_append_host(kv, np.float32)
        if is_torch_tensor(kv.q):
            import torch

            return torch.from_numpy(q_rot).to(kv.q.dtype)
        return q_rot.astype(kv.dtype)

    def _multiprocessors(self) -> int:
        """SMs of the current GPU (the parallelism split-KV fills); 1 under the simulator."""
        if self._probe()[0]:
            return 1
        from numba import cuda

        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)

    def backward(self, call: AttentionCall) -> tuple[Any, ...]:
        """dq, dk, dv shaped like q, k, v (same kind and dtype as q); dk, dv summed over each GQA group; with
        ``call.return_dbias`` also dbias, shaped like attn_bias, of its kind and dtype (summed over the batch when
        the bias is shared by it)."""
        if cuda_thin.enabled():   # opt-in, as in forward
            return cuda_thin.backward(call, self.config, self._dispatch_backward)
        return self._dispatch_backward(call)

    def _dispatch_backward(self, call: AttentionCall) -> tuple[Any, ...]:
        """``backward`` through numba's dispatcher."""
        io = Session(call)
        with io.on_device():
            return self._backward(call, io)

    def _backward(self, call: AttentionCall, io: Session) -> tuple[Any, Any, Any]:
        from numba_flash.cuda.device.user_mods import cuda_mods
        from numba_flash.cuda.host.flash import flash_backward
        from numba_flash.cuda.host.launch import alibi_arg, dropout_arg

        names = ("dout", "q", "k", "v", "out")
        dout, q, k, v, out = (io.device(getattr(call, n), n) for n in names)
        lse = io.lse_in(call.lse)
        stats = row_stats.find(call.lse, (1, *lse.shape) if call.is_varlen else tuple(lse.shape))
        grads = [io.empty(tuple(int(s) for s in x.shape), call.dtype) for x in (call.q, call.k, call.v)]
        (dq_user, dq), (dk_user, dk), (dv_user, dv) = grads
        # Summed in float32 whatever the bias's dtype; zeros first: the kernel adds into it.
        dbias = self.cuda_zeros(io, call.bias.shape) if call.return_dbias else None

        def run(c: AttentionCall, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any,
                dv: Any) -> None:
            _, delta = io.empty(c.lse_shape, "float32")   # scratch, like lse: (B, Hq, Sq), or (1, Hq, total_q) packed
            delta = lead_axis(delta) if c.is_varlen else delta
            flash_backward(dout, q, k, v, out, lse, dq, dk, dv, delta, softmax_scale=c.softmax_scale,
                           window_left=c.window_left, window_right=c.window_right, softcap=c.softcap,
                           dtype=c.dtype, alibi=alibi_arg(c.alibi, io.stream), bias=io.bias(c),
                           dropout=dropout_arg(c.dropout_p, c.dropout_seed, c.dropout_batch0),
                           mods=cuda_mods(c.mods), block_mask=c.mods and c.mods.block_mask, override=self.config,
                           packed=_packed(c), dbias=dbias, stream=io.stream, row_stats=stats)

        if call.is_varlen:   # one launch of each backward kernel over every sequence's tiles
            varlen.backward_once(call, run, dout, q, k, v, out, lse, dq, dk, dv, lead_axis=lead_axis, fill=io.fill)
        else:
            lay = call.layout
            run(call, *(bshd_view(x, lay) for x in (dout, q, k, v, out)), lse,
                *(bshd_view(x, lay) for x in (dq, dk, dv)))
        result = tuple(io.result(u, d) for u, d in grads)
        if dbias is not None:
            result += (dbias_like(call.bias.array, dbias, io.stream),)
        io.finish()
        return result

    @staticmethod
    def cuda_zeros(io: Any, shape: tuple[int, ...]) -> Any:
        """A float32 device array of zeros on io's stream."""
        return io.cuda.to_device(np.zeros(tuple(int(n) for n in shape), np.float32), stream=io.stream)
