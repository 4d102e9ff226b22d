"""Checks every rule of the contract's "Bad input" section before any work, and describes a valid call.

``validate_forward`` / ``validate_backward`` return an ``AttentionCall``: the arrays as given (never modified, and
copied only for a torch tensor with a pending negation or conjugation bit, which no reader of raw memory can see)
plus every derived fact a backend needs to decide whether it can serve the call and to run it. Options come out in
the form every backend can run as is: window bounds capped at Sq + Sk, the softcap as
``semantics.effective_softcap`` defines it for the compute dtype.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .arguments import refuse_masked
from .call_signature import forward_signature, recalled, remember
from .arrays import array_kind, as_float64, device_of, dtype_name, resolve_torch_bits
from .errors import bad_arg, short_repr
from .mods import check_mods
from .semantics import clamp_window_bound, compute_dtype_name, default_scale, effective_softcap, effective_window
from .varlen import check_arguments, check_packing

LAYOUTS = ("bshd", "bhsd", "thd")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_HEAD_DIM = 576    # q and k (MLA's 512 + 64 rotary dims)
MAX_HEAD_DIM_V = 512  # v, and so the output

_DIM_NAMES = {
    "bshd": {"q": "(B, Sq, Hq, D)", "k": "(B, Sk, Hkv, D)", "v": "(B, Sk, Hkv, Dv)"},
    "bhsd": {"q": "(B, Hq, Sq, D)", "k": "(B, Hkv, Sk, D)", "v": "(B, Hkv, Sk, Dv)"},
    "thd": {"q": "(total_q, Hq, D)", "k": "(total_k, Hkv, D)", "v": "(total_k, Hkv, Dv)"},
}


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call. Sizes are layout-independent: ``seqlen_q`` is Sq whatever the layout.

    For packed sequences (layout "thd") ``packing`` says where each sequence lies, ``batch`` is the number of
    sequences and ``seqlen_q`` / ``seqlen_k`` are the longest sequence's lengths (an empty one included)."""

    q: Any
    k: Any
    v: Any
    kind: str          # 'numpy', 'torch', 'cuda_array', 'dlpack'
    device: str        # 'cpu', 'cuda', 'hip', ...
    dtype: str         # 'float32', 'float16', 'bfloat16', 'float64'
    layout: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_q: int
    nheads_kv: int
    head_dim: int
    causal: bool
    softmax_scale: float
    window_left: int   # -1: unbounded
    window_right: int  # -1: unbounded; 0 when causal
    softcap: float
    return_lse: bool = False
    # backward only
    dout: Any = None
    out: Any = None
    lse: Any = None
    extra: dict = field(default_factory=dict)
    packing: Any = None  # numba_flash.varlen.Packing for layout "thd", else None
    alibi: Any = None    # ALiBi slopes as a read-only float64 host array (B, Hq), else None
    bias: Any = None     # ``Bias`` for attn_bias, else None
    return_dbias: bool = False  # backward only: also return dbias, shaped like attn_bias
    head_dim_v: int = 0  # Dv, v's head dim and the output's; 0 (the default) means D
    mods: Any = None     # ``numba_flash.mods.Mods``: bias_mod, mask_mod, score_mod (+ grad), block_mask; else None
    dropout_p: float = 0.0   # numba_flash.dropout: keep (b, h, i, j) where its Philox word < dropout_threshold(p)
    dropout_seed: int = 0    # in [0, 2**64)
    dropout_batch0: int = 0  # the b of this call's first batch row (a packed sequence's index, run as B = 1)
    precision: str = "ieee"  # "tf32": float32 products may run in TF32 where a backend has such a kernel

    def __post_init__(self) -> None:
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def is_backward(self) -> bool:
        return self.dout is not None

    @property
    def has_window(self) -> bool:
        """True when a sliding window (not plain causal) restricts the keys."""
        return self.window_left >= 0 or (self.window_right >= 0 and not (self.causal and self.window_right == 0))

    @property
    def kvcache(self) -> Any:
        """The ``numba_flash.kvcache.KVCacheCall`` of a ``with_kvcache`` call, else None."""
        return self.extra.get("kvcache")

    @property
    def is_varlen(self) -> bool:
        return self.packing is not None

    @property
    def lse_shape(self) -> tuple[int, ...]:
        """(B, Hq, Sq), or (Hq, total_q) for packed sequences."""
        if self.packing is not None:
            return (self.nheads_q, self.packing.total_q)
        return (self.batch, self.nheads_q, self.seqlen_q)

    @property
    def group_size(self) -> int:
        return self.nheads_q // self.nheads_kv

    def describe(self) -> str:
        if self.packing is not None:
            sizes = (f"B={self.batch} total_q={self.packing.total_q} total_k={self.packing.total_k} "
                     f"max_Sq={self.seqlen_q} max_Sk={self.seqlen_k}")
        else:
            sizes = f"B={self.batch} Sq={self.seqlen_q} Sk={self.seqlen_k}"
        parts = [f"{self.kind}/{self.device}", self.dtype, self.layout,
                 f"{sizes} Hq={self.nheads_q} Hkv={self.nheads_kv} D={self.head_dim}"
                 + (f" Dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else "")]
        if self.causal:
            parts.append("causal")
        if self.has_window:
            parts.append(f"window=({self.window_left}, {self.window_right})")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi is not None:
            parts.append("alibi")
        if self.bias is not None:
            parts.append(f"attn_bias{self.bias.shape}")
        if self.mods is not None:
            parts.append(self.mods.describe())
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p:g}")
        if self.precision != "ieee":
            parts.append(f"precision={self.precision}")
        parts.append("backward" if self.is_backward else "with_kvcache" if self.kvcache is not None else "forward")
        return " ".join(parts)


def is_finite_real(value: Any) -> bool:
    """A real number (not a bool) that is finite as a float: an int beyond float64's range (10**400) is not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _check_torch(name: str, x: Any) -> Any:
    """Refuse torch layouts no backend reads; resolve lazy negation/conjugation bits (see ``resolve_torch_bits``).

    Sparse (and other non-strided) tensors are refused rather than densified: every kernel reads strided memory,
    and a silent ``to_dense()`` could allocate without bound. (``refuse_masked`` has refused a MaskedTensor.)"""
    import torch

    if x.is_nested:
        raise bad_arg(name, "a dense (strided) tensor", "a nested tensor")
    if x.layout != torch.strided:
        raise bad_arg(name, "a dense (strided) tensor (call .to_dense() first)",
                      f"a tensor with layout {str(x.layout).replace('torch.', '')}")
    return resolve_torch_bits(x)


def check_array(name: str, x: Any, layout: str) -> tuple[Any, str, tuple[int, ...], str, str]:
    """Check array argument ``name`` (q, k, v, dout, out, a cache, ...) for ``layout``: an array kind the library
    reads, not masked, 4 dimensions (3 for "thd"), a floating dtype, no empty axis. Returns ``(x, kind, shape,
    dtype name, device)``, ``x`` with any lazy torch bit resolved (``check_same_as_q`` compares two such infos)."""
    kind = array_kind(x)
    if kind is None:
        raise bad_arg(name, "an array (numpy, torch, __cuda_array_interface__ or __dlpack__ exporter)",
                      f"an object of type {type(x).__name__}")
    refuse_masked(name, x)
    if kind == "torch":
        x = _check_torch(name, x)
    shape = tuple(int(s) for s in x.shape)
    dims = _DIM_NAMES[layout].get(name, _DIM_NAMES[layout]["q"])
    ndim = 3 if layout == "thd" else 4
    if len(shape) != ndim:
        raise bad_arg(name, f"{ndim} dimensions {dims} for layout {layout!r}", f"shape {shape}")
    dt = dtype_name(x)
    if dt not in FLOAT_DTYPES:
        swapped = isinstance(x.dtype, np.dtype) and not x.dtype.isnative
        if swapped and x.dtype.newbyteorder("=").name in FLOAT_DTYPES:
            raise bad_arg(name, f"a floating dtype ({', '.join(FLOAT_DTYPES)}) in this machine's byte order",
                          f"dtype {dt}, {x.dtype.newbyteorder('=').name} with its bytes swapped (convert it: "
                          f"{name}.astype({name}.dtype.newbyteorder('=')))")
        raise bad_arg(name, f"a floating dtype ({', '.join(FLOAT_DTYPES)})", f"dtype {dt}")
    if 0 in shape:
        raise bad_arg(name, f"every size >= 1 in {dims}", f"shape {shape}")
    return x, kind, shape, dt, device_of(x)


def _result_kind_ok(kind: str, qkind: str) -> bool:
    """Whether an array of ``kind`` may stand beside inputs of ``qkind`` as a forward's result (out, lse) or dout:
    the same kind, or for DLPack inputs the numpy arrays or torch tensors the forward returned (device apart)."""
    return kind == qkind or (qkind == "dlpack" and kind in ("numpy", "torch"))


def check_same_as_q(name: str, info: tuple, q_info: tuple) -> None:
    """AttentionInputError unless array ``name`` has q's kind, dtype and device; both infos as ``check_array``
    returns them."""
    _, kind, _, dt, dev = info
    _, qkind, _, qdt, qdev = q_info
    if kind != qkind:
        raise bad_arg(name, f"the same array kind as q ({qkind})", kind)
    if dt != qdt:
        raise bad_arg(name, f"the same dtype as q ({qdt})", f"dtype {dt}")
    if dev != qdev:
        raise bad_arg(name, f"the same device as q ({qdev})", f"device {dev}")


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise bad_arg(name, "a bool", repr(value))
    return bool(value)


def check_deterministic(value: Any) -> bool:
    """``deterministic``, accepted by every entry point as the contract says: every backend's backward is bitwise
    reproducible already (no atomics), so True changes nothing; a value that is not a bool is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise bad_arg("deterministic", "a bool", short_repr(value))
    return bool(value)


#: What ``precision`` takes: "ieee" computes float32 inputs in float32 throughout; "tf32" allows a backend to run
#: their two products on TF32 tensor cores (10 mantissa bits per operand, float32 sums), as torch's allow_tf32.
PRECISIONS = ("ieee", "tf32")


def check_precision(value: Any) -> str:
    """``precision``: "ieee" (the default) or "tf32". A permission, not a demand: only float32 inputs are affected,
    and a backend without a TF32 kernel for the call computes in float32 (``explain()`` says which ran)."""
    if not isinstance(value, str) or value not in PRECISIONS:
        raise bad_arg("precision", "'ieee' or 'tf32'", short_repr(value))
    return value


def check_options(causal: Any, softmax_scale: Any, window_size: Any, softcap: Any, layout: Any,
                  return_lse: Any) -> tuple[bool, Any, tuple[int, int], float, str, bool]:
    """Check the scalar options every attention call takes; returns them as plain Python values, in this order:
    ``(causal, softmax_scale or None, (left, right), softcap, layout, return_lse)``."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise bad_arg("layout", "'bshd' or 'bhsd', or 'thd' for packed sequences", repr(layout))
    causal = _check_bool("causal", causal)
    return_lse = _check_bool("return_lse", return_lse)
    if softmax_scale is not None:
        if not is_finite_real(softmax_scale) or softmax_scale <= 0:
            raise bad_arg("softmax_scale", "None or a finite number > 0", short_repr(softmax_scale))
        if float(softmax_scale) == 0.0:  # 1e-400 as a Fraction, or a tiny int ratio: 0 once it is a float
            raise bad_arg("softmax_scale", "None or a finite number > 0 (that is > 0 as a float64)",
                          short_repr(softmax_scale))
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window_size)):
        raise bad_arg("window_size", "a pair of ints (left, right)", short_repr(window_size))
    if any(w < -1 for w in window_size):
        raise bad_arg("window_size", "each bound >= 0, or -1 for unbounded", short_repr(tuple(window_size)))
    if not is_finite_real(softcap) or softcap < 0:
        raise bad_arg("softcap", "a finite number >= 0 (0 disables it)", short_repr(softcap))
    return causal, softmax_scale, (int(window_size[0]), int(window_size[1])), float(softcap), layout, return_lse


def resolve_layout(layout: Any, cu_seqlens_q: Any, cu_seqlens_k: Any) -> Any:
    """``layout`` as given (kept, and checked against the other arguments), or for None (the default) "thd" when
    cumulative sequence lengths are given, else "bshd": ``forward(q, k, v, cu_seqlens_q=...)`` needs no layout."""
    if layout is None:
        return "thd" if cu_seqlens_q is not None or cu_seqlens_k is not None else "bshd"
    return layout


def validate_forward(
    q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str | None = None,
    return_lse: bool = False, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None, max_seqlen_q: Any = None,
    max_seqlen_k: Any = None, alibi_slopes: Any = None, attn_bias: Any = None, bias_mod: Any = None,
    mask_mod: Any = None, score_mod: Any = None, block_mask: Any = None, dropout_p: float = 0.0,
    dropout_seed: int | None = None, precision: str = "ieee",
) -> AttentionCall:
    """Check a forward call against the contract; raise ``AttentionInputError`` on the first violation.

    q: (B, Sq, Hq, D) ["bshd"] or (B, Hq, Sq, D) ["bhsd"]; k, v: (B, Sk, Hkv, D) or (B, Hkv, Sk, D).
    Packed sequences ["thd"]: q (total_q, Hq, D), k, v (total_k, Hkv, D), with ``cu_seqlens_q`` / ``cu_seqlens_k``
    (B + 1,) int32 prefix sums and optional ``max_seqlen_q`` / ``max_seqlen_k`` bounds (see ``numba_flash.varlen``).
    ``layout`` None means "thd" when cu_seqlens are given, else "bshd". ``alibi_slopes``: None, (Hq,) or (B, Hq),
    finite, any float dtype, the array kind and device of q (read on the host). ``attn_bias``: None or an array
    broadcastable to (B, Hq, Sq, Sk), float32 or q's dtype, the array kind and device of q (see ``check_bias``).
    ``bias_mod``, ``mask_mod``, ``score_mod``, ``block_mask``: see ``numba_flash.mods`` (compiled here, once per
    function). ``dropout_p`` in [0, 1) with ``dropout_seed`` an int in [0, 2**64) (needed when dropout_p > 0; see
    ``numba_flash.dropout``). ``precision``: ``check_precision``. Plain calls: checked once per signature
    (``call_signature``).
    """
    signature = forward_signature(locals())   # before any check, of the arguments as given
    if (known := recalled(signature, AttentionCall, q, k, v)) is not None:
        return known
    given = (q, k, v)
    precision = check_precision(precision)
    layout = resolve_layout(layout, cu_seqlens_q, cu_seqlens_k)
    causal, softmax_scale, window_size, softcap, layout, return_lse = check_options(
        causal, softmax_scale, window_size, softcap, layout, return_lse)
    check_arguments(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    infos = {name: check_array(name, x, layout) for name, x in (("q", q), ("k", k), ("v", v))}
    (q, qkind, qshape, qdt, qdev), (k, _, kshape, _, _), (v, _, vshape, _, _) = infos["q"], infos["k"], infos["v"]
    for name in ("k", "v"):
        check_same_as_q(name, infos[name], infos["q"])
    if vshape[:-1] != kshape[:-1]:
        raise bad_arg("v", f"the shape of k {kshape} but for the head dim", f"shape {vshape}")
    packing = None
    if layout == "thd":
        packing = check_packing(qshape[0], kshape[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        batch, sq, hq, d = packing.batch, packing.max_seqlen_q, qshape[1], qshape[2]
        sk, hkv = packing.max_seqlen_k, kshape[1]
    else:
        s_axis, h_axis = (1, 2) if layout == "bshd" else (2, 1)
        batch, sq, hq, d = qshape[0], qshape[s_axis], qshape[h_axis], qshape[3]
        sk, hkv = kshape[s_axis], kshape[h_axis]
    if packing is None and kshape[0] != batch:
        raise bad_arg("k", f"batch size {batch} like q", f"batch size {kshape[0]} (shape {kshape})")
    if kshape[-1] != d:
        raise bad_arg("k", f"head dim {d} like q", f"head dim {kshape[-1]} (shape {kshape})")
    if d > MAX_HEAD_DIM:
        raise bad_arg("q", f"head dim D between 1 and {MAX_HEAD_DIM}", f"D={d} (shape {qshape})")
    if vshape[-1] > MAX_HEAD_DIM_V:
        raise bad_arg("v", f"head dim Dv between 1 and {MAX_HEAD_DIM_V}", f"Dv={vshape[-1]} (shape {vshape})")
    if hq % hkv != 0:
        raise bad_arg("k", f"a number of heads that divides q's {hq} (grouped-query attention)",
                      f"Hkv={hkv} (shape {kshape})")
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    left, right = (clamp_window_bound(w, sq, sk) for w in effective_window(causal, window_size))
    softcap = effective_softcap(softcap, compute_dtype_name(qdt))
    alibi = check_alibi(alibi_slopes, qkind, qdev, batch, hq, sq, sk, compute_dtype_name(qdt))
    bias = check_bias(attn_bias, infos["q"], (batch, hq, sq, sk), layout)
    mods = check_mods(bias_mod, mask_mod, score_mod, None, block_mask, (batch, hq, sq, sk), layout, False)
    dropout_p, dropout_seed = check_dropout(dropout_p, dropout_seed)
    call = AttentionCall(q=q, k=k, v=v, kind=qkind, device=qdev, dtype=qdt, layout=layout, batch=batch,
                         seqlen_q=sq, seqlen_k=sk, nheads_q=hq, nheads_kv=hkv, head_dim=d, causal=causal,
                         softmax_scale=scale, window_left=left, window_right=right, softcap=softcap,
                         return_lse=return_lse, packing=packing, alibi=alibi, bias=bias, head_dim_v=vshape[-1],
                         mods=mods, dropout_p=dropout_p, dropout_seed=dropout_seed, precision=precision)
    remember(signature, call.__dict__, given)
    return call


def check_alibi(alibi_slopes: Any, kind: str, device: str, batch: int, nheads_q: int, seqlen_q: int = 1,
                seqlen_k: int = 1, compute: str = "float32") -> Any:
    """ALiBi slopes as a read-only float64 host array (B, Hq), or None; AttentionInputError naming alibi_slopes.
    For packed sequences B is the number of sequences, and seqlen_q / seqlen_k are the longest ones.

    A slope's bias, -|slope| * |i + Sk - Sq - j|, must be finite in the ``compute`` dtype for every pair: the
    distance reaches max(Sq, Sk) - 1, and past that the kernels' float32 bias overflows to -inf (a key hidden)
    or +inf (a row poisoned) where the float64 reference has a number."""
    if alibi_slopes is None:
        return None
    what = f"(Hq,) = ({nheads_q},) or (B, Hq) = ({batch}, {nheads_q}) slopes"
    akind = array_kind(alibi_slopes)
    if akind is None:
        raise bad_arg("alibi_slopes", f"an array {what}", f"an object of type {type(alibi_slopes).__name__}")
    refuse_masked("alibi_slopes", alibi_slopes)
    if akind != kind or device_of(alibi_slopes) != device:
        raise bad_arg("alibi_slopes", f"a {kind} array on q's device ({device})",
                      f"a {akind} array on {device_of(alibi_slopes)}")
    shape = tuple(int(n) for n in alibi_slopes.shape)
    if shape not in ((nheads_q,), (batch, nheads_q)):
        raise bad_arg("alibi_slopes", what, f"shape {shape}")
    if dtype_name(alibi_slopes) not in FLOAT_DTYPES:
        raise bad_arg("alibi_slopes", "a floating dtype (float32, as flash-attn takes)",
                      f"dtype {dtype_name(alibi_slopes)}")
    slopes = np.array(np.broadcast_to(as_float64(alibi_slopes), (batch, nheads_q)))
    if not np.isfinite(slopes).all():
        raise bad_arg("alibi_slopes", "finite values", "a NaN or an infinity")
    reach = max(seqlen_q, seqlen_k) - 1
    limit = float(np.finfo(compute).max) / max(reach, 1)
    too_large = np.flatnonzero(np.abs(slopes).ravel() > limit)
    if too_large.size:
        b, h = divmod(int(too_large[0]), nheads_q)
        raise bad_arg("alibi_slopes", f"|slope| <= {limit:.3g}, so that the bias slope * distance (distances up to "
                                   f"{reach} here) stays finite in {compute}",
                      f"{float(slopes[b, h]):.4g} (batch {b}, head {h})")
    slopes.flags.writeable = False
    return slopes


@dataclass(frozen=True)
class Bias:
    """A validated ``attn_bias``: ``array`` as the caller passed it (never copied or written), ``shape`` its shape
    padded on the left with 1s to four dimensions, which broadcast to (B, Hq, Sq, Sk)."""

    array: Any
    shape: tuple[int, int, int, int]


def check_bias(attn_bias: Any, q_info: tuple, full: tuple[int, int, int, int], layout: str) -> Bias | None:
    """``attn_bias`` as a ``Bias``, or None; AttentionInputError naming attn_bias.

    Broadcastable to ``full`` = (B, Hq, Sq, Sk) by numpy's rules (at most four dimensions, each of size 1 or the
    full size), float32 or q's dtype, q's array kind and device. Its values are not read here: -inf hides a key,
    and a NaN poisons its row, as the contract's non-finite rule says. Packed sequences do not take it yet."""
    if attn_bias is None:
        return None
    _, qkind, _, qdt, qdev = q_info
    what = f"an array broadcastable to (B, Hq, Sq, Sk) = {full}"
    kind = array_kind(attn_bias)
    if kind is None:
        raise bad_arg("attn_bias", what, f"an object of type {type(attn_bias).__name__}")
    refuse_masked("attn_bias", attn_bias)
    if layout == "thd":
        raise bad_arg("attn_bias", "None for packed sequences (attn_bias with layout 'thd' is not implemented yet)",
                      f"shape {tuple(attn_bias.shape)}")
    if kind == "torch":
        attn_bias = _check_torch("attn_bias", attn_bias)
    if kind != qkind or device_of(attn_bias) != qdev:
        raise bad_arg("attn_bias", f"a {qkind} array on q's device ({qdev})",
                      f"a {kind} array on {device_of(attn_bias)}")
    shape = tuple(int(n) for n in attn_bias.shape)
    padded = (1,) * (4 - len(shape)) + shape
    if len(shape) > 4 or any(n not in (1, f) for n, f in zip(padded, full)):
        raise bad_arg("attn_bias", what, f"shape {shape}")
    dt = dtype_name(attn_bias)
    if dt not in ("float32", qdt):
        raise bad_arg("attn_bias", f"dtype float32 or q's dtype ({qdt})", f"dtype {dt}")
    return Bias(attn_bias, padded)


