"""Scores of one (query block, key block) pair on the torch path: ``ScoreTerms`` runs the call's score pipeline
(``numba_flash.score_pipeline``: softcap, ALiBi, attn_bias, the mods) on whole blocks with torch ops, the same
description the CUDA and CPU kernels compile, and ``block_scores`` applies it and the band's mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_flash.arrays import as_plain_tensor
from numba_flash.validation import AttentionCall

from .blocks import Band


def _alibi_slopes(call: AttentionCall, cdt: Any, device: Any) -> Any:
    """ALiBi slopes as a (B, Hkv, 1, g) tensor, laid out like a query block's rows; None without ALiBi."""
    import torch

    if call.alibi is None:
        return None
    slopes = torch.as_tensor(np.array(call.alibi), dtype=cdt, device=device)
    return slopes.view(call.batch, call.nheads_kv, 1, call.group_size)


def _select(cond: Any, if_true: Any, if_false: Any) -> Any:
    """The score pipeline's select on blocks: a bool tensor picks per pair, a Python bool (a block where the stage
    hides nothing) picks the whole."""
    import torch

    if isinstance(cond, torch.Tensor):
        return torch.where(cond, if_true, if_false)
    return if_true if cond else if_false


def _logical_not(flag: Any) -> Any:
    return ~flag if not isinstance(flag, bool) else not flag


class ScoreTerms:
    """What a call does to its scores: the score pipeline of ``numba_flash.score_pipeline`` (softcap, ALiBi,
    attn_bias as a ``bias_mods.BlockBias``, bias_mod and mask_mod, score_mod, as ``BlockMods``) run on
    whole blocks with torch ops, built per call with the call's switches."""

    def __init__(self, call: AttentionCall, cdt: Any, device: Any) -> None:
        from .bias_mods import BlockBias, BlockMods

        self.call = call
        self.alibi = _alibi_slopes(call, cdt, device)
        self.bias = None if call.bias is None else BlockBias(call, as_plain_tensor(call.bias.array))
        self.mods = None if call.mods is None else BlockMods(call)
        mods = call.mods
        self.index_mods = mods is not None and (mods.mask_mod is not None or mods.bias_mod is not None)
        self.score_mod = mods is not None and mods.score_mod is not None
        self.staged = call.softcap > 0 or self.alibi is not None or self.bias is not None or mods is not None
        self._pipelines: dict[tuple[bool, bool], Any] = {}

    def keep(self, q0: int, q1: int, k0: int, k1: int, like: Any) -> Any:
        """mask_mod's verdict on the block (B, Hkv, n*g, m) bool, or None when it hides nothing there."""
        return None if self.mods is None else self.mods.keep(q0, q1, k0, k1, like)

    def pipeline(self, grad: bool, careful: bool) -> Any:
        """The pipeline for a forward (``grad`` False: no chain factors) or a backward, ``careful`` or not: the
        forward makes a visible non-finite score NaN (``finite``), the backward reads it only under score_mod (where
        a -inf product must poison, not hide; elsewhere its rows are NaN through the forward's lse)."""
        import torch

        key = (grad, careful)
        if key not in self._pipelines:
            from numba_flash.score_pipeline import compile_with

            mods = self.mods

            def hook(x, apply, b, h, q0, k0, q1, k1):
                return mods.score(x, apply, q0, q1, k0, k1, grad)

            # The block of raw scores is this module's own; the pipeline reads it after softcap's tanh only to
            # tell which products were finite, so without that check tanh may overwrite it.
            check = careful and (not grad or self.score_mod)
            tanh = (lambda raw, qmult: torch.tanh(raw * qmult)) if check else \
                (lambda raw, qmult: raw.mul_(qmult).tanh_())
            self._pipelines[key] = compile_with(
                lambda f: f, tanh, float, 1.0,
                softcap=self.call.softcap > 0, alibi=self.alibi is not None, bias=self.bias is not None,
                index_mods=self.index_mods, score_mod=hook if self.score_mod else None, select=_select,
                logical_not=_logical_not, scaled=True, bias_hides=self.bias is not None and self.bias.hides,
                chain=grad, check_finite=check)
        return self._pipelines[key]

    def slopes(self, q0: int, q1: int) -> Any:
        """ALiBi's slopes for a query block's rows, (B, Hkv, n*g, 1)."""
        b, h, _, g = self.alibi.shape
        return self.alibi.expand(b, h, q1 - q0, g).reshape(b, h, (q1 - q0) * g, 1)

    def distance(self, q0: int, q1: int, k0: int, k1: int, like: Any) -> Any:
        """ALiBi's ``i + Sk - Sq - j`` for a block, (n*g, m) in ``like``'s dtype (each query's row repeated for the
        g heads of a group)."""
        import torch

        call = self.call
        i = torch.arange(q0 + call.seqlen_k - call.seqlen_q, q1 + call.seqlen_k - call.seqlen_q, device=like.device)
        dist = (i[:, None] - torch.arange(k0, k1, device=like.device)[None, :]).to(like.dtype)
        return dist.repeat_interleave(call.group_size, dim=0)


