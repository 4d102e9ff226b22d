"""Score terms for the blockwise torch path (``numba_flash.torch_path``): ``attn_bias`` (the bias of one (query
block, key block) laid out like that block's scores, and its gradient summed back to the bias's own shape) and the
user mods of ``numba_flash.mods`` (bias_mod, mask_mod, score_mod and its gradient), evaluated on the host by the
same numba-compiled functions the CPU kernels call, so every backend sees the same values.

The blockwise loops hold scores as (B, Hkv, n * g, m): a query block of n queries, each row one of the g query heads
of a kv head's group, query-major. The bias is (B, Hq, Sq, Sk) after broadcasting; it is never materialised at that
size: each block takes a broadcast view, and dbias is accumulated directly in the bias's own (smaller) shape, so
memory stays O(size of the bias) on top of the blockwise path's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_flash.mods import EMPTY, FULL, evaluate_block
from numba_flash.validation import AttentionCall


def to_rows(x: Any, call: AttentionCall) -> Any:
    """(B, Hq, n, m) -> (B, Hkv, n * g, m), the blockwise loops' row order (query-major, then the group's heads)."""
    b, _, n, m = x.shape
    return x.unflatten(1, (call.nheads_kv, call.group_size)).permute(0, 1, 3, 2, 4).reshape(
        b, call.nheads_kv, n * call.group_size, m)


def from_rows(x: Any, call: AttentionCall) -> Any:
    """(B, Hkv, n * g, m) -> (B, Hq, n, m), the inverse of ``to_rows``."""
    b, h, rows, m = x.shape
    g = call.group_size
    return x.view(b, h, rows // g, g, m).permute(0, 1, 3, 2, 4).reshape(b, h * g, rows // g, m)


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
        return to_rows(self.grouped[:, :, :, q0:q1, k0:k1].flatten(1, 2).to(dtype), self.call)

    def new_grad(self, dtype: Any, device: Any) -> Any:
        """A zero dbias accumulator in the bias's four-dimensional shape."""
        import torch

        return torch.zeros(self.shape, dtype=dtype, device=device)

    def add_grad(self, dbias: Any, ds: Any, q0: int, q1: int, k0: int, k1: int) -> None:
        """Add a block's score gradient ``ds`` (B, Hkv, n * g, m) into ``dbias``, summed over the dimensions the
        bias was broadcast along."""
        grad = from_rows(ds, self.call)
        dims = tuple(d for d, size in enumerate(self.shape) if size == 1 and grad.shape[d] != 1)
        if dims:
            grad = grad.sum(dim=dims, keepdim=True)
        rows = slice(q0, q1) if self.shape[2] != 1 else slice(None)
        cols = slice(k0, k1) if self.shape[3] != 1 else slice(None)
        dbias[:, :, rows, cols] += grad


class BlockMods:
    """The call's mods per block, as (B, Hkv, n * g, m) tensors like the scores'. The numba-compiled mods run on
    the host in float64; the results travel to the scores' device."""

    def __init__(self, call: AttentionCall) -> None:
        self.call = call
        self.mods = call.mods
        self.heads = range(call.nheads_q)
        self.batches = range(call.batch)

    def _eval(self, name: str, q0: int, q1: int, k0: int, k1: int, scores: Any = None) -> np.ndarray:
        return evaluate_block(getattr(self.mods, name), name, self.batches, self.heads, range(q0, q1),
                              range(k0, k1), scores)

    def _tiles(self, q0: int, q1: int, k0: int, k1: int) -> Any:
        bm = self.mods.block_mask
        return bm.states[..., q0 // bm.block_m:(q1 - 1) // bm.block_m + 1, k0 // bm.block_n:(k1 - 1) // bm.block_n + 1]

    def keep(self, q0: int, q1: int, k0: int, k1: int, like: Any) -> Any:
        """mask_mod over the block as a bool tensor on ``like``'s device, or None where it hides nothing (no
        mask_mod, or a block_mask whose tiles here are all full)."""
        import torch

        if self.mods.mask_mod is None:
            return None
        if self.mods.block_mask is not None:
            tiles = self._tiles(q0, q1, k0, k1)
            if (tiles == FULL).all():
                return None
            if (tiles == EMPTY).all():
                return torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=like.device).expand(
                    self.call.batch, self.call.nheads_kv, (q1 - q0) * self.call.group_size, k1 - k0)
        vals = torch.from_numpy(self._eval("mask_mod", q0, q1, k0, k1))
        return to_rows(vals, self.call).to(like.device)

    def bias(self, q0: int, q1: int, k0: int, k1: int, like: Any) -> Any:
        """bias_mod over the block in ``like``'s dtype and device, or None without a bias_mod."""
        import torch

        if self.mods.bias_mod is None:
            return None
        return to_rows(torch.from_numpy(self._eval("bias_mod", q0, q1, k0, k1)), self.call).to(like)

    def score(self, s: Any, apply: Any, q0: int, q1: int, k0: int, k1: int, grad: bool) -> tuple[Any, Any]:
        """The score pipeline's score_mod hook on a block: score_mod applied to the finite scores of ``s`` (B, Hkv,
        n * g, m) where ``apply`` (a bool tensor like ``s``, or one bool for the block) allows it; returns (new
        scores, d score_mod / d score where it applied and 1 elsewhere, or 1.0 without ``grad``)."""
        import torch

        pre = from_rows(s, self.call).to(device="cpu", dtype=torch.float64).numpy()
        use = np.isfinite(pre)
        if not isinstance(apply, bool):
            use &= from_rows(apply, self.call).cpu().numpy()
        elif not apply:
            use[...] = False
        safe = np.where(use, pre, 0.0)
        new = np.where(use, self._eval("score_mod", q0, q1, k0, k1, safe), pre)
        back = lambda a: to_rows(torch.from_numpy(a), self.call).to(s)  # noqa: E731
        dmod = back(np.where(use, self._eval("score_mod_grad", q0, q1, k0, k1, safe), 1.0)) if grad else 1.0
        return back(new), dmod


__all__ = ["BlockBias", "BlockMods", "to_rows", "from_rows"]
