"""Random with_kvcache calls shared by the backend tests (tests/numba_flash/test_kvcache.py) and the CUDA
simulator tests (tests/numba_flash/cuda/test_kvcache_sim.py)."""

from __future__ import annotations

import numpy as np


def random_case(rng, *, batch=3, sq=2, hq=4, hkv=2, d=24, capacity=37, s_new=3, paged=False, page=8, rotary=True,
          dtype=np.float32, batch_idx=False, leftpad=False):
    """Random inputs of a with_kvcache call, as keyword arguments, and the caches' dense twin for checks."""
    q = rng.standard_normal((batch, sq, hq, d)).astype(dtype)
    lens = rng.integers(0, capacity - s_new + 1, batch).astype(np.int32)
    lens[0] = capacity - s_new  # one sequence filled to the brim
    args = dict(q=q, cache_seqlens=lens)
    if s_new:
        args["k"] = rng.standard_normal((batch, s_new, hkv, d)).astype(dtype)
        args["v"] = rng.standard_normal((batch, s_new, hkv, d)).astype(dtype)
    if paged:
        max_blocks = -(-capacity // page)
        num_blocks = batch * max_blocks + 2
        table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
        args["block_table"] = table
        shape = (num_blocks, page, hkv, d)
        args["cache_seqlens"] = np.minimum(lens, max_blocks * page - s_new).astype(np.int32)
    else:
        rows = batch + 2 if batch_idx else batch
        shape = (rows, capacity, hkv, d)
        if batch_idx:
            args["cache_batch_idx"] = rng.permutation(rows)[:batch].astype(np.int32)
    args["k_cache"] = rng.standard_normal(shape).astype(dtype)
    args["v_cache"] = rng.standard_normal(shape).astype(dtype)
    if leftpad:
        args["cache_leftpad"] = (rng.integers(0, 1 << 30, batch) % (args["cache_seqlens"] + 1)).astype(np.int32)
    if rotary and s_new:
        positions = (shape[0] * shape[1] if paged else capacity) + sq  # causal q reaches cache_seqlens + Sq - 1
        angles = rng.uniform(0, 2 * np.pi, (positions, d // 4))  # rotary_dim = D / 2: the rest must pass through
        args["rotary_cos"], args["rotary_sin"] = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    return args


def copy_args(args):
    """Fresh copies of the arrays, read-only where the original is."""
    copies = {n: (a.copy() if isinstance(a, np.ndarray) else a) for n, a in args.items()}
    for n, a in copies.items():
        if isinstance(a, np.ndarray):
            a.flags.writeable = args[n].flags.writeable
    return copies


def as_torch(args):
    import torch

    return {n: (torch.from_numpy(a) if isinstance(a, np.ndarray) else a) for n, a in args.items()}
