"""Shared by the simulator tests of the tensor-core kernels (``tests/numba_flash/cuda/test_tc_forward_sim.py``,
``test_tc_backward_sim.py``): toy tiles of one or two warps, random torch CPU inputs (the simulator's cuda backend
takes them when forced), attention computed plainly in the same dtype (flash-attn's yardstick), and the calls.
Imported by the test files (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

import numpy as np
import torch

from backends import backend_registry
from numba_flash import attention_ref
from numba_flash.cuda import tile_config_override

ONE_WARP = dict(block_m=16, block_n=16, threads=32, tensor_cores=True)
TWO_WARPS = dict(block_m=32, block_n=16, threads=64, tensor_cores=True)
BOUND = {"float16": 2e-3, "bfloat16": 1.6e-2}
TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def inputs(rng, dtype, b, sq, sk, hq, hkv, d, scale=1.0):
    """q (b, sq, hq, d), k and v (b, sk, hkv, d) as torch CPU tensors of ``dtype`` (the simulator's cuda backend
    takes them when forced), and their values in float64."""
    tensors = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(TORCH_DTYPE[dtype])
               for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))]
    return tensors, [t.double().numpy() for t in tensors]


def naive_same_dtype(q, k, v, dout=None, round_p=None, **kw):
    """Attention computed plainly in q's dtype (torch on the CPU): scores, mask, softmax (then dropout) and P V each
    rounded to the dtype, the yardstick flash-attn's tests hold a kernel to. Same semantics as the reference.
    ``round_p``: None, or what rounds the probabilities before ``P V`` (TF32's operand rounding; no gradient).
    Returns out in float64, and with ``dout`` also (dq, dk, dv) by torch's autograd in the same dtype."""
    from numba_flash.semantics import visible_mask

    batch, sq, hq, d = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    scale = kw.get("softmax_scale") or d ** -0.5
    left, right = kw.get("window_size", (-1, -1))
    if kw.get("causal"):
        right = 0
    mask = torch.from_numpy(visible_mask(sq, sk, left, right))
    bias = kw.get("attn_bias")
    if kw.get("mask_mod") is not None:
        mask = mask & torch.from_numpy(mod_grid(kw["mask_mod"], batch, hq, sq, sk).astype(bool))
    if kw.get("bias_mod") is not None:   # added to attn_bias: one bias, in float64 until it meets the scores
        extra = mod_grid(kw["bias_mod"], batch, hq, sq, sk)
        bias = extra if bias is None else np.asarray(bias, np.float64) + extra
    if bias is not None:   # a -inf entry hides its pair, as a mask does
        bias = torch.as_tensor(np.asarray(bias))
        mask = mask & (bias != -float("inf"))
    q, k, v = (x.detach().requires_grad_(dout is not None) for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    if kw.get("softcap"):
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    if kw.get("alibi_slopes") is not None:
        slopes = torch.as_tensor(np.asarray(kw["alibi_slopes"])).reshape(-1, hq, 1, 1).to(s.dtype)
        dist = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None, :]).abs().to(s.dtype)
        s = s - slopes * dist
    if bias is not None:
        s = s + bias.masked_fill(bias == -float("inf"), 0.0).to(s.dtype)
    if kw.get("score_mod") is not None:
        # The mod's value, rounded to the dtype, with score_mod_grad as its derivative for autograd; a -inf it
        # returns hides the pair.
        x = s.detach().double().numpy()
        modded = mod_grid(kw["score_mod"], batch, hq, sq, sk, x)
        grad = mod_grid(kw["score_mod_grad"], batch, hq, sq, sk, x) if kw.get("score_mod_grad") else np.ones_like(x)
        mask = mask & torch.from_numpy(modded != -np.inf)
        modded = np.where(np.isfinite(x) & (modded != -np.inf), modded, np.where(np.isfinite(x), 0.0, x))
        s = torch.from_numpy(modded).to(s.dtype) + torch.from_numpy(grad).to(s.dtype) * (s - s.detach())
    # A row that sees no key gets 0, with zero gradients: softmax over its zeros, then masked, keeps autograd's NaN
    # out of it.
    seen = mask.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~mask, -float("inf")).masked_fill(~seen, 0.0), dim=-1) * seen
    if kw.get("dropout_p"):   # the mask every backend draws, its factor rounded to the dtype
        from numba_flash import dropout_mask

        keep = torch.from_numpy(dropout_mask(kw["dropout_seed"], batch, hq, sq, sk, kw["dropout_p"]))
        p = p * (keep.to(p.dtype) * (1.0 / (1.0 - kw["dropout_p"])))
    if round_p is not None:
        p = round_p(p.detach())
    out = (p @ vt).transpose(1, 2)
    if dout is None:
        return out.detach().double().numpy()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach().double().numpy(), [g.double().numpy() for g in grads]


def mod_grid(fn, batch, heads, sq, sk, scores=None):
    """A mod (numba_flash.mods) at every (b, h, q_idx, kv_idx), as a float64 (batch, heads, sq, sk) array; a
    score_mod takes ``scores`` of that shape, float64."""
    grid = np.empty((batch, heads, sq, sk))
    for b, h, i, j in np.ndindex(grid.shape):
        grid[b, h, i, j] = fn(b, h, i, j) if scores is None else fn(float(scores[b, h, i, j]), b, h, i, j)
    return grid


def break_small_tiles(monkeypatch, factory_name, corrupt, which=lambda cfg: cfg.block_m == 16):
    """Make the kernel factory ``factory_name`` build, for the configs ``which`` picks (16-row tiles by default), a
    kernel whose output (argument 3) ``corrupt`` then spoils (given the device array, writing it in place): the
    self-check must catch it and fall back to another tile config."""
    from cuda_sim_cases import factory_home

    home = factory_home(factory_name)
    real = getattr(home, factory_name)

    class Broken:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, launch_config):
            def run(*args):
                self.kernel[launch_config](*args)
                corrupt(args[3])
            return run

    monkeypatch.setattr(home, factory_name, lambda cfg, *f, **kw: Broken(real(cfg, *f, **kw))
                        if which(cfg) else real(cfg, *f, **kw))


def rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def forward(q, k, v, tiles=ONE_WARP, **kw):
    if isinstance(kw.get("alibi_slopes"), np.ndarray) and isinstance(q, torch.Tensor):
        kw["alibi_slopes"] = torch.from_numpy(kw["alibi_slopes"])   # the kind of array q is
    with tile_config_override(**tiles):
        out, lse = backend_registry.get("flash", backend="cuda").forward(q, k, v, return_lse=True, **kw)
    return out, lse


def judge(out, lse, q, k, v, q64, k64, v64, dtype, **kw):
    ref, ref_lse = attention_ref(q64, k64, v64, **kw)
    out64 = out.double().numpy()
    err, naive_err = rel_l2(out64, ref), rel_l2(naive_same_dtype(q, k, v, **kw), ref)
    assert err <= BOUND[dtype] and err <= 2 * naive_err, (err, naive_err)
    lse = lse.numpy() if hasattr(lse, "numpy") else lse
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite) and np.all(lse[~finite] == np.inf)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-4)
