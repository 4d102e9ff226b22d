"""Blocks of the torch path: their sizes, the key blocks each query block visits (``Band``), the layout views the
loops index through, and the non-finite bookkeeping (``inputs_clean`` decides whether the careful paths run;
``visible_matmul`` and ``nan_if_not_finite_`` keep a non-finite value to the rows that see it).

Grouped-query attention never repeats K/V: the ``g = Hq // Hkv`` query heads of a group are folded into the rows of
the query block, ``(B, Hkv, Sq_block * g, D)``, which multiplies against the group's single ``(B, Hkv, Sk_block, D)``
key block. torch is imported inside functions.
"""

from __future__ import annotations

import math
from typing import Any

from numba_flash.arrays import as_plain_tensor
from numba_flash.semantics import key_range
from numba_flash.validation import AttentionCall


# Elements of one block of scores (B * Hq * block_q * block_k); 2**24 float32 is 64 MiB. The backward keeps about
# four such blocks alive (scores/probabilities, dP, dS and a product), the forward two.
SCORE_BLOCK_ELEMENTS = 1 << 24
# On a GPU each block costs a dozen kernel launches, so blocks are large; query blocks stay well below the sequence
# so that causal calls still skip about half the key blocks. On a CPU the elementwise passes over the scores
# dominate and blocks that stay in cache win (on 2 cores, S=2048: 256 x 256 took 1.5x to 3x less time than
# 2048 x 512).
GPU_BLOCK_Q, GPU_BLOCK_K = 1024, 1024
CPU_BLOCK_Q, CPU_BLOCK_K = 256, 256
MIN_BLOCK_Q = 16


