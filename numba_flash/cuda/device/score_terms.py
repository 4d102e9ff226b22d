"""The score pipeline (``numba_flash.score_pipeline``) compiled for the CUDA kernels: every kernel's score of a
(query, key) pair comes from ``make_pipeline``, so a stage added there reaches all of them.

Two builds differ by the kernels' needs, not by the stages: the tensor-core kernels take tanh from the
special-function unit (``warp.tanh_approx``, about 2**-11 relative, the size of a 16-bit score's own rounding, as
FlashAttention-2's) and make a non-finite raw product's score NaN by adding ``raw * 0`` (their row sums carry it);
the SIMT kernels, whose inputs may be float32, take libdevice's tanh and read the pipeline's ``finite`` flag.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda, float32

from numba_flash.score_pipeline import compile_with

from numba_flash.cuda.device import warp
from numba_flash.cuda.device.user_mods import LOG2E, NO_MODS, CudaMods, make_score_mod


@cuda.jit(device=True, inline="always")
def libdevice_tanh(raw, qmult):
    """tanh(raw * qmult) by libdevice's tanhf, within an ulp or two of float32's tanh (the SIMT kernels' float32
    scores need it)."""
    return math.tanh(raw * qmult)


@cuda.jit(device=True, inline="always")
def approx_tanh(raw, qmult):
    """tanh(raw * qmult) by the special-function unit (``warp.tanh_approx``)."""
    return warp.tanh_approx(raw * qmult)


@functools.lru_cache(maxsize=None)
def make_pipeline(softcap: bool, alibi: bool, bias: bool, mods: CudaMods = NO_MODS, index_mods: bool = False,
                  tensor_cores: bool = False) -> Any:
    """The pipeline of ``numba_flash.score_pipeline.compile_with`` as an ``inline="always"`` device function in
    float32 and log2 units, with the stages ``softcap``, ``alibi``, ``bias`` (an attn_bias entry, or a SIMT
    kernel's staged tile value, which holds bias_mod and mask_mod too), ``index_mods`` (bias_mod's value and
    mask_mod's verdict given apart) and ``mods``' score_mod (user_mods.make_score_mod; none without one). With
    ``tensor_cores``, the tensor-core kernels' tanh and NaN (module docstring)."""
    return compile_with(cuda.jit(device=True, inline="always"), approx_tanh if tensor_cores else libdevice_tanh,
                        float32, LOG2E, softcap=softcap, alibi=alibi, bias=bias, index_mods=index_mods,
                        score_mod=make_score_mod(mods) if mods.score_mod is not None else None,
                        poison_by_product=tensor_cores)


__all__ = ["make_pipeline", "libdevice_tanh", "approx_tanh"]
