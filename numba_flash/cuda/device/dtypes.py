"""How each input dtype is stored in the arrays the kernels see, and how its elements become float32 and back.

float32 and float16 arrays reach the kernels as they are; numba's casts widen float16 on load and narrow on store.
bfloat16 has no numpy dtype, so numba has no bfloat16 arrays, and torch does not export bfloat16 through
``__cuda_array_interface__``: bfloat16 tensors reach the kernels viewed, zero-copy, as int16 arrays of their bit
patterns. A bfloat16 is the high half of a float32, so widening is a shift and a bit cast, and narrowing rounds the
float32 bit pattern to nearest, ties to even. All arithmetic stays float32; the kernels need no bfloat16
instruction.

The helpers are ``cuda.jit(device=True, inline="always")``: numba splices them into the calling kernel's IR before
typing, so ``cuda.compile_ptx`` builds the kernels without a driver. (A helper without ``inline="always"`` is
compiled on its own for the *current device's* compute capability, which needs a GPU.) The simulator runs them as
Python; libdevice's bit casts are the one thing it cannot run, so there they are numpy views, bit for bit the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import config, cuda, float32, int16, int32, int64

_inline = cuda.jit(device=True, inline="always")

if config.ENABLE_CUDASIM:
    def _int_as_float(i: Any) -> Any:
        return np.int32(i).view(np.float32)

    def _float_as_int(x: Any) -> Any:
        return np.float32(x).view(np.int32)
else:
    from numba.cuda.libdevice import float_as_int as _float_as_int
    from numba.cuda.libdevice import int_as_float as _int_as_float


@_inline
def load_bf16(bits):
    """float32 of a bfloat16 element stored as int16 bits: they become the high half of the float32."""
    return _int_as_float(int32((int64(bits) & 0xFFFF) << 16))


@_inline
def store_bf16(x):
    """int16 bits of float32 ``x`` rounded to bfloat16: nearest, ties to even; overflow gives +-inf, a NaN stays a
    (quiet) NaN instead of rounding into inf."""
    u = int64(_float_as_int(x)) & 0xFFFFFFFF   # the bit pattern, non-negative so that >> shifts in zeros
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return int16((u >> 16) | 0x40)
    u += 0x7FFF + ((u >> 16) & 1)
    return int16(u >> 16)


@_inline
def load_f16_bits(bits):
    """float32 of a float16 element stored as uint16 bits (how the tensor-core kernels see their arrays): exact,
    subnormals, infinities and NaNs included. Their hot paths move bits; this is for their rare paths."""
    u = int64(bits) & 0xFFFF
    exponent, mantissa = (u >> 10) & 0x1F, u & 0x3FF
    if exponent == 0x1F:
        magnitude = _int_as_float(int32(0x7F800000 | (mantissa << 13)))
    elif exponent == 0:
        magnitude = float32(mantissa) * float32(2.0 ** -24)
    else:
        magnitude = _int_as_float(int32(((exponent + 112) << 23) | (mantissa << 13)))
    return -magnitude if u & 0x8000 else magnitude


def element_io(bf16: bool) -> tuple[Any, Any]:
    """(load, store) of a kernel built for bfloat16 bit arrays (``bf16``) or for float32/float16 arrays:
    ``load(element) -> float32`` and ``store(float32) -> what to assign to an element``.

    For float arrays both are numba's ``float32`` cast (a no-op on float32; storing into a float16 array narrows,
    round to nearest even): a cast, unlike a helper, costs the compiler no inlining pass.
    """
    return (load_bf16, store_bf16) if bf16 else (float32, float32)
