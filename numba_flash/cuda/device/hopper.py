"""Hopper (sm_90a) primitives for FlashAttention-3's structure: ``wgmma.mma_async``, shared-memory matrix
descriptors, mbarriers, bulk asynchronous copies and ``setmaxnreg``, as Numba intrinsics emitting inline PTX
(``hopper_ptx.py``), or under the simulator (``NUMBA_ENABLE_CUDASIM=1``) as emulations written from the PTX ISA
(``hopper_sim.py``), so kernels and tests run there unchanged.

These need compute capability 9.0 compiled for ``sm_90a`` (numba-cuda does so on a 9.0 device; without one,
``cuda.compile_ptx(..., cc=(9, 0, "a"))``). Plain ``sm_90`` rejects wgmma and setmaxnreg.

**wgmma** (``make_wgmma(n, kind, a_in_registers, trans_b)``): a warpgroup (128 consecutive threads, the first a
multiple of 128) computes ``D (64 x n) = A (64 x K) B (K x n) + D`` in float32, ``kind`` "f16" or "bf16" (K = 16)
or the 8-bit floats "e4m3" and "e5m2" (K = 32: the same 32 bytes of K per row), ``n`` a multiple of 8 up to 256.
Every thread of the warpgroup calls it together. 8-bit operands live in the same 16-bit shared arrays, two to an
element (byte ``2 e`` the low half of element ``e``); the ISA reads them K-major only (no ``trans_b``).

* Accumulators: thread ``l`` of the warpgroup (warp ``w = l // 32``, ``g = (l % 32) // 4``, ``t = l % 4``)
  holds ``n / 2`` floats, the first ``n / 2`` elements of a C-contiguous float32 local array, best shaped
  ``(n / 8, 4)``: ``acc[j, 0], acc[j, 1] = D[16w + g, 8j + 2t], D[16w + g, 8j + 2t + 1]`` and ``acc[j, 2],
  acc[j, 3]`` the same columns of row ``16w + g + 8``. This is ``mma.m16n8k16``'s C layout (warp.py) for the
  warp's 16 rows, tile after tile, so the tensor-core kernels' softmax helpers apply unchanged.
* A from shared memory (``wgmma(acc, desc_a, desc_b, scale_d)``, K-major), or from registers
  (``wgmma(acc, a0, a1, a2, a3, desc_b, scale_d)``): each warp's 16 rows in ``mma.m16n8k16``'s A layout, which
  two neighbouring accumulator tiles packed to 16 bits give (the probabilities of ``P V`` stay in registers). For
  8-bit kinds the same bytes: register ``r`` of lane ``(g, t)`` holds row ``g + 8 (r % 2)``, columns
  ``16 (r // 2) + 4 t`` to ``+ 3``, lowest byte first (``mma.m16n8k32``'s A layout).
* B from shared memory: K-major (element ``B[k, j]`` at row ``j``, column ``k`` of the operand: ``K`` stored (keys,
  d) for ``Q K^T``), or N-major with ``trans_b`` (``V`` stored (keys, d) for ``P V``).
* ``scale_d``: 0 computes ``D = A B`` (the accumulators' old values are not read), anything else adds.
* Descriptors (``smem_desc(smem, index, lbo_bytes, sbo_bytes, swizzle)``, the operand starting at element
  ``index`` of a 1-D 16-bit shared array): the ISA's canonical layouts. With the 128-byte swizzle (code 1), a
  K-major operand is 8-row atoms of 128-byte rows (64 elements of K), rows 8 apart ``sbo_bytes`` apart (1024 when
  dense), the 16-byte chunk ``c`` of row ``r`` stored at chunk ``c ^ (r % 8)``; the next 16 elements of K start 32
  bytes further (a new descriptor). An N-major operand is 8-row atoms along K of 128-byte rows along N, 64 columns
  of N ``lbo_bytes`` apart, 8 rows of K ``sbo_bytes`` apart. The swizzle XORs address bits, so a swizzled tile
  must start 1024-byte aligned. Under the simulator a descriptor must come from ``smem_desc`` unchanged.
* Ordering: ``wgmma_fence()`` before the first wgmma that reads registers or accumulators written since the last
  one; ``wgmma_commit()`` closes a group of issued wgmmas; ``make_wgmma_wait(k)()`` waits until at most ``k``
  committed groups are in flight. Accumulators are undefined until the group that writes them is waited for: call
  ``make_accumulator_fence(n // 2)(acc)`` after the wait and before reading them, so the compiler cannot move the
  reads above it. Shared memory a wgmma reads must not be written until its wait, and generic-proxy stores must be
  followed by ``fence_proxy_async()`` before a wgmma or bulk copy reads the same memory.

**mbarriers** (1-D shared array of uint64, one barrier per element): ``mbarrier_init(bars, i, count)`` (one
thread, then ``fence_mbarrier_init()`` and a ``syncthreads()``), ``mbarrier_arrive(bars, i)``,
``mbarrier_arrive_expect_tx(bars, i, nbytes)`` (an arrival that also expects ``nbytes`` of bulk copies),
``mbarrier_try_wait_parity(bars, i, parity)`` (1 once the phase of that parity has completed) and
``mbarrier_wait(bars, i, parity)`` (spins on it). A phase completes when all ``count`` arrivals are in and the
expected bytes have landed; waiting on parity ``p`` when the barrier has moved two phases past blocks forever.

**Bulk copies**: ``bulk_copy_g2s(dst, dst_index, src, byte_offset, nbytes, bars, i)`` copies ``nbytes`` (a
multiple of 16) from ``byte_offset`` bytes past the data pointer of the global array ``src`` into a 1-D 16-bit
shared array, 16-byte aligned at both ends, completing its bytes on ``bars[i]``; read ``dst`` only after waiting on
that barrier's phase.

**setmaxnreg**: ``make_setmaxnreg(count, increase)()`` moves the calling warpgroup's register budget up (``inc``)
or down (``dec``) to ``count`` (24 to 256, a multiple of 8): producer warpgroups give registers to the consumers.
"""

