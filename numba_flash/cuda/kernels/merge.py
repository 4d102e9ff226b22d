"""Merging two partial attentions by their log-sum-exps on the GPU, for split-KV decoding: the device twin of
``numba_flash.merge_attention_states`` (same rules: a part with lse +inf saw no key and weighs nothing, whatever
its out row holds; a NaN lse makes the merged row NaN), so the parts never travel to the host.

One block per (query row, head); its threads share the row's head dim. Every thread works the two weights out
from the two lses (a handful of flops, cheaper than a barrier), writes its elements, and thread 0 writes the
merged lse. The result goes to separate arrays, so no thread reads what another writes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda  # a module global: the simulator swaps it for its own in kernels' globals

MERGE_THREADS = 64  # threads per row; the head dim is strided over them


@functools.lru_cache(maxsize=None)
def merge_kernel() -> Any:
    """The compiled kernel ``(out_a, lse_a, out_b, lse_b, out, lse)``: out_* (S, H, D) float32, lse_* (H, S)
    float32; launch with grid S * H and ``MERGE_THREADS`` threads."""

    @cuda.jit
    def merge_states(out_a, lse_a, out_b, lse_b, out, lse):
        s_len, heads, d_len = out.shape
        row = cuda.blockIdx.x
        if row >= s_len * heads:
            return
        s, h = row // heads, row % heads
        la, lb = lse_a[h, s], lse_b[h, s]
        fin_a, fin_b = not math.isinf(la) and not math.isnan(la), not math.isinf(lb) and not math.isnan(lb)
        poisoned = math.isnan(la) or math.isnan(lb)
        top = max(la, lb) if fin_a and fin_b else (la if fin_a else lb)
        w_a = math.exp(la - top) if fin_a else 0.0
        w_b = math.exp(lb - top) if fin_b else 0.0
        seen = fin_a or fin_b
        total = w_a + w_b if seen else 1.0
        for d in range(cuda.threadIdx.x, d_len, cuda.blockDim.x):
            value = 0.0
            if fin_a:
                value += w_a / total * out_a[s, h, d]
            if fin_b:
                value += w_b / total * out_b[s, h, d]
            out[s, h, d] = math.nan if poisoned else value
        if cuda.threadIdx.x == 0:
            lse[h, s] = math.nan if poisoned else (top + math.log(total) if seen else math.inf)

    return merge_states


def merge_states_device(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any, stream: Any = 0) -> tuple[Any, Any]:
    """Merge two float32 partial results held on the device, out_* (1, S, H, D) and lse_* (1, H, S) as the
    forward kernels write them for one sequence; returns new device arrays (out, lse) of the same shapes."""
    _, s_len, heads, d_len = out_a.shape
    out = cuda.device_array(out_a.shape, dtype=out_a.dtype, stream=stream)
    lse = cuda.device_array(lse_a.shape, dtype=lse_a.dtype, stream=stream)
    if s_len * heads:
        merge_kernel()[s_len * heads, MERGE_THREADS, stream](out_a[0], lse_a[0], out_b[0], lse_b[0], out[0], lse[0])
    return out, lse


__all__ = ["merge_kernel", "merge_states_device", "MERGE_THREADS"]