def block_sizes(call: AttentionCall) -> tuple[int, int]:
    """(block_q, block_k) for ``call``: the device's preferred sizes, with fewer query rows where needed to keep
    one block of scores within ``SCORE_BLOCK_ELEMENTS``. A narrow sliding window shrinks the query block so that
    the band, not the rectangle around it, sets the work."""
    on_cpu = call.device == "cpu"
    block_q, block_k = (CPU_BLOCK_Q, CPU_BLOCK_K) if on_cpu else (GPU_BLOCK_Q, GPU_BLOCK_K)
    block_k = min(block_k, call.seqlen_k)
    block_q = min(block_q, max(MIN_BLOCK_Q, SCORE_BLOCK_ELEMENTS // (call.batch * call.nheads_q * block_k)))
    if call.window_left >= 0 and call.window_right >= 0:
        block_q = min(block_q, max(MIN_BLOCK_Q, call.window_left + call.window_right + 1))
    return min(block_q, call.seqlen_q), block_k


def compute_dtype(dtype: Any) -> Any:
    """The torch dtype the blocks are computed in for inputs of ``dtype``: float64 for float64, else float32."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def heads_view(x: Any, layout: str) -> Any:
    """(B, H, S, D) view of a tensor in ``layout``; no copy."""
    return x.permute(0, 2, 1, 3) if layout == "bshd" else x


def grouped_view(x: Any, layout: str, nheads_kv: int) -> Any:
    """(B, Hkv, S, g, D) view of a query-shaped tensor: query head h = kv * g + r sits at [:, kv, :, r]. No copy
    (splitting one dimension in two is always a view), so it can be read from and written to."""
    return heads_view(x, layout).unflatten(1, (nheads_kv, -1)).permute(0, 1, 3, 2, 4)


def lse_view(lse: Any, nheads_kv: int) -> Any:
    """(B, Hkv, Sq, g) view of an lse of shape (B, Hq, Sq)."""
    return lse.unflatten(1, (nheads_kv, -1)).permute(0, 1, 3, 2)


class Band:
    """The key blocks each query block must visit, and whether a block needs the mask, from the contract's
    visibility rule (``numba_flash.semantics.key_range``). Row i sees keys [lo_i, hi_i); lo_i and hi_i never
    decrease with i, so a query block [q0, q1) sees at most keys [lo_q0, hi_{q1-1}) and sees all of a key block
    [k0, k1) iff lo_{q1-1} <= k0 and k1 <= hi_q0."""

    def __init__(self, call: AttentionCall):
        self.sq, self.sk = call.seqlen_q, call.seqlen_k
        self.left, self.right = call.window_left, call.window_right

    def key_blocks(self, q0: int, q1: int, block_k: int) -> list[tuple[int, int, bool]]:
        """``(k0, k1, needs_mask)`` for each key block of at most ``block_k`` keys that query block [q0, q1)
        sees; ``needs_mask`` is False where every row sees every key of the block."""
        lo_first, hi_first = key_range(q0, self.sq, self.sk, self.left, self.right)
        lo_last, hi_last = key_range(q1 - 1, self.sq, self.sk, self.left, self.right)
        blocks = []
        for k0 in range(lo_first, hi_last, block_k):
            k1 = min(k0 + block_k, hi_last)
            blocks.append((k0, k1, not (lo_last <= k0 and k1 <= hi_first)))
        return blocks

    def visible(self, q0: int, q1: int, k0: int, k1: int, device: Any) -> Any:
        """Boolean (q1 - q0, 1, k1 - k0) mask, True where row i sees key j (the 1 broadcasts over a group)."""
        import torch

        i = torch.arange(q0 + self.sk - self.sq, q1 + self.sk - self.sq, device=device)[:, None, None]
        j = torch.arange(k0, k1, device=device)[None, None, :]
        ok = torch.ones((q1 - q0, 1, k1 - k0), dtype=torch.bool, device=device)
        if self.left >= 0:
            ok &= j >= i - self.left
        if self.right >= 0:
            ok &= j <= i + self.right
        return ok


def inputs_clean(call: AttentionCall, cdt: Any, *tensors: Any) -> bool:
    """Whether the plain paths give the contract's answer: every value of ``tensors`` (q, k, v first) finite, and
    no score ``scale * q.k`` (at most ``scale * D * max|q| * max|k|``) or output sum (at most ``Sk * max|v|``) able
    to overflow. One max-abs reduction per tensor (NaN when it holds one) and one device sync per call."""
    import torch

    # One stack, one sync; the inputs share a dtype (and float64 is not on every device, e.g. MPS).
    maxes = torch.stack([torch.linalg.vector_norm(x, float("inf")) for x in tensors]).tolist()
    if not all(math.isfinite(x) for x in maxes):
        return False
    qmax, kmax, vmax = maxes[:3]
    # Headroom of 4 for rounding; the input dtype's range for the scores, which SDPA may hold in that dtype.
    score_limit = float(torch.finfo(tensors[0].dtype).max) / 4
    return (call.softmax_scale * call.head_dim * qmax * kmax <= score_limit
            and call.seqlen_k * vmax <= float(torch.finfo(cdt).max) / 4)


def bias_finite(call: AttentionCall) -> bool:
    """True when the call has no ``attn_bias`` or every entry of it is finite (else the careful paths run: -inf
    hides keys, NaN poisons rows)."""
    import torch

    return call.bias is None or bool(torch.isfinite(as_plain_tensor(call.bias.array)).all())


def nan_if_not_finite_(x: Any) -> Any:
    """In place: every non-finite value of ``x`` (a tensor this module allocated) becomes NaN."""
    import torch

    return x.masked_fill_(~torch.isfinite(x), float("nan"))


def visible_matmul(a: Any, b: Any, vis: Any) -> Any:
    """``a @ b`` over visible pairs only, for a masked block (``a`` is 0 where ``vis`` is False): non-finite
    entries of ``b`` are left out of the product (a plain one adds 0 * nan = nan to rows that do not see them) and
    marked NaN in every row that sees them. a (..., r, m), b (..., m, D), vis (r, m) bool."""
    import torch

    bad = ~torch.isfinite(b)
    res = a @ b.masked_fill(bad, 0.0)
    hits = vis.to(b.dtype) @ bad.to(b.dtype)
    return res.masked_fill_(hits > 0, float("nan"))


def block_visible(band: Band, q0: int, q1: int, k0: int, k1: int, group: int, device: Any,
                  hidden: Any = None) -> Any:
    """(n*g, m) bool: row r of a query block (query q0 + r // g) sees key k0 + c; (B, Hkv, n*g, m) when a term
    ``hidden`` some keys (``block_scores``)."""
    import torch

    ok = band.visible(q0, q1, k0, k1, device) | torch.zeros((1, group, 1), dtype=torch.bool, device=device)
    ok = ok.reshape((q1 - q0) * group, k1 - k0)
    return ok if hidden is None else ok & ~hidden


def dropout_factors(call: AttentionCall, q0: int, q1: int, k0: int, k1: int, cdt: Any, device: Any) -> Any:
    """(B, Hkv, n*g, m) factors of a block's probabilities, 1 / (1 - p) where ``numba_flash.dropout`` keeps the
    pair and 0 where it drops it, made from the counters (b, h, i, j) each time (forward and backward alike, so the
    mask is never stored); None without dropout."""
    import torch

    from numba_flash.dropout import dropout_keep_torch, dropout_scale, dropout_threshold

    if not call.dropout_p:
        return None
    idx = lambda lo, hi: torch.arange(lo, hi, dtype=torch.int64, device=device)  # noqa: E731
    b = idx(call.dropout_batch0, call.dropout_batch0 + call.batch).view(-1, 1, 1, 1, 1)
    h = idx(0, call.nheads_q).view(1, call.nheads_kv, 1, call.group_size, 1)   # query head kv * g + r
    i, j = idx(q0, q1).view(1, 1, -1, 1, 1), idx(k0, k1).view(1, 1, 1, 1, -1)
    keep = dropout_keep_torch(call.dropout_seed, dropout_threshold(call.dropout_p), b, h, i, j)
    return keep.to(cdt).mul_(dropout_scale(call.dropout_p)).flatten(2, 3)



__all__ = ["Band", "block_sizes", "compute_dtype", "heads_view", "grouped_view", "lse_view", "inputs_clean",
           "bias_finite", "nan_if_not_finite_", "visible_matmul", "block_visible", "dropout_factors"]
