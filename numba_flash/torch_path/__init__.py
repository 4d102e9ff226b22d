"""Attention in plain torch ops, blockwise: the algorithm behind the ``rocm`` backend (``backends/rocm.py`` keeps
only its capability checks, array moves and the SDPA shortcut).

A blockwise online softmax: query blocks and key blocks in Python loops, running max and sum in float32 (float64
for float64 inputs), at most one block of scores alive per head, and key blocks outside the causal/window band
never computed (``blocks``). Each block's scores go through ``numba_flash.score_pipeline`` (softcap, ALiBi,
attn_bias, the mods), the description the CUDA and CPU kernels compile too (``scores``, ``bias_mods``). The
backward recomputes each block of probabilities from the lse (``backward``). Dropout makes each block's mask from
the Philox counters of ``numba_flash.dropout``, in the forward and again in the backward.

Non-finite values follow the contract (``numba_flash.reference`` spells the rule out). One reduction per input
tensor per call (``inputs_clean``) tells whether any value is non-finite or any score could overflow; only then do
the loops poison rows, keep masked pairs out of every product and report non-finite results as NaN (``careful``).

Every op works on any torch device. Importing this package does not import torch: each function imports it.
"""

from __future__ import annotations

from .backward import backward_blockwise
from .blocks import bias_finite, block_sizes, compute_dtype, heads_view, inputs_clean
from .forward import blockwise_into, forward_blockwise

__all__ = ["forward_blockwise", "backward_blockwise", "blockwise_into", "block_sizes", "inputs_clean",
           "bias_finite", "compute_dtype", "heads_view"]
