"""``attn_bias`` for the blockwise torch path (``backends.rocm``): the bias of one (query block, key block) laid out
like that block's scores, and its gradient summed back to the bias's own shape.

The blockwise loops hold scores as (B, Hkv, n * g, m): a query block of n queries, each row one of the g query heads
of a kv head's group, query-major. The bias is (B, Hq, Sq, Sk) after broadcasting; it is never materialised at that
size: each block takes a broadcast view, and dbias is accumulated directly in the bias's own (smaller) shape, so
memory stays O(size of the bias) on top of the blockwise path's own.
"""

from __future__ import annotations

from typing import Any

from numba_flash.validation import AttentionCall


class BlockBias:
    """The call's ``attn_bias`` as a torch tensor, served per block. ``hides``: some entry is -inf (a hidden key,
    which the careful paths must treat like a masked one); ``finite``: every entry is finite."""

    def __init__(self, call: AttentionCall, bias: Any) -> None:
        import torch

        self.call = call
        self.shape = call.bias.shape
        g = call.group_size
        full = (call.batch, call.nheads_q, call.seqlen_q, call.seqlen_k)
        # (B, Hq, Sq, Sk) -> (B, Hkv, g, Sq, Sk): a view (stride 0 along broadcast dimensions), nothing copied.
        self.grouped = bias.reshape(self.shape).expand(full).unflatten(1, (call.nheads_kv, g))
        self.finite = bool(torch.isfinite(bias).all())
        self.hides = not self.finite and bool((bias == float("-inf")).any())

    def block(self, q0: int, q1: int, k0: int, k1: int, dtype: Any) -> Any:
        """The bias of queries q0:q1 against keys k0:k1 as (B, Hkv, n * g, m) in ``dtype``, rows like the scores'."""
        b, h, g = self.call.batch, self.call.nheads_kv, self.call.group_size
        part = self.grouped[:, :, :, q0:q1, k0:k1].permute(0, 1, 3, 2, 4)
        return part.to(dtype).reshape(b, h, (q1 - q0) * g, k1 - k0)

    def new_grad(self, dtype: Any, device: Any) -> Any:
        """A zero dbias accumulator in the bias's four-dimensional shape."""
        import torch

        return torch.zeros(self.shape, dtype=dtype, device=device)

    def add_grad(self, dbias: Any, ds: Any, q0: int, q1: int, k0: int, k1: int) -> None:
        """Add a block's score gradient ``ds`` (B, Hkv, n * g, m) into ``dbias``, summed over the dimensions the
        bias was broadcast along."""
        b, h, g = self.call.batch, self.call.nheads_kv, self.call.group_size
        n, m = q1 - q0, k1 - k0
        grad = ds.view(b, h, n, g, m).permute(0, 1, 3, 2, 4).reshape(b, h * g, n, m)
        dims = tuple(d for d, size in enumerate(self.shape) if size == 1 and grad.shape[d] != 1)
        if dims:
            grad = grad.sum(dim=dims, keepdim=True)
        rows = slice(q0, q1) if self.shape[2] != 1 else slice(None)
        cols = slice(k0, k1) if self.shape[3] != 1 else slice(None)
        dbias[:, :, rows, cols] += grad


__all__ = ["BlockBias"]
