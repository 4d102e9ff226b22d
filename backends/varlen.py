"""Packed sequences (layout "thd") on any backend: the per-sequence driver, and the single-call one.

Per sequence (``forward``, ``backward``): the ROCm backend serves a packed call this way (and the CPU backend's
tests use it as the per-sequence yardstick). A backend converts the packed inputs to its own arrays once,
allocates the packed outputs once, and passes a ``run`` function with the signature of its dense path. This module
walks the sequences and calls ``run`` on ``(1, S_b, H, D)`` views of sequence b's rows and keys (and ``(1, Hq,
S_b)`` views of the lse) with a dense ``AttentionCall`` describing that sequence alone. Nothing is padded to the
longest sequence and nothing is copied per sequence: the work is the sum of the sequences' own areas.

A sequence with no keys is never given to a kernel (a dense call needs Sk >= 1): its rows are set here to what the
contract says a row that sees nothing gets, out 0, lse +inf and dq 0. Keys of a sequence with no rows get dk = dv
= 0.

That costs one kernel call per sequence: fine for a few long sequences, and dominated by per-call overhead for
many short ones. Kernels that iterate over (sequence, tile) themselves remove it. The CPU backend's take the
sequences themselves (``numba_flash.cpu.schedule``). The CUDA backend uses ``forward_once`` and ``backward_once``:
``run`` is then called once, on the whole packed arrays viewed as a batch of one, with the packed call
(``packed_call``: layout "thd", its ``packing`` saying where each sequence lies), and the sequences with no rows or
no keys are filled here as above, so that the kernels only see sequences with both. The views need only slicing,
a leading axis of 1 and a fill, which numpy arrays and torch tensors have (``x[None]``, ``x[...] = value``); a
backend whose arrays lack them passes its own ``lead_axis`` and ``fill``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from numba_flash.semantics import clamp_window_bound
from numba_flash.validation import AttentionCall
from numba_flash.varlen import SequenceSpan


def _lead_axis(x: Any) -> Any:
    return x[None]


def _fill(x: Any, value: float) -> None:
    x[...] = value


def sequence_call(call: AttentionCall, seq: SequenceSpan, **arrays: Any) -> AttentionCall:
    """The dense ``AttentionCall`` ("bshd", B = 1) of sequence ``seq`` of the packed ``call``, holding ``arrays``
    (the views ``run`` gets) in place of the packed ones. The window bounds are capped for this sequence's own
    lengths, as validation caps those of a dense call, so that kernels never see bounds beyond Sq + Sk. ALiBi
    slopes are this sequence's row; its distances count from the sequence's own bottom-right corner. Dropout keys
    the sequence's mask by its index (``dropout_batch0``), with rows and keys counted within the sequence."""
    sq, sk = seq.seqlen_q, seq.seqlen_k
    fields = dict(layout="bshd", batch=1, seqlen_q=sq, seqlen_k=sk, packing=None, dropout_batch0=seq.index,
                  window_left=clamp_window_bound(call.window_left, sq, sk),
                  window_right=clamp_window_bound(call.window_right, sq, sk))
    if call.alibi is not None:
        fields["alibi"] = call.alibi[seq.index:seq.index + 1]  # this sequence's slopes, (1, Hq)
    return dataclasses.replace(call, **fields, **arrays)


def packed_call(call: AttentionCall) -> AttentionCall:
    """The packed ``call`` as one launch over every sequence takes it: the window bounds capped for the longest
    sequences (each sequence's own cap is at most that, so every sequence keeps its mask), dropout's first batch 0
    (the sequence index is the batch)."""
    p = call.packing
    return dataclasses.replace(call, dropout_batch0=0,
                               window_left=clamp_window_bound(call.window_left, p.max_seqlen_q, p.max_seqlen_k),
                               window_right=clamp_window_bound(call.window_right, p.max_seqlen_q, p.max_seqlen_k))


def _fill_keyless_rows(call: AttentionCall, out: Any, lse: Any, fill: Callable[[Any, float], None]) -> None:
    """Rows of sequences with no keys see nothing: out 0, lse +inf."""
    for seq in call.packing.sequences():
        if seq.seqlen_q > 0 and seq.seqlen_k == 0:
            fill(out[seq.q0:seq.q1], 0.0)
            fill(lse[:, seq.q0:seq.q1], math.inf)


