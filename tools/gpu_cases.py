"""Correctness cases for a real GPU (``tools/gpu_check.py`` runs them): the cuda backend on torch tensors on the
device, judged against the float64 reference on fresh random inputs of odd sizes, with the contract's bounds.

Each case returns a dict of measured errors, the bound each is held to, and ``ok``. With ``--device cpu`` the
same cases run on the cpu backend with torch CPU tensors, which is how this file is tried without a GPU.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

import numba_flash
from numba_flash import attention_ref, attention_ref_backward
from numba_flash.semantics import default_scale, effective_window, visible_mask

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOW_REL_L2 = {"float16": 2e-3, "bfloat16": 1.6e-2}
#: lse after a rotary step done in the dtype (q rotated and rounded there, the reference rotates in float64)
ROTARY_LSE = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 8e-3}


class Ctx:
    """Where the cases run: the torch device, the backend forced, and a fresh generator (its seed is logged)."""

    def __init__(self, device: str, backend: str, seed: int):
        self.device, self.backend, self.seed = device, backend, seed
        self.rng = np.random.default_rng(seed)
        self.op = numba_flash.backend_registry.get("flash", backend=backend)

    def tensor(self, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> torch.Tensor:
        x = self.rng.standard_normal(shape).astype(np.float32) * scale
        return torch.from_numpy(x).to(TORCH_DTYPES[dtype]).to(self.device)


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def max_abs(got: np.ndarray, ref: np.ndarray) -> float:
    both = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), both):
        return math.inf
    return float(np.max(np.abs(got[both] - ref[both]), initial=0.0))


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None, causal: bool,
          window: tuple[int, int], softcap: float, compute: torch.dtype) -> tuple[Any, ...]:
    """Textbook attention in ``compute`` precision on the tensors' device (scores, softmax and P V each rounded
    to it): flash-attn's yardstick. Returns out, lse (float64 numpy) and, with ``dout``, dq, dk, dv."""
    b, sq, hq, d = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    left, right = effective_window(causal, window)
    mask = torch.from_numpy(visible_mask(sq, sk, left, right)).to(q.device)
    leaves = [x.detach().to(compute).requires_grad_(dout is not None) for x in (q, k, v)]
    qt, kt, vt = (x.transpose(1, 2) for x in leaves)
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    s = (qt @ kt.transpose(-1, -2)) * default_scale(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s.float(), dim=-1)
    out = (torch.softmax(s, dim=-1) @ vt).transpose(1, 2)
    res = [f64(out), f64(lse)]
    if dout is not None:
        res += [f64(g) for g in torch.autograd.grad(out, leaves, dout.to(compute))]
    return tuple(res)


def _low_precision_bound(dtype: str, got: np.ndarray, ref: np.ndarray) -> float:
    """flash-attn's rule for float16 / bfloat16: relative L2 within the contract's bound and within twice that of
    textbook attention run in the same dtype (``got``), plus the slack of rounding ``ref`` at magnitude 0.3."""
    return min(LOW_REL_L2[dtype], 2 * rel_l2(got, ref) + 2 * rel_l2(ref + 0.3 - 0.3, ref))


def _judge(measured: dict[str, float], bounds: dict[str, float]) -> dict[str, Any]:
    fails = [n for n, e in measured.items() if not e <= bounds[n]]
    return {"errors": measured, "bounds": bounds, "ok": not fails, "failed": fails}


