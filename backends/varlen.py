"""Packed sequences (layout "thd") on a backend without a packed kernel: the backend's dense kernels run once per
sequence, on views of the packed arrays.

The CUDA and ROCm backends serve a packed call this way, through ``forward`` and ``backward`` here (the CPU
backend's kernels take the sequences themselves and serve every sequence in one call per pass, see
``numba_flash.cpu.schedule``; its tests still run this path as the per-sequence yardstick). A backend converts
the packed inputs to its own arrays once, allocates the packed outputs once, and passes a ``run`` function with
the signature of its dense path. This module walks the sequences and calls ``run`` on ``(1, S_b, H, D)`` views of
sequence b's rows and keys (and ``(1, Hq, S_b)`` views of the lse) with a dense ``AttentionCall`` describing that
sequence alone. Nothing is padded to the longest sequence and nothing is copied per sequence: the work is the sum
of the sequences' own areas.

A sequence with no keys is never given to a kernel (a dense call needs Sk >= 1): its rows are set here to what the
contract says a row that sees nothing gets, out 0, lse +inf and dq 0. Keys of a sequence with no rows get dk = dv
= 0.

The cost is one kernel call per sequence: fine for a few long sequences, and dominated by per-call overhead for
many short ones (a kernel that iterates over (sequence, tile) itself removes it, as the CPU one does). The views
need only slicing, a leading axis of 1 and a fill, which numpy arrays and torch tensors have (``x[None]``,
``x[...] = value``); a backend whose arrays lack them passes its own ``lead_axis`` and ``fill``.
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


def forward(call: AttentionCall, run: Callable[..., None], q: Any, k: Any, v: Any, out: Any, lse: Any, *,
            lead_axis: Callable[[Any], Any] = _lead_axis, fill: Callable[[Any, float], None] = _fill) -> None:
    """Write the packed forward into ``out`` and ``lse``.

    q, out: (total_q, Hq, D); k, v: (total_k, Hkv, D); lse: (Hq, total_q); the backend's own arrays, in the dtypes
    its kernels take. ``run(seq_call, q, k, v, out, lse)`` is the backend's dense forward on (1, S, H, D) views and a
    (1, Hq, Sq) lse view, writing into the last two.
    """
    for seq in call.packing.sequences():
        if seq.seqlen_q == 0:
            continue
        rows = slice(seq.q0, seq.q1)
        if seq.seqlen_k == 0:
            fill(out[rows], 0.0)
            fill(lse[:, rows], math.inf)
            continue
        keys = slice(seq.k0, seq.k1)
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
    for seq in call.packing.sequences():
        rows, keys = slice(seq.q0, seq.q1), slice(seq.k0, seq.k1)
        if seq.seqlen_q == 0 or seq.seqlen_k == 0:
            # Nothing attends: rows without keys and keys without rows get no gradient.
            for grad, part in ((dq, rows), (dk, keys), (dv, keys)):
                if part.stop > part.start:
                    fill(grad[part], 0.0)
            continue
        views = dict(dout=dout[rows], q=q[rows], k=k[keys], v=v[keys], out=out[rows])
        views = {name: lead_axis(x) for name, x in views.items()}
        views["lse"] = lead_axis(lse[:, rows])
        run(sequence_call(call, seq, **views), views["dout"], views["q"], views["k"], views["v"], views["out"],
            views["lse"], lead_axis(dq[rows]), lead_axis(dk[keys]), lead_axis(dv[keys]))
