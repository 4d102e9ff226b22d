"""Shared by the simulator tests of the CUDA kernels' variants (``tests/numba_flash/cuda/test_attn_bias_sim.py``,
``test_dropout_sim.py``): toy tiles, random inputs, one forward and backward through the cuda backend, and the
error measure. Imported by the test files (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backends import backend_registry
from numba_flash.cuda import tile_config_override

#: 8 x 8 tiles of 16 threads: the simulator runs one Python thread per CUDA thread. The backward kernels split
#: their score products over these (config.FlashAttentionConfig.score_split).
TILES = dict(block_m=8, block_n=8, threads=16)
#: The same tiles over 4 threads, each owning a whole 4 x 4 score block: the backward's path without the split.
WHOLE_BLOCK_TILES = dict(block_m=8, block_n=8, threads=4)
#: Both, for tests of the backward's variants: ids and tile sizes.
BACKWARD_TILES = {"split": TILES, "whole": WHOLE_BLOCK_TILES}


def random_inputs(rng, b, sq, sk, hq, hkv, d, dtype=np.float32):
    """q, dout (b, sq, hq, d) and k, v (b, sk, hkv, d) of N(0, 1) values in ``dtype``."""
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v, rng.standard_normal(q.shape).astype(dtype)


def forward_backward(q, k, v, dout, tiles=None, **kw):
    """(out, lse, dq, dk, dv) of the cuda backend with ``tiles`` (default ``TILES``), the backward given the
    forward's out and lse (score_mod_grad, if given, goes to the backward only)."""
    with tile_config_override(**(tiles or TILES)):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **{n: x for n, x in kw.items() if n != "score_mod_grad"})
        return (out, lse) + tuple(op.backward(dout, q, k, v, out, lse, **kw))


def rel_l2(got, want, floor=0.0):
    """Relative L2 error, against ``max(|want|, floor)``."""
    return np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), floor)


def factory_home(factory_name: str) -> Any:
    """The module whose global ``factory_name`` the launches call, for tests that wrap a kernel factory: a tiled
    kernel's factory (the decode kernel's too) is called by its registry entry's builder in the kernel's own file
    (kernels/<file>.py); the delta pre-pass's by host/launch.py; the split merge's by host/launch_decode.py."""
    import importlib

    from numba_flash.cuda.host import launch, launch_decode
    from numba_flash.cuda.kernels.registry import REGISTRY

    for spec in REGISTRY.values():
        home = importlib.import_module(f"numba_flash.cuda.kernels.{spec.module}")
        if factory_name in home.build.__code__.co_names:   # the spec's builder calls it by this global name
            return home
    return launch_decode if hasattr(launch_decode, factory_name) else launch
