"""CUDA kernels of numba-flash: ``numba.cuda`` ``@cuda.jit`` kernels with K/V tiles staged in shared memory.

    config.py         tile configs, the picker ``tile_config_for`` and ``tile_config_override``
    forward.py        the forward kernel factory (online softmax, one block per query tile)
    backward.py       delta pre-pass, dK/dV kernel (per key tile), dQ kernel (per query tile)
    decode.py         split-KV decoding with a KV cache (with_kvcache): one kernel over (sequence, kv head, split)
                      reading a dense or paged cache in place, and the merge of its splits
    merge.py          merge of two partial attentions on the GPU (merge_attention_states' device twin)
    dtypes.py         element load/store helpers: bfloat16 travels as int16 bits, widened to float32 and rounded back
    warp.py           warp-level primitives for tensor cores (mma.sync, ldmatrix, cp.async, shuffles, packing):
                      inline PTX in warp_ptx.py, and for the simulator an emulation with the same fragment layouts
                      in warp_sim.py
    launch.py         host wrappers that pick configs and launch on (B, S, H, D) device-array views
    selfcheck.py      first-launch check of each kernel specialisation against the reference, with fallbacks
                      (on for a real GPU; NUMBA_FLASH_SELFCHECK=0 / 1 switches it); decode_check.py has the
                      decode kernel's check
    compile_check.py  PTX/SASS compile of every specialisation with register and spill report (no GPU needed)
    simcheck.py       race, bounds and barrier checker for the simulator (NUMBA_FLASH_SIMCHECK=1), with
                      simcheck_hooks.py and simcheck_arrays.py, which load only when it is switched on
    compat.py         keeps numba-cuda compiling under numpy releases newer than it knows (np.row_stack)

Importing this package does not import ``numba.cuda``; the kernel factories do, on first use.
"""

from __future__ import annotations

from .compat import restore_row_stack

restore_row_stack()   # before numba-cuda compiles anything: see compat.py

from .config import (
    HEAD_DIM_BUCKETS,
    FlashAttentionConfig,
    TileOverride,
    all_tile_configs,
    head_dim_bucket,
    tile_config_for,
    tile_config_override,
)
from .simcheck import SimulatorCheckError

__all__ = [
    "HEAD_DIM_BUCKETS",
    "FlashAttentionConfig",
    "SimulatorCheckError",
    "TileOverride",
    "all_tile_configs",
    "head_dim_bucket",
    "tile_config_for",
    "tile_config_override",
]
