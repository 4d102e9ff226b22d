"""The self-check's problem (selfcheck.py): the input it draws for a specialisation, its device arrays laid out
like the call's, textbook float32 attention (the yardstick of the float32 bounds), the error measures, and the
packed layout a ``varlen`` specialisation is checked in.

This module imports no ``numba.cuda`` at import time, as selfcheck.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from numba_flash.cuda.selfcheck import Specialisation

SEED = 20_240_611
SOFTCAP = 1.5
_DROPOUT_P = 0.3


@dataclass(frozen=True)
class Problem:
    """The check's input for one specialisation: host arrays in float32 (the values the kernel sees) and in the
    kernel's storage dtype, the launch scalars, and the float64 reference."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    stored: dict[str, np.ndarray]
    scale: float
    window_left: int
    window_right: int
    softcap: float
    slopes: np.ndarray | None    # ALiBi slopes (B, Hq) float64, or None
    bias: np.ndarray | None      # attn_bias (B, Hq, Sq, Sk) float32, about one entry in 8 -inf, or None
    dropout_p: float             # 0, or _DROPOUT_P with seed SEED

    @property
    def window_size(self) -> tuple[int, int]:
        return (self.window_left, self.window_right)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the kernels' storage dtype: bfloat16 as int16 bits, rounded to nearest even."""
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.astype(np.uint16).view(np.int16)
    return np.asarray(x, dtype=dtype)


def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of storage-dtype data."""
    if dtype == "bfloat16":
        return (np.ascontiguousarray(x).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x, dtype=np.float32)


def draw_problem(spec: Specialisation) -> Problem:
    cfg = spec.cfg
    # A head dim short of the bucket, so that the padding is exercised; the tensor-core kernels' cp.async path
    # needs rows that start 16-byte aligned, so it gets a multiple of 8 (the plain-load path an odd one).
    d = max(1, cfg.head_dim_bucket - (8 if cfg.tensor_cores and spec.async_copy else 1))
    sq, sk = cfg.block_m + 3, 2 * cfg.block_n + 5
    rng = np.random.default_rng(SEED)

    def draw(*shape: int) -> tuple[np.ndarray, np.ndarray]:
        stored = to_storage(rng.standard_normal(shape).astype(np.float32), spec.dtype)
        return stored, widen(stored, spec.dtype)

    (q_s, q), (k_s, k), (v_s, v), (do_s, dout) = (draw(1, sq, 2, d), draw(1, sk, 1, d), draw(1, sk, 1, d),
                                                  draw(1, sq, 2, d))
    return Problem(q=q, k=k, v=v, dout=dout, stored=dict(q=q_s, k=k_s, v=v_s, dout=do_s),
                    scale=1.0 / math.sqrt(d), window_left=cfg.block_n + 3 if spec.has_left else -1,
                    window_right=0 if spec.has_right else -1, softcap=SOFTCAP if spec.softcap else 0.0,
                    slopes=rng.uniform(0.05, 0.5, (1, 2)) if spec.alibi else None, bias=_bias(rng, sq, sk, spec),
                    dropout_p=_DROPOUT_P if spec.dropout else 0.0)


def _bias(rng: np.random.Generator, sq: int, sk: int, spec: Specialisation) -> np.ndarray | None:
    if not spec.bias:
        return None
    bias = rng.standard_normal((1, 2, sq, sk)).astype(np.float32)
    return np.where(rng.random(bias.shape) < 0.125, np.float32(-np.inf), bias)


class _Strided:
    """Stands for a call's array that is not contiguous (``to_device_like`` then makes a strided view)."""

    @staticmethod
    def is_c_contiguous() -> bool:
        return False


STRIDED = _Strided()


def to_device_like(host: np.ndarray, like: Any) -> Any:
    """``host`` on the GPU, as a non-contiguous view when ``like`` is one (numba compiles per contiguity)."""
    from numba import cuda

    if like is None or like.is_c_contiguous():
        return cuda.to_device(np.ascontiguousarray(host))
    padded = np.zeros(host.shape[:-1] + (host.shape[-1] + 1,), host.dtype)
    padded[..., :-1] = host
    return cuda.to_device(padded)[(slice(None),) * (host.ndim - 1) + (slice(0, host.shape[-1]),)]


def nan_device_like(shape: tuple[int, ...], dtype: str, like: Any) -> Any:
    """A device array of ``shape`` full of NaN in storage dtype ``dtype`` ('int16': bfloat16 NaN bits)."""
    if dtype == "int16":
        return to_device_like(np.full(shape, 0x7FC0, np.int16), like)
    return to_device_like(np.full(shape, np.nan, dtype), like)


