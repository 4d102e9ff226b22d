"""Warp-level primitives for the tensor-core kernels: ``mma.sync``, ``ldmatrix``, ``cp.async``, shuffles and
packing, as Numba intrinsics that emit inline PTX (``llvmlite.ir.InlineAsm``).

numba-cuda has no API for tensor cores; an ``@intrinsic`` reaches any PTX instruction, and compiles without a GPU
(``cuda.compile_ptx``). Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) the same names are emulations with the same
fragment layouts (``warp_sim.py``), so the kernels run there unchanged.

Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16" and "ldmatrix"). A warp's 32 lanes each hold a few
32-bit registers; ``g = lane // 4`` (the group) and ``t = lane % 4`` (the thread in the group) say which elements:

* A, 16 x 16 (row-major), four registers of two 16-bit elements each, low half first:
  ``a0 = A[g, 2t:2t+2]``, ``a1 = A[g+8, 2t:2t+2]``, ``a2 = A[g, 2t+8:2t+10]``, ``a3 = A[g+8, 2t+8:2t+10]``.
* B, 16 x 8 (k x n, "col": consecutive k of one column in a register):
  ``b0 = B[2t:2t+2, g]``, ``b1 = B[2t+8:2t+10, g]``.
* C and D, 16 x 8 float32, one element per register:
  ``c0, c1 = C[g, 2t], C[g, 2t+1]``, ``c2, c3 = C[g+8, 2t], C[g+8, 2t+1]``.
* ``ldmatrix .x4`` loads four 8 x 8 matrices of 16-bit elements from shared memory: lane ``8j + r`` gives the address
  of row ``r`` of matrix ``j`` (16 contiguous bytes), and register ``j`` of lane ``l`` receives row ``l // 4``,
  elements ``2(l % 4)`` and ``2(l % 4) + 1`` of matrix ``j``; with ``.trans`` it receives column ``l // 4``, rows
  ``2(l % 4)`` and ``2(l % 4) + 1`` instead. So A's four 8 x 8 quarters (rows 0-7/8-15 x columns 0-7/8-15, in the
  order a0..a3) load with one ``ldmatrix_x4``; K stored row-major (keys x d) gives the B operand of ``Q K^T``
  without ``.trans``, V stored row-major (keys x d) gives the B operand of ``P V`` with it.
* The C layout of two neighbouring n8 tiles equals the A layout of one k16 step (``c0, c1`` of tile ``2k`` are
  ``a0``'s elements, ``c2, c3`` are ``a1``'s, tile ``2k + 1`` gives ``a2``, ``a3``), which is how FlashAttention-2
  reuses the probabilities P as the A operand of ``P V`` without a trip through shared memory.

Every primitive is warp-synchronous (``.sync.aligned``): all 32 lanes of the warp must execute it together, from
block-uniform control flow in these kernels. Shared-memory operands are 1-D ``uint16`` arrays (16-bit elements of
either float16 or bfloat16) indexed in elements; ldmatrix and cp.async addresses must be 16-byte aligned
(an index that is a multiple of 8).
"""

from __future__ import annotations

from numba import config

__all__ = ["mma_f16", "mma_bf16", "mma_tf32", "ldmatrix_x4", "ldmatrix_x4_trans", "ldmatrix_x2",
           "ldmatrix_x2_trans", "lds_v4", "lds_u32", "sts_u32", "cp_async_16", "cp_async_16_at", "cp_async_commit",
           "cp_async_wait_all", "cp_async_wait_one", "shfl_xor", "pack_f16x2", "pack_bf16x2", "float_to_tf32",
           "bits_to_tf32", "probe_f16x2", "probe_bf16x2", "exp2_approx", "rcp_approx", "tanh_approx",
           "MIN_COMPUTE_CAPABILITY"]

#: mma.sync with float16/bfloat16 inputs, ldmatrix and cp.async need sm_80 (Ampere) or newer (float16 mma.m16n8k16
#: exists on sm_75, but bfloat16, cp.async and the kernels' tile pipeline do not).
MIN_COMPUTE_CAPABILITY = (8, 0)

if config.ENABLE_CUDASIM:
    from numba_flash.cuda.device.warp_sim import (  # noqa: F401  (re-exported)
        bits_to_tf32, cp_async_16, cp_async_16_at, cp_async_commit, # noqa: F401  (re-exported)
                                                  cp_async_wait_all, cp_async_wait_one, exp2_approx, float_to_tf32,
                                                  ldmatrix_x2, ldmatrix_x2_trans, ldmatrix_x4, ldmatrix_x4_trans,
                                                  lds_u32, lds_v4, mma_bf16, mma_f16, mma_tf32, pack_bf16x2,
                                                  pack_f16x2, probe_bf16x2, probe_f16x2, rcp_approx, shfl_xor,
                                                  sts_u32, tanh_approx)
else:
    from numba_flash.cuda.device.warp_ptx import (  # noqa: F401  (re-exported)
        bits_to_tf32, cp_async_16, cp_async_16_at, cp_async_commit, # noqa: F401  (re-exported)
                                                  cp_async_wait_all, cp_async_wait_one, exp2_approx, float_to_tf32,
                                                  ldmatrix_x2, ldmatrix_x2_trans, ldmatrix_x4, ldmatrix_x4_trans,
                                                  lds_u32, lds_v4, mma_bf16, mma_f16, mma_tf32, pack_bf16x2,
                                                  pack_f16x2, probe_bf16x2, probe_f16x2, rcp_approx, shfl_xor,
                                                  sts_u32, tanh_approx)
