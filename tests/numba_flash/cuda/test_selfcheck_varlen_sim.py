"""The first-use self-check of the kernels built for packed sequences in one launch (``varlen``), under the
simulator: a packed call checks its own specialisations (not only the dense ones of the same tiles), a kernel broken
only in its packed build falls back, and one that ignores its sequence's offsets (so it reads the NaN rows and keys
the check puts ahead of its problem) is refused. Toy tiles (8x8/16) and one toy fallback, as test_selfcheck_sim.py.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

import numpy as np
import pytest
from selfcheck_cases import checked_runs, spoil
from selfcheck_cases import tiles as _tiles
from varlen_cases import packed_inputs, reference, rel_l2

from backends import backend_registry
from numba_flash import NoBackendError
from numba_flash.cuda import tile_config_override
from numba_flash.cuda import selfcheck

pytestmark = pytest.mark.cudasim

TILES = dict(block_m=8, block_n=8, threads=16)
FALLBACK = (8, 8, 32)
LENS_Q, LENS_K = [7, 0, 12], [9, 3, 10]


@pytest.fixture
def runs(monkeypatch):
    """Check on, verdicts fresh, one toy fallback; ``runs`` lists the specialisations checked."""
    yield from checked_runs(monkeypatch, FALLBACK)


def _packed_call(rng, backward=False):
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, LENS_Q, LENS_K, 2, 1, 6)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    with tile_config_override(**TILES):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        grads = op.backward(dout, q, k, v, out, lse, **kw) if backward else ()
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))), reference(q, k, v, dout, cu_q, cu_k,
                                                                                       causal=True)


def test_a_packed_call_checks_its_own_specialisations(rng, runs):
    got, ref = _packed_call(rng, backward=True)
    assert [(s.cfg.kernel, s.varlen) for s in runs] == [("forward", True), ("backward_dkdv", True),
                                                        ("backward_dq", True)]
    assert all(v.passed for v in selfcheck.verdicts().values())
    assert " packed" in next(iter(selfcheck.verdicts().values())).reason
    for name in ("dq", "dk", "dv"):
        assert rel_l2(got[name], ref[name]) <= 1e-5, name


def test_a_kernel_broken_only_when_packed_falls_back(rng, runs, monkeypatch):
    spoil(monkeypatch, "make_forward_kernel", 3, lambda cfg, kw: kw.get("varlen") and _tiles(cfg) == (8, 8, 16))
    got, ref = _packed_call(rng)
    assert np.abs(got["out"] - ref["out"]).max() <= 1e-5
    assert [(_tiles(s.cfg), s.varlen) for s in runs] == [((8, 8, 16), True), (FALLBACK, True)]
    failed = [v for v in selfcheck.verdicts().values() if not v.passed]
    assert len(failed) == 1 and "forward 8x8/16 D=16 float32 causal packed: out: max abs error" in failed[0].reason


def test_a_kernel_that_ignores_its_sequence_offsets_is_refused(rng, runs, monkeypatch):
    """Every config's packed forward reads its sequence from row 0 and key 0: the check's problem sits behind NaN
    rows and keys, so every candidate fails and the forced backend declines instead of answering wrongly."""
    from numba import cuda

    from numba_flash.cuda.kernels import forward
    from numba_flash.cuda.device import sequences

    real_locate = sequences.make_locate(True)

    @cuda.jit(device=True, inline="always")
    def from_the_start(seqs, seqlen_q, seqlen_k):
        b, ab, tile, q0, k0, sq, sk = real_locate(seqs, seqlen_q, seqlen_k)
        return b, ab, tile, q0 * 0, k0 * 0, sq, sk

    monkeypatch.setattr(forward, "make_locate", lambda varlen: from_the_start if varlen else
                        sequences.make_locate(False))
    forward.make_forward_kernel.cache_clear()
    try:
        with pytest.raises(NoBackendError, match="self-check failed for forward 8x8/16 D=16 float32 causal packed"):
            _packed_call(rng)
    finally:
        forward.make_forward_kernel.cache_clear()
    assert [(_tiles(s.cfg), s.varlen) for s in runs] == [((8, 8, 16), True), (FALLBACK, True)]