def max_abs(got: np.ndarray, ref: np.ndarray) -> float:
    """Max abs error; inf when the non-finite entries (NaN for an element never written) differ."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), fin) or not np.array_equal(got[~fin], ref[~fin]):
        return math.inf
    return float(np.max(np.abs(got[fin] - ref[fin]), initial=0.0))


def rel_l2(got: np.ndarray, ref: np.ndarray, scale: np.ndarray | None = None) -> float:
    """||got - ref|| / ||ref||, or over ||scale|| where ref is a sum of terms that cancel (scale: the terms)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref if scale is None else scale), 1e-30))


def textbook_float32(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Attention computed plainly in float32 (whole score matrix, one softmax): the error the contract measures a
    float32 kernel against. Returns out like q and lse (B, Hq, Sq)."""
    from numba_flash.dropout import dropout_mask, dropout_scale
    from numba_flash.semantics import visible_mask

    batch, sq, hq, _ = p.q.shape
    sk, group = p.k.shape[1], hq // p.k.shape[2]
    mask = visible_mask(sq, sk, p.window_left, p.window_right)
    out = np.zeros(p.q.shape, np.float32)
    lse = np.full((batch, hq, sq), np.inf, np.float32)
    scale, cap = np.float32(p.scale), np.float32(p.softcap)
    keep = dropout_mask(SEED, batch, hq, sq, sk, p.dropout_p) if p.dropout_p else None
    for b in range(batch):
        for h in range(hq):
            s = (p.q[b, :, h] @ p.k[b, :, h // group].T) * scale
            if p.softcap > 0:
                s = cap * np.tanh(s / cap)
            if p.slopes is not None:
                distance = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :])
                s = s - (np.float32(p.slopes[b, h]) * distance).astype(np.float32)
            seen_pairs = mask
            if p.bias is not None:
                seen_pairs = mask & (p.bias[b, h] != -np.inf)
                s = s + np.where(seen_pairs, p.bias[b, h], np.float32(0))
            s = np.where(seen_pairs, s, np.float32(-np.inf))
            m = s.max(axis=1, keepdims=True)
            seen = np.isfinite(m[:, 0])
            m = np.where(seen[:, None], m, np.float32(0))
            e = np.exp(s - m)
            total = e.sum(axis=1, keepdims=True)
            if keep is not None:
                e = np.where(keep[b, h], e * np.float32(dropout_scale(p.dropout_p)), np.float32(0))
            out[b, :, h] = np.where(seen[:, None], (e @ p.v[b, :, h // group]) / np.where(seen[:, None], total, 1),
                                    0)
            lse[b, h] = np.where(seen, m[:, 0] + np.log(np.where(seen, total[:, 0], 1)), np.inf)
    return out, lse


def judge(measured: list[tuple[str, str, float, float]]) -> tuple[list[str], list[str]]:
    """(failures, all measurements) as text, from (name, metric, error, bound) tuples."""
    text, failed = [], []
    for name, metric, err, bound in measured:
        ok = err <= bound
        line = f"{name}: {metric} {err:.3g} {'<=' if ok else '>'} {bound:.3g}"
        if not math.isfinite(err):
            line += " (non-finite or unwritten elements)"
        text.append(line)
        if not ok:
            failed.append(line)
    return failed, text


#: A packed specialisation checks its problem as sequence 2 of three: sequence 0 has PACKED_ROWS rows and no keys,
#: sequence 1 no rows and PACKED_KEYS keys (neither gets a block), so the checked one starts at row 3 and key 5 of
#: arrays whose leading rows and keys are NaN: a block that finds the wrong sequence, or reads past its own, shows.
PACKED_ROWS, PACKED_KEYS, PACKED_INDEX = 3, 5, 2


def ahead(spec: Specialisation, side: str) -> int:
    """Rows (``side`` "rows") or keys ("keys") that precede the checked sequence in the arrays: 0 unless packed."""
    return (PACKED_ROWS if side == "rows" else PACKED_KEYS) if spec.varlen else 0


def placed(spec: Specialisation, host: np.ndarray, side: str, dim: int = 1) -> np.ndarray:
    """``host`` after ``ahead`` NaN entries along dimension ``dim`` (bfloat16 storage: NaN bits)."""
    n = ahead(spec, side)
    if not n:
        return host
    shape = list(host.shape)
    shape[dim] = n
    nan = np.full(shape, 0x7FC0, np.int16) if host.dtype == np.int16 else np.full(shape, np.nan, host.dtype)
    return np.concatenate([nan, host], axis=dim)
