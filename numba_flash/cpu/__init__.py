"""CPU kernels: tiled FlashAttention-2 forward and backward as ``numba.njit(parallel=True)`` functions.

``flash_forward`` and ``flash_backward`` take (B, S, H, D) numpy views with any strides, or packed sequences
((total, H, D) arrays with ``cu_seqlens_q`` / ``cu_seqlens_k``, every sequence in one kernel call per pass), and
write their results into arrays the caller allocated; ``backends.cpu`` is the host side that converts user inputs.

Scratch memory: each thread that calls the kernels keeps its scratch buffers (packed K/V/Q/dO, dQ accumulators)
between calls, until it exits or calls ``clear_workspace()``, because fresh multi-MiB buffers cost page faults on
every call. Each buffer is kept only up to a cap, 64 MiB by default: up to 128 MiB per thread after a forward and
320 MiB after a backward. ``set_workspace_limit(nbytes)`` or ``NUMBA_FLASH_CPU_SCRATCH_MIB`` sets the cap (0 keeps
nothing); ``workspace_bytes()`` says what this thread holds.

The forward also keeps each row's max and 1 / sum (B x Hq x Sq values, twice), with a copy of the lse it wrote,
so that the backward given that lse skips a pass over the scores; the most recent entries are kept, up to
``stash.STASH_MAX_BYTES`` (64 MiB) per process.

Modules: ``simd`` (tile sizes, vector width, inlined arithmetic), ``microkernels`` (the register-blocked
products), ``passes`` (softmax column passes, row copies), ``tiles`` (the causal/window band), ``workspace``
(compiled entries, scratch, packing), ``schedule`` (the sequences a call covers, dense or packed, and the order
its threads take the work in), ``forward``, ``backward`` (the kernels and the host side) with ``backward_blocks``
(their block steps), ``stash``, and ``decode`` (KV-cache decoding) with ``decode_tile`` (its per-tile steps).
"""

from .. import compile_notice
from .backward import flash_backward
from .forward import flash_forward
from .simd import BLOCK_M, BLOCK_N
from .workspace import clear_workspace, set_workspace_limit, workspace_bytes

# Before anything here can compile: a cold cache then says so instead of hanging silently for half a minute.
compile_notice.install()

__all__ = ["flash_forward", "flash_backward", "clear_workspace", "set_workspace_limit", "workspace_bytes",
           "BLOCK_M", "BLOCK_N"]
