"""CPU kernels: tiled FlashAttention-2 forward and backward as ``numba.njit(parallel=True)`` functions.

``flash_forward`` and ``flash_backward`` take (B, S, H, D) numpy views with any strides and write their results
into arrays the caller allocated; ``backends.cpu`` is the host side that converts user inputs.
"""

from .kernels import BLOCK_M, BLOCK_N, clear_workspace, flash_backward, flash_forward

__all__ = ["flash_forward", "flash_backward", "clear_workspace", "BLOCK_M", "BLOCK_N"]