def dense(ctx: Ctx, dtype: str, d: int, b: int = 2, sq: int = 257, sk: int = 300, hq: int = 4, hkv: int = 2,
          causal: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0, backward: bool = True,
          scale: float = 1.0) -> dict[str, Any]:
    """One forward (and backward) through the forced backend against the float64 reference. Bounds: float32 out
    and every dtype's lse within max(1e-5, 4x textbook float32 attention's error), float32 gradients relative L2
    <= 1e-5; float16/bfloat16 out and gradients relative L2 <= 2e-3 / 1.6e-2 and <= 2x the same-dtype textbook
    error plus a rounding slack."""
    q, k, v = ctx.tensor((b, sq, hq, d), dtype, scale), ctx.tensor((b, sk, hkv, d), dtype, scale), \
        ctx.tensor((b, sk, hkv, d), dtype)
    dout = ctx.tensor((b, sq, hq, d), dtype)
    saved = [x.clone() for x in (q, k, v, dout)]
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = ctx.op.forward(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(f64(q), f64(k), f64(v), **kw)
    tb = naive(q, k, v, None, causal, window, softcap, torch.float32)
    measured, bounds = {}, {}
    lse_bound = max(1e-5, 4 * max_abs(tb[1], ref_lse))
    if dtype == "float32":
        measured["out"], bounds["out"] = max_abs(f64(out), ref_out), max(1e-5, 4 * max_abs(tb[0], ref_out))
    else:
        same = naive(q, k, v, None, causal, window, softcap, TORCH_DTYPES[dtype])
        measured["out"] = rel_l2(f64(out), ref_out)
        bounds["out"] = _low_precision_bound(dtype, same[0], ref_out)
    measured["lse"], bounds["lse"] = max_abs(f64(lse), ref_lse), lse_bound
    if backward:
        grads = ctx.op.backward(dout, q, k, v, out, lse, **kw)
        refs = attention_ref_backward(f64(dout), f64(q), f64(k), f64(v), **kw)
        if dtype != "float32":
            same = naive(q, k, v, dout, causal, window, softcap, TORCH_DTYPES[dtype])
        for i, (name, g, r) in enumerate(zip(("dq", "dk", "dv"), grads, refs)):
            measured[name] = rel_l2(f64(g), r)
            bounds[name] = 1e-5 if dtype == "float32" else _low_precision_bound(dtype, same[2 + i], r)
    res = _judge(measured, bounds)
    res["inputs_untouched"] = all(torch.equal(a, b) for a, b in zip(saved, (q, k, v, dout)))
    res["ok"] = res["ok"] and res["inputs_untouched"]
    res["explain"] = str(ctx.op.explain(q, k, v, **kw)).splitlines()[-3:] if ctx.device != "cpu" else []
    return res


def varlen(ctx: Ctx, dtype: str, d: int = 64, causal: bool = True) -> dict[str, Any]:
    """Packed sequences (layout thd) with an empty and a one-token sequence, forward and backward."""
    lens_q, lens_k = [37, 1, 0, 130, 64], [50, 1, 3, 130, 70]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = ctx.tensor((cq[-1], 4, d), dtype), ctx.tensor((ck[-1], 2, d), dtype), ctx.tensor((ck[-1], 2, d), dtype)
    kw = dict(cu_seqlens_q=torch.from_numpy(cq).to(ctx.device), cu_seqlens_k=torch.from_numpy(ck).to(ctx.device),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal)
    out, lse = ctx.op.forward(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = numba_flash.attention_ref_varlen(f64(q), f64(k), f64(v), cq, ck, causal=causal)
    dout = ctx.tensor(tuple(out.shape), dtype)
    grads = ctx.op.backward(dout, q, k, v, out, lse, **kw)
    refs = numba_flash.attention_ref_varlen_backward(f64(dout), f64(q), f64(k), f64(v), cq, ck, causal=causal)
    bound = 1e-5 if dtype == "float32" else LOW_REL_L2[dtype]
    measured = {"out": rel_l2(f64(out), ref_out), "lse": max_abs(f64(lse), ref_lse)}
    measured.update({n: rel_l2(f64(g), r) for n, g, r in zip(("dq", "dk", "dv"), grads, refs)})
    return _judge(measured, {"out": bound, "lse": 1e-4, "dq": bound, "dk": bound, "dv": bound})


def kvcache(ctx: Ctx, dtype: str, d: int = 128, paged: bool = True, num_splits: int = 0) -> dict[str, Any]:
    """One decode step (Sq = 1) with two new keys appended at ragged cache lengths, rotary, a paged cache."""
    b, hq, hkv, page, pages = 3, 8, 2, 16, 40
    lens = np.array([5, 300, 611], np.int32)
    q, k_new, v_new = ctx.tensor((b, 2, hq, d), dtype), ctx.tensor((b, 2, hkv, d), dtype), \
        ctx.tensor((b, 2, hkv, d), dtype)
    if paged:
        k_cache, v_cache = ctx.tensor((pages * b, page, hkv, d), dtype), ctx.tensor((pages * b, page, hkv, d), dtype)
        table = torch.from_numpy(ctx.rng.permutation(pages * b).reshape(b, pages).astype(np.int32)).to(ctx.device)
    else:
        k_cache, v_cache = ctx.tensor((b, page * pages, hkv, d), dtype), ctx.tensor((b, page * pages, hkv, d), dtype)
        table = None
    angles = ctx.rng.uniform(0, 2 * np.pi, (page * pages, d // 2))
    cos, sin = (torch.from_numpy(f(angles).astype(np.float32)).to(ctx.device) for f in (np.cos, np.sin))
    before = (f64(k_cache), f64(v_cache))
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.from_numpy(lens).to(ctx.device),
              block_table=table, causal=True)
    ref = numba_flash.attention_ref_kvcache(f64(q), before[0], before[1], f64(k_new), f64(v_new),
                                            f64(cos), f64(sin), lens, None, None,
                                            None if table is None else table.cpu().numpy(), causal=True)
    out, lse = ctx.op.with_kvcache(q, k_cache, v_cache, k_new, v_new, num_splits=num_splits, return_lse=True, **kw)
    bound = 1e-5 if dtype == "float32" else LOW_REL_L2[dtype]
    measured = {"out": rel_l2(f64(out), ref[0]), "lse": max_abs(f64(lse), ref[1]),
                "k_cache": rel_l2(f64(k_cache), ref[2]), "v_cache": rel_l2(f64(v_cache), ref[3])}
    # v is appended as given: exact
    return _judge(measured, {"out": bound, "lse": ROTARY_LSE[dtype], "k_cache": bound, "v_cache": 0.0})


def variants(ctx: Ctx, dtype: str, what: str, d: int = 64) -> dict[str, Any]:
    """A forward and backward with one attention variant, against the float64 reference."""
    b, sq, sk, hq, hkv = 2, 133, 201, 4, 2
    q, k, v = ctx.tensor((b, sq, hq, d), dtype), ctx.tensor((b, sk, hkv, d), dtype), ctx.tensor((b, sk, hkv, d), dtype)
    kw: dict[str, Any] = {"causal": True}
    doc = np.repeat(np.arange(8), 40)[: max(sq, sk)]
    if what == "attn_bias+alibi":
        kw["attn_bias"] = ctx.tensor((hq, sq, sk), "float32")
        kw["alibi_slopes"] = torch.from_numpy(ctx.rng.uniform(0.05, 0.5, hq).astype(np.float32)).to(ctx.device)
    elif what == "dropout":
        kw.update(dropout_p=0.17, dropout_seed=int(ctx.rng.integers(2 ** 62)))
    elif what == "mods":
        def mask_mod(b_, h_, i, j):
            return doc[i] == doc[j]

        def score_mod(s, b_, h_, i, j):
            return s * np.float32(0.9) + np.float32(0.01) * h_

        def score_mod_grad(s, b_, h_, i, j):
            return np.float32(0.9)

        kw.update(mask_mod=mask_mod, score_mod=score_mod,
                  block_mask=numba_flash.block_mask(mask_mod, 1, 1, sq, sk, 32, 32))
    out, lse = ctx.op.forward(q, k, v, return_lse=True, **kw)
    ref_kw = {n: (f64(x) if isinstance(x, torch.Tensor) else x) for n, x in kw.items() if n != "block_mask"}
    ref_out, ref_lse = attention_ref(f64(q), f64(k), f64(v), **ref_kw)
    dout = ctx.tensor(tuple(out.shape), dtype)
    if what == "mods":
        kw["score_mod_grad"] = ref_kw["score_mod_grad"] = score_mod_grad
    grads = ctx.op.backward(dout, q, k, v, out, lse, **kw)
    refs = attention_ref_backward(f64(dout), f64(q), f64(k), f64(v), **ref_kw)
    bound = 2e-5 if dtype == "float32" else LOW_REL_L2[dtype]
    measured = {"out": rel_l2(f64(out), ref_out), "lse": max_abs(f64(lse), ref_lse)}
    measured.update({n: rel_l2(f64(g), r) for n, g, r in zip(("dq", "dk", "dv"), grads, refs)})
    return _judge(measured, {"out": bound, "lse": 1e-4, "dq": bound, "dk": bound, "dv": bound})


def nonfinite(ctx: Ctx, dtype: str, d: int = 64) -> dict[str, Any]:
    """A NaN in one key row poisons exactly the output rows that see it (causal: rows at or after it)."""
    b, s, h = 1, 150, 2
    q, k, v = ctx.tensor((b, s, h, d), dtype), ctx.tensor((b, s, h, d), dtype), ctx.tensor((b, s, h, d), dtype)
    k[0, 97, 1, 5] = float("nan")
    out = f64(ctx.op.forward(q, k, v, causal=True))
    ref, _ = attention_ref(f64(q), f64(k), f64(v), causal=True)
    same_nan = np.array_equal(np.isnan(out), np.isnan(ref))
    measured = {"nan_pattern": 0.0 if same_nan else 1.0, "finite_rows": rel_l2(out[np.isfinite(ref)],
                                                                                ref[np.isfinite(ref)])}
    return _judge(measured, {"nan_pattern": 0.0, "finite_rows": 1e-5 if dtype == "float32" else LOW_REL_L2[dtype]})


def large_scores(ctx: Ctx, d: int = 64, factor: float = 1e5) -> dict[str, Any]:
    """float32 backward with q scaled so that every row is one key's (issue 47, finding 5): the forward's row
    statistics make P exactly 1 and dS exactly 0 only if the GPU computes the backward's scores and dP with the
    forward's and delta's bits (FMA contraction alike in every kernel). dV within 1e-5; dQ and dK exactly 0 where
    the reference is."""
    b, sq, sk, h = 1, 131, 150, 2
    q = ctx.tensor((b, sq, h, d), "float32", scale=factor)
    k, v, dout = (ctx.tensor(s, "float32") for s in ((b, sk, h, d), (b, sk, h, d), (b, sq, h, d)))
    out, lse = ctx.op.forward(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = (f64(g) for g in ctx.op.backward(dout, q, k, v, out, lse, causal=True))
    want = attention_ref_backward(f64(dout), f64(q), f64(k), f64(v), causal=True)
    measured = {"dv": rel_l2(dv, want[2])}
    for name, got, w in (("dq", dq, want[0]), ("dk", dk, want[1])):
        measured[f"{name}_nonzero_where_ref_0"] = float(np.abs(got[w == 0]).max(initial=0.0))
    return _judge(measured, {"dv": 1e-5, "dq_nonzero_where_ref_0": 0.0, "dk_nonzero_where_ref_0": 0.0})


def threads(ctx: Ctx, dtype: str, d: int = 64) -> dict[str, Any]:
    """Four Python threads calling the same forward at once get the single-threaded answer, bit for bit."""
    import concurrent.futures as cf

    q, k, v = ctx.tensor((2, 211, 4, d), dtype), ctx.tensor((2, 190, 4, d), dtype), ctx.tensor((2, 190, 4, d), dtype)
    one = f64(ctx.op.forward(q, k, v, causal=True))
    with cf.ThreadPoolExecutor(4) as pool:
        many = list(pool.map(lambda _: f64(ctx.op.forward(q, k, v, causal=True)), range(8)))
    same = all(np.array_equal(one, m) for m in many)
    return _judge({"differs": 0.0 if same else 1.0}, {"differs": 0.0})


def foreign_arrays(ctx: Ctx, dtype: str = "float32", d: int = 64) -> dict[str, Any]:
    """numba device arrays and CuPy arrays (``__cuda_array_interface__``) in, the same array kind out."""
    from numba import cuda

    q, k, v = (ctx.rng.standard_normal(s).astype(np.float32) for s in ((1, 97, 2, d), (1, 131, 1, d), (1, 131, 1, d)))
    ref, _ = attention_ref(q, k, v, causal=True)
    measured = {}
    got = ctx.op.forward(*(cuda.to_device(x) for x in (q, k, v)), causal=True)
    measured["numba"] = max_abs(got.copy_to_host().astype(np.float64), ref)
    try:
        import cupy
    except ImportError:
        pass
    else:
        got = ctx.op.forward(*(cupy.asarray(x) for x in (q, k, v)), causal=True)
        measured["cupy"] = max_abs(cupy.asnumpy(got).astype(np.float64), ref)
    return _judge(measured, {n: 1e-5 for n in measured})


def big_head_dims(ctx: Ctx, dtype: str, d: int = 576, dv: int = 512) -> dict[str, Any]:
    """Head dims with Dv != D (MLA's D = 576, Dv = 512 by default), forward and backward, on the forced backend."""
    q, k, v = ctx.tensor((1, 67, 2, d), dtype), ctx.tensor((1, 90, 1, d), dtype), ctx.tensor((1, 90, 1, dv), dtype)
    out, lse = ctx.op.forward(q, k, v, return_lse=True, causal=True)
    ref_out, ref_lse = attention_ref(f64(q), f64(k), f64(v), causal=True)
    dout = ctx.tensor(tuple(out.shape), dtype)
    grads = ctx.op.backward(dout, q, k, v, out, lse, causal=True)
    refs = attention_ref_backward(f64(dout), f64(q), f64(k), f64(v), causal=True)
    bound = 1e-5 if dtype == "float32" else LOW_REL_L2[dtype]
    measured = {"out": rel_l2(f64(out), ref_out), "lse": max_abs(f64(lse), ref_lse)}
    measured.update({n: rel_l2(f64(g), r) for n, g, r in zip(("dq", "dk", "dv"), grads, refs)})
    return _judge(measured, {"out": bound, "lse": 1e-4, "dq": bound, "dk": bound, "dv": bound})


def dbias(ctx: Ctx, dtype: str, broadcast: str, with_mods: bool = False, dropout: bool = False,
          d: int = 64) -> dict[str, Any]:
    """attn_bias's gradient (``return_dbias``) against the reference's, for a bias that is ``full`` (B, Hq, Sq,
    Sk), broadcast over the ``rows`` (B, Hq, 1, Sk) or the ``keys`` (B, Hq, Sq, 1), or shared by batch and
    ``heads`` (Sq, Sk); optionally with a mask_mod and a score_mod (whose derivative scales dbias) and dropout."""
    b, sq, sk, hq, hkv = 2, 101, 147, 4, 2
    shape = {"full": (b, hq, sq, sk), "rows": (b, hq, 1, sk), "keys": (b, hq, sq, 1), "heads": (sq, sk)}[broadcast]
    q, k, v = ctx.tensor((b, sq, hq, d), dtype), ctx.tensor((b, sk, hkv, d), dtype), ctx.tensor((b, sk, hkv, d), dtype)
    bias = ctx.tensor(shape, "float32")
    kw: dict[str, Any] = {"causal": True, "softcap": 3.0, "attn_bias": bias}
    if with_mods:
        doc = np.repeat(np.arange(6), 29)[: max(sq, sk)]

        def mask_mod(b_, h_, i, j):
            return doc[i] == doc[j]

        def score_mod(s, b_, h_, i, j):   # not affine in s: a row's constant bias then moves its softmax
            return 4.0 * math.tanh(s / 4.0) - 0.02 * h_

        def score_mod_grad(s, b_, h_, i, j):
            t = math.tanh(s / 4.0)
            return 1.0 - t * t

        kw.update(mask_mod=mask_mod, score_mod=score_mod)
    if dropout:
        kw.update(dropout_p=0.13, dropout_seed=int(ctx.rng.integers(2 ** 62)))
    saved = bias.clone()
    out, lse = ctx.op.forward(q, k, v, return_lse=True, **kw)
    ref_kw = {n: (f64(x) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    if with_mods:
        kw["score_mod_grad"] = ref_kw["score_mod_grad"] = score_mod_grad
    dout = ctx.tensor(tuple(out.shape), dtype)
    got = ctx.op.backward(dout, q, k, v, out, lse, return_dbias=True, **kw)
    refs = attention_ref_backward(f64(dout), f64(q), f64(k), f64(v), return_dbias=True, **ref_kw)
    bound = 2e-5 if dtype == "float32" else LOW_REL_L2[dtype]
    measured = {n: rel_l2(f64(g), r) for n, g, r in zip(("dq", "dk", "dv", "dbias"), got, refs)}
    if broadcast == "keys":   # a row's terms cancel (to 0 without a nonlinear score_mod): judged on the pairs' scale
        ref_kw["attn_bias"] = np.broadcast_to(ref_kw["attn_bias"], (b, hq, sq, sk)).copy()
        pairs = attention_ref_backward(f64(dout), f64(q), f64(k), f64(v), return_dbias=True, **ref_kw)[3]
        measured["dbias"] = float(np.linalg.norm(f64(got[3]) - refs[3]) / np.linalg.norm(pairs))
    measured["dbias_shape"] = 0.0 if tuple(got[3].shape) == shape else 1.0
    measured["bias_untouched"] = 0.0 if torch.equal(saved, bias) else 1.0
    return _judge(measured, {"dq": bound, "dk": bound, "dv": bound, "dbias": bound, "dbias_shape": 0.0,
                             "bias_untouched": 0.0})


def _to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 rounded to TF32 as cvt.rna does (10 mantissa bits, to nearest, ties away); inf and NaN cut."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    finite = np.isfinite(x)
    return np.where(finite, (bits + 0x1000) & 0xFFFFE000, bits & 0xFFFFE000).astype(np.uint32).view(np.float32)


def _naive_tf32(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """Attention with TF32 products on the host (q, k, v and P rounded to TF32, float32 elsewhere): the TF32
    rule's yardstick (docs/guide/cuda.md, "TF32"). (B, S, H, D) float32 in, float64 out."""
    sq, hq, d = q.shape[1:]
    sk, group = k.shape[1], hq // k.shape[2]
    qt = _to_tf32(q).transpose(0, 2, 1, 3)
    kt, vt = (np.repeat(_to_tf32(x).transpose(0, 2, 1, 3), group, axis=1) for x in (k, v))
    s = (qt @ kt.transpose(0, 1, 3, 2)) * np.float32(default_scale(d))
    seen = visible_mask(sq, sk, *effective_window(causal, (-1, -1)))
    s = np.where(seen, s, -np.inf).astype(np.float32)
    top = np.where(seen.any(axis=-1, keepdims=True), s.max(axis=-1, keepdims=True), 0.0)   # a row with no key: 0
    p = np.exp(s - top)
    p = (p / np.maximum(p.sum(axis=-1, keepdims=True), np.float32(1e-30))).astype(np.float32)
    return (_to_tf32(p) @ vt).transpose(0, 2, 1, 3).astype(np.float64)


def tf32(ctx: Ctx, d: int = 64, causal: bool = True) -> dict[str, Any]:
    """``precision="tf32"`` on float32 inputs: the TF32 rule (relative L2 at most twice naive attention's with TF32
    products and at most 2e-3), the TF32 kernel named by explain() (on the cuda backend), and the backward after
    it within float32 accuracy of the reference's gradients at the TF32 output's own error."""
    b, sq, sk, hq, hkv = 2, 211, 190, 4, 2
    q, k, v = ctx.tensor((b, sq, hq, d), "float32"), ctx.tensor((b, sk, hkv, d), "float32"), \
        ctx.tensor((b, sk, hkv, d), "float32")
    out, lse = ctx.op.forward(q, k, v, causal=causal, return_lse=True, precision="tf32")
    ref_out, ref_lse = attention_ref(f64(q), f64(k), f64(v), causal=causal)
    naive_err = rel_l2(_naive_tf32(*(f64(x).astype(np.float32) for x in (q, k, v)), causal), ref_out)
    measured = {"out": rel_l2(f64(out), ref_out), "lse": max_abs(f64(lse), ref_lse)}
    bounds = {"out": min(2e-3, max(2 * naive_err, 1e-6)), "lse": 1e-2}
    if ctx.backend == "cuda":
        text = str(ctx.op.explain(q, k, v, causal=causal, precision="tf32"))
        measured["tf32_named"] = 0.0 if "TF32 tensor-core forward" in text else 1.0
        bounds["tf32_named"] = 0.0
    dout = ctx.tensor(tuple(out.shape), "float32")
    grads = ctx.op.backward(dout, q, k, v, out, lse, causal=causal, precision="tf32")
    refs = attention_ref_backward(f64(dout), f64(q), f64(k), f64(v), causal=causal)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        measured[name], bounds[name] = rel_l2(f64(g), r), 2e-3
    return _judge(measured, bounds)


def wgmma(ctx: Ctx, dtype: str, d: int, causal: bool = True) -> dict[str, Any]:
    """The Hopper wgmma forward (``tile_config_override(wgmma=True)``, compute capability 9.0 only) against the
    float64 reference as ``dense`` judges it, and whether explain() names it (it ran, not mma.sync)."""
    from numba_flash.cuda import tile_config_override

    with tile_config_override(wgmma=True):
        res = dense(ctx, dtype, d, sq=333, sk=301, causal=causal, backward=False)
        q = ctx.tensor((1, 8, 2, d), dtype)
        res["ran_wgmma"] = ctx.device == "cpu" or "wgmma kernel" in str(ctx.op.explain(q, q[:, :, :1], q[:, :, :1]))
    res["ok"] = res["ok"] and res["ran_wgmma"]
    return res


def dense_cases(dtype: str, d: int) -> list[tuple[str, Callable[[Ctx], dict]]]:
    """The dense cases of one (dtype, head dim): the same specialisations the timings at that head dim use
    (plain and causal), then a window with softcap, and Sq = 1."""
    return [
        (f"dense {dtype} D={d}", lambda c: dense(c, dtype, d)),
        (f"dense {dtype} D={d} causal", lambda c: dense(c, dtype, d, causal=True)),
        (f"dense {dtype} D={d} causal Sq>Sk", lambda c: dense(c, dtype, d, sq=300, sk=257, causal=True)),
        (f"dense {dtype} D={d} window(37,5)+softcap", lambda c: dense(c, dtype, d, window=(37, 5), softcap=2.5)),
        (f"dense {dtype} D={d} Sq=1", lambda c: dense(c, dtype, d, sq=1, sk=515)),
        (f"dense {dtype} D={d} causal x5 inputs", lambda c: dense(c, dtype, d, causal=True, scale=3.0)),
    ]