def _fill_unattended(call: AttentionCall, dq: Any, dk: Any, dv: Any, fill: Callable[[Any, float], None]) -> None:
    """Rows without keys and keys without rows get no gradient."""
    for seq in call.packing.sequences():
        if seq.seqlen_q == 0 or seq.seqlen_k == 0:
            for grad, part in ((dq, slice(seq.q0, seq.q1)), (dk, slice(seq.k0, seq.k1)), (dv, slice(seq.k0, seq.k1))):
                if part.stop > part.start:
                    fill(grad[part], 0.0)


def forward_once(call: AttentionCall, run: Callable[..., None], q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                 lead_axis: Callable[[Any], Any] = _lead_axis, fill: Callable[[Any, float], None] = _fill) -> None:
    """``forward``'s work in one ``run(packed_call(call), q, k, v, out, lse)`` on the packed arrays as a batch of
    one (lse (1, Hq, total_q)), for kernels that walk the sequences themselves."""
    _fill_keyless_rows(call, out, lse, fill)
    run(packed_call(call), *(lead_axis(x) for x in (q, k, v, out, lse)))


def backward_once(call: AttentionCall, run: Callable[..., None], dout: Any, q: Any, k: Any, v: Any, out: Any,
                  lse: Any, dq: Any, dk: Any, dv: Any, *, lead_axis: Callable[[Any], Any] = _lead_axis,
                  fill: Callable[[Any, float], None] = _fill) -> None:
    """``backward``'s work in one ``run`` on the packed arrays as a batch of one, as ``forward_once``."""
    _fill_unattended(call, dq, dk, dv, fill)
    run(packed_call(call), *(lead_axis(x) for x in (dout, q, k, v, out, lse, dq, dk, dv)))


def forward(call: AttentionCall, run: Callable[..., None], q: Any, k: Any, v: Any, out: Any, lse: Any, *,
            lead_axis: Callable[[Any], Any] = _lead_axis, fill: Callable[[Any, float], None] = _fill) -> None:
    """Write the packed forward into ``out`` and ``lse``.

    q, out: (total_q, Hq, D); k, v: (total_k, Hkv, D); lse: (Hq, total_q); the backend's own arrays, in the dtypes
    its kernels take. ``run(seq_call, q, k, v, out, lse)`` is the backend's dense forward on (1, S, H, D) views and a
    (1, Hq, Sq) lse view, writing into the last two.
    """
    _fill_keyless_rows(call, out, lse, fill)
    for seq in call.packing.sequences():
        if seq.seqlen_q == 0 or seq.seqlen_k == 0:
            continue
        rows, keys = slice(seq.q0, seq.q1), slice(seq.k0, seq.k1)
        q_b, k_b, v_b = lead_axis(q[rows]), lead_axis(k[keys]), lead_axis(v[keys])
        run(sequence_call(call, seq, q=q_b, k=k_b, v=v_b), q_b, k_b, v_b, lead_axis(out[rows]),
            lead_axis(lse[:, rows]))


def backward(call: AttentionCall, run: Callable[..., None], dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
             dq: Any, dk: Any, dv: Any, *, lead_axis: Callable[[Any], Any] = _lead_axis,
             fill: Callable[[Any, float], None] = _fill) -> None:
    """Write the packed backward into ``dq``, ``dk`` and ``dv``.

    dout, q, out, dq: (total_q, Hq, D); k, v, dk, dv: (total_k, Hkv, D); lse: (Hq, total_q), as the forward wrote
    it; the backend's own arrays. ``run(seq_call, dout, q, k, v, out, lse, dq, dk, dv)`` is the backend's dense
    backward on views of one sequence, writing into the last three.
    """
    _fill_unattended(call, dq, dk, dv, fill)
    for seq in call.packing.sequences():
        if seq.seqlen_q == 0 or seq.seqlen_k == 0:
            continue
        rows, keys = slice(seq.q0, seq.q1), slice(seq.k0, seq.k1)
        views = dict(dout=dout[rows], q=q[rows], k=k[keys], v=v[keys], out=out[rows])
        views = {name: lead_axis(x) for name, x in views.items()}
        views["lse"] = lead_axis(lse[:, rows])
        run(sequence_call(call, seq, **views), views["dout"], views["q"], views["k"], views["v"], views["out"],
            views["lse"], lead_axis(dq[rows]), lead_axis(dk[keys]), lead_axis(dv[keys]))