from __future__ import annotations

from typing import Any

from numba import config, cuda

__all__ = [
    "ARCH",
    "MIN_COMPUTE_CAPABILITY",
    "WGMMA_K",
    "bulk_copy_g2s",
    "fence_mbarrier_init",
    "fence_proxy_async",
    "make_accumulator_fence",
    "make_setmaxnreg",
    "make_wgmma",
    "make_wgmma_wait",
    "mbarrier_arrive",
    "mbarrier_arrive_expect_tx",
    "mbarrier_init",
    "mbarrier_try_wait_parity",
    "mbarrier_wait",
    "smem_desc",
    "wgmma_commit",
    "wgmma_fence",
]

#: wgmma, setmaxnreg, mbarrier transaction counts and bulk copies: Hopper, compiled for the "a" target.
MIN_COMPUTE_CAPABILITY = (9, 0)
ARCH = (9, 0, "a")

if config.ENABLE_CUDASIM:
    from numba_flash.cuda.device import hopper_sim as _impl
else:
    from numba_flash.cuda.device import hopper_ptx as _impl

smem_desc, make_accumulator_fence = _impl.smem_desc, _impl.make_accumulator_fence
wgmma_fence, wgmma_commit = _impl.wgmma_fence, _impl.wgmma_commit
fence_proxy_async, fence_mbarrier_init = _impl.fence_proxy_async, _impl.fence_mbarrier_init
mbarrier_init, mbarrier_arrive = _impl.mbarrier_init, _impl.mbarrier_arrive
mbarrier_arrive_expect_tx, mbarrier_try_wait_parity = _impl.mbarrier_arrive_expect_tx, _impl.mbarrier_try_wait_parity
bulk_copy_g2s = _impl.bulk_copy_g2s


#: wgmma's operand kinds and the K of one instruction for each (32 bytes of K per row either way).
WGMMA_K = {"f16": 16, "bf16": 16, "e4m3": 32, "e5m2": 32}


def make_wgmma(n: int, kind: str, a_in_registers: bool, trans_b: bool) -> Any:
    """The wgmma of one shape (see above), for either implementation; ValueError for a shape the ISA lacks."""
    if n % 8 or not 8 <= n <= 256 or kind not in WGMMA_K:
        raise ValueError(f"wgmma: N must be a multiple of 8 from 8 to 256 and kind one of {', '.join(WGMMA_K)}, "
                         f"got {n}, {kind}")
    if trans_b and WGMMA_K[kind] != 16:
        raise ValueError(f"wgmma: {kind} operands are read K-major only (trans_b is for f16 and bf16)")
    return _impl.make_wgmma(n, kind, a_in_registers, trans_b)


def make_wgmma_wait(pending: int) -> Any:
    """``wgmma.wait_group <pending>`` (0 to 7)."""
    if not 0 <= pending <= 7:
        raise ValueError(f"wgmma_wait: pending must be 0 to 7, got {pending}")
    return _impl.make_wgmma_wait(pending)


def make_setmaxnreg(count: int, increase: bool) -> Any:
    """``setmaxnreg`` to ``count`` registers (24 to 256, a multiple of 8), up or down."""
    if count % 8 or not 24 <= count <= 256:
        raise ValueError(f"setmaxnreg: the count must be a multiple of 8 from 24 to 256, got {count}")
    return _impl.make_setmaxnreg(count, increase)


@cuda.jit(device=True, inline="always")
def mbarrier_wait(bars, index, parity):
    """Spin until the phase of ``parity`` of ``bars[index]`` has completed."""
    while mbarrier_try_wait_parity(bars, index, parity) == 0:
        pass
