"""CUDA kernels of numba-flash: ``numba.cuda`` ``@cuda.jit`` kernels with K/V tiles staged in shared memory.

The folders are the layers, the runtime first:

    kernels/        one file per kernel factory (SIMT, tensor-core and TF32 forward and backward, decode, merge)
    device/         device helpers the kernels are built from (tiles, masks, score pipeline, warp primitives)
    host/           tile configs and the picker, the launches, the shared-memory opt-in
    selfcheck/      first use of each specialisation checked against the reference on a real GPU, with fallbacks
    compat.py       keeps numba-cuda compiling under numpy releases newer than it knows (np.row_stack)

and the tooling that proves them, which the runtime does not import (the simulator checker aside, loaded only when
``NUMBA_FLASH_SIMCHECK=1`` switches it on):

    compile_check/  PTX/SASS compile of every specialisation with its register and spill report (no GPU needed),
                    and the recorded table the test suite reads: ``python -m numba_flash.cuda.compile_check``
    perf_model/     the static performance model: ``python -m numba_flash.cuda.perf_model``
    simcheck/       race, bounds and barrier checker for the Numba CUDA simulator

Importing this package does not import ``numba.cuda``; the kernel factories do, on first use.
"""

from __future__ import annotations

from numba_flash.cuda.compat import restore_row_stack

restore_row_stack()   # before numba-cuda compiles anything: see compat.py

from numba_flash.cuda.host.config import HEAD_DIM_BUCKETS, FlashAttentionConfig, head_dim_bucket
from numba_flash.cuda.host.picker import TileOverride, all_tile_configs, tile_config_for, tile_config_override
from numba_flash.cuda.simcheck import SimulatorCheckError

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