MAX_DROPOUT_SEED = 1 << 64


def check_dropout(dropout_p: Any, dropout_seed: Any) -> tuple[float, int]:
    """``(p, seed)`` as a float in [0, 1) and an int in [0, 2**64) (``numba_flash.dropout`` keys Philox with its
    two 32-bit halves); AttentionInputError naming the argument. ``dropout_seed`` None is taken as 0 when p is 0
    and refused otherwise: the backward must see the forward's seed, so it is never drawn here."""
    if not is_finite_real(dropout_p) or not 0.0 <= float(dropout_p) < 1.0:
        raise bad_arg("dropout_p", "a real number in [0, 1)", short_repr(dropout_p))
    p = float(dropout_p)
    if dropout_seed is None and p == 0.0:
        return p, 0
    if (isinstance(dropout_seed, (bool, np.bool_)) or not isinstance(dropout_seed, numbers.Integral)
            or not 0 <= int(dropout_seed) < MAX_DROPOUT_SEED):
        need = " (dropout_p > 0 needs one, the same in forward and backward)" if dropout_seed is None else ""
        raise bad_arg("dropout_seed", f"an int in [0, 2**64){need}", short_repr(dropout_seed))
    return p, int(dropout_seed)


def validate_backward(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, causal: bool = False,
    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    layout: str | None = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None, max_seqlen_q: Any = None,
    max_seqlen_k: Any = None, alibi_slopes: Any = None, attn_bias: Any = None, return_dbias: bool = False,
    bias_mod: Any = None, mask_mod: Any = None, score_mod: Any = None, score_mod_grad: Any = None,
    block_mask: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
) -> AttentionCall:
    """Check a backward call. dout and out are shaped like q but with v's head dim Dv, q's dtype; lse is
    (B, Hq, Sq), or (Hq, total_q) for packed sequences, float32 (float64 for float64 inputs), as the forward
    returned it. ``return_dbias`` needs ``attn_bias``; the backward of a ``score_mod`` needs ``score_mod_grad``."""
    call = validate_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                            softcap=softcap, layout=layout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes,
                            attn_bias=attn_bias, dropout_p=dropout_p, dropout_seed=dropout_seed)
    mods = check_mods(bias_mod, mask_mod, score_mod, score_mod_grad, block_mask,
                      (call.batch, call.nheads_q, call.seqlen_q, call.seqlen_k), call.layout, True)
    return_dbias = _check_bool("return_dbias", return_dbias)
    if return_dbias and call.bias is None:
        raise bad_arg("return_dbias", "False when no attn_bias is given (dbias is the gradient of attn_bias)", True)
    layout = call.layout
    qshape = tuple(int(s) for s in q.shape)
    oshape = qshape[:-1] + (call.head_dim_v,)
    checked = {}
    for name, x in (("dout", dout), ("out", out)):
        checked[name], kind, shape, dt, dev = check_array(name, x, layout)
        if not _result_kind_ok(kind, call.kind):
            raise bad_arg(name, f"the same array kind as q ({call.kind})", kind)
        if shape != oshape:
            what = f"the shape of q {qshape}" if oshape == qshape else f"q's shape with v's head dim, {oshape}"
            raise bad_arg(name, what, f"shape {shape}")
        if dt != call.dtype:
            raise bad_arg(name, f"the dtype of q ({call.dtype})", f"dtype {dt}")
        if dev != call.device:
            raise bad_arg(name, f"the device of q ({call.device})", f"device {dev}")
    kind = array_kind(lse)
    if kind is None:
        raise bad_arg("lse", "an array", f"an object of type {type(lse).__name__}")
    refuse_masked("lse", lse)
    if not _result_kind_ok(kind, call.kind):
        raise bad_arg("lse", f"the same array kind as q ({call.kind})", kind)
    if kind == "torch":
        lse = _check_torch("lse", lse)
    lshape = tuple(int(s) for s in lse.shape)
    want = call.lse_shape
    if lshape != want:
        dims = "(Hq, total_q)" if call.is_varlen else "(B, Hq, Sq)"
        raise bad_arg("lse", f"shape {dims} = {want}", f"shape {lshape}")
    ldt = dtype_name(lse)
    if ldt not in ("float32", "float64"):
        raise bad_arg("lse", "dtype float32 (as the forward returns it)", f"dtype {ldt}")
    if device_of(lse) != call.device:
        raise bad_arg("lse", f"the device of q ({call.device})", f"device {device_of(lse)}")
    return AttentionCall(**{**call.__dict__, "dout": checked["dout"], "out": checked["out"], "lse": lse,
                            "return_dbias": return_dbias, "mods": mods})