def block_scores(qb: Any, kb: Any, call: AttentionCall, band: Band, q0: int, q1: int, k0: int, k1: int,
                 need_mask: bool, careful: bool, terms: ScoreTerms, keep: Any = None,
                 grad: bool = False) -> tuple[Any, Any, Any, Any]:
    """Scores of a query block against a key block through the call's score pipeline (``ScoreTerms``), masked to -inf.

    qb: (B, Hkv, n*g, D) compute dtype, already multiplied by the softmax scale; kb: (B, Hkv, m, D); ``keep``: the
    block's mask_mod verdict (``ScoreTerms.keep``). Returns s (B, Hkv, n*g, m); with ``grad`` and softcap, d score / d
    scaled q.k (softcap's ``1 - tanh**2``) else None; where a term hid a key the band shows ((B, Hkv, n*g, m) bool)
    else None; and with ``grad`` and a score_mod, d score_mod / d score, else None.
    With ``careful`` (inputs that are not ``inputs_clean``) the forward's visible scores that are not finite become NaN,
    so that -inf means masked and nothing else and the NaN poisons its row through the max; with softcap the raw
    score decides, since tanh would map an inf to a finite +-1. (The backward's rows that see such a score are NaN
    through the forward's lse already.)
    """
    s = qb @ kb.transpose(-1, -2)
    dcap = hidden = dmod = None
    if terms.staged or careful:
        pipeline = terms.pipeline(grad, careful)
        slope = terms.slopes(q0, q1) if terms.alibi is not None else 0.0
        distance = terms.distance(q0, q1, k0, k1, s) if terms.alibi is not None else 0.0
        bias = terms.bias.block(q0, q1, k0, k1, s.dtype) if terms.bias is not None else 0.0
        extra = terms.mods.bias(q0, q1, k0, k1, s) if terms.mods is not None else None
        s, dcap, dmod, shown, finite = pipeline(
            s, 1.0 / call.softcap if call.softcap > 0 else 1.0, call.softcap, slope, distance, bias,
            0.0 if extra is None else extra, False if keep is None else ~keep, True, None, None, q0, k0, q1, k1)
        if careful and not grad and not isinstance(finite, bool):
            s.masked_fill_(~finite, float("nan"))
        if not isinstance(shown, bool):
            hidden = ~shown
            s.masked_fill_(hidden, float("-inf"))  # hidden, whatever the score was (a NaN there reaches nothing)
        dcap = dcap if grad and call.softcap > 0 else None
        dmod = dmod if grad and terms.score_mod else None
    if need_mask:
        b, h, rows, m = s.shape
        s.view(b, h, q1 - q0, rows // (q1 - q0), m).masked_fill_(
            ~band.visible(q0, q1, k0, k1, s.device), float("-inf"))
    return s, dcap, hidden, dmod



__all__ = ["ScoreTerms", "block_scores"]
