"""The self-check's bookkeeping in the normal process (no GPU, no simulator): switch, fallback order, verdict
cache, thread safety, and the numeric helpers the checks judge with.

No kernel runs here. Where a check would run, ``selfcheck._run`` is replaced by a fake that returns a verdict the
test chooses (and counts its calls), and ``selfcheck.current_device`` by a function returning device 0; the real
checks run under the simulator in test_selfcheck_sim.py.
"""

import threading
import time

import numpy as np
import pytest

from numba_flash import attention_ref
from numba_flash.cuda import selfcheck
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.selfcheck import problem
from numba_flash.cuda.selfcheck import SelfCheckFailed, Specialisation, Verdict
from numba_flash.errors import BackendDeclined

FLAGS = (False, True, False)   # causal, no left window, no softcap


@pytest.fixture
def fake_runs(monkeypatch):
    """Replace the check with a fake: ``fake_runs.bad`` holds the (block_m, block_n, threads) that fail; every run
    is recorded in ``fake_runs.calls``."""

    class Runs:
        bad: set = set()
        calls: list = []

    runs = Runs()
    runs.bad, runs.calls = set(), []

    def fake(spec, like):
        runs.calls.append(spec)
        tiles = (spec.cfg.block_m, spec.cfg.block_n, spec.cfg.threads)
        if tiles in runs.bad:
            return Verdict(spec, False, "out: max abs error 0.31 > 1e-05")
        return Verdict(spec, True, "out: max abs error 1e-07 <= 1e-05")

    monkeypatch.setenv(selfcheck.ENV_VAR, "1")
    monkeypatch.setattr(selfcheck, "_run", fake)
    monkeypatch.setattr(selfcheck, "current_device", lambda: 0)
    selfcheck.reset()
    yield runs
    selfcheck.reset()


def _cfg(kernel="forward", bm=64, bn=32, nt=128, bucket=64):
    return FlashAttentionConfig(kernel, bm, bn, nt, bucket)


@pytest.mark.parametrize("value,want", [("1", True), ("0", False), ("on", True), ("OFF", False), ("", True)])
def test_switch(monkeypatch, value, want):
    # Unset or empty means "on" on a real GPU, i.e. in any process that is not the simulator.
    monkeypatch.setenv(selfcheck.ENV_VAR, value)
    assert selfcheck.enabled() is want


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(selfcheck.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="NUMBA_FLASH_SELFCHECK: expected 0 or 1, got 'sometimes'"):
        selfcheck.enabled()


def test_describe():
    spec = Specialisation(_cfg(), False, True, False, "float16")
    assert spec.describe() == "forward 64x32/128 D=64 float16 causal"
    spec = Specialisation(_cfg("backward_dq", 32, 16, 128, 128), True, True, True, "bfloat16")
    assert spec.describe() == "backward_dq 32x16/128 D=128 bfloat16 window softcap"
    failed = Verdict(Specialisation(_cfg(), False, True, False, "float16"), False, "out: max abs error 0.31 > 1e-05")
    assert failed.reason == "self-check failed for forward 64x32/128 D=64 float16 causal: out: max abs error 0.31 > 1e-05"


@pytest.mark.parametrize("kernel", ["forward", "backward_dkdv", "backward_dq"])
@pytest.mark.parametrize("bucket", [16, 64, 256])
def test_candidates_are_valid_distinct_and_start_with_the_pick(kernel, bucket):
    from numba_flash.cuda.host.picker import tile_config_for

    picked = tile_config_for(bucket, kernel=kernel)
    found = selfcheck.candidates(picked)
    assert found[0] == picked
    assert len(found) == len(set(found)) >= 2           # at least one fallback for every bucket
    assert all(c.kernel == kernel and c.head_dim_bucket == bucket and not c.problems() for c in found)


def test_candidates_skip_fallbacks_too_big_for_the_bucket():
    # The forward's first fallback, 32x16/128, needs more than 48 KiB at D = 256.
    assert FlashAttentionConfig("forward", 32, 16, 128, 256).problems()
    tiles = [(c.block_m, c.block_n, c.threads) for c in selfcheck.candidates(_cfg(bm=32, bn=8, bucket=256))]
    assert (32, 16, 128) not in tiles and tiles[0] == (32, 8, 128)


def test_good_pick_is_checked_once(fake_runs):
    cfg = _cfg()
    assert selfcheck.choose(cfg, *FLAGS, "float32") == cfg
    assert selfcheck.choose(cfg, *FLAGS, "float32") == cfg
    assert len(fake_runs.calls) == 1
    assert selfcheck.problems([cfg], *FLAGS, "float32") == ([], [])
    # Another dtype, flag set or device is another specialisation.
    selfcheck.choose(cfg, *FLAGS, "float16")
    selfcheck.choose(cfg, True, True, False, "float32")
    selfcheck.check(Specialisation(cfg, *FLAGS, "float32"), device=1)
    assert len(fake_runs.calls) == 4


def test_failed_pick_falls_back_and_is_noted(fake_runs):
    cfg = _cfg()
    fake_runs.bad = {(64, 32, 128)}
    got = selfcheck.choose(cfg, *FLAGS, "float16")
    assert (got.block_m, got.block_n, got.threads) == selfcheck.FALLBACK_TILES[0]
    assert got.kernel == "forward" and got.head_dim_bucket == 64
    assert len(fake_runs.calls) == 2
    assert selfcheck.choose(cfg, *FLAGS, "float16") == got
    assert len(fake_runs.calls) == 2                    # both verdicts are remembered
    notes, reasons = selfcheck.problems([cfg], *FLAGS, "float16")
    assert reasons == []
    assert notes == ["self-check failed for forward 64x32/128 D=64 float16 causal: out: max abs error 0.31 > 1e-05; "
                     "using 32x16/128 instead"]
    assert selfcheck.problems([cfg], *FLAGS, "float16", device=1) == ([], [])   # nothing known about GPU 1


def test_failure_with_unchecked_fallback_is_noted_not_refused(fake_runs):
    cfg = _cfg()
    fake_runs.bad = {(64, 32, 128)}
    assert not selfcheck.check(Specialisation(cfg, *FLAGS, "float32")).passed
    notes, reasons = selfcheck.problems([cfg], *FLAGS, "float32")
    assert reasons == [] and len(notes) == 1
    assert notes[0].startswith("self-check failed for forward 64x32/128 D=64 float32 causal: ")
    assert notes[0].endswith("; 32x16/128 not checked yet")


def test_nothing_passes_raises_with_every_failure(fake_runs):
    cfg = _cfg()
    fake_runs.bad = {(64, 32, 128)} | set(selfcheck.FALLBACK_TILES)
    with pytest.raises(SelfCheckFailed) as info:
        selfcheck.choose(cfg, *FLAGS, "float32")
    assert isinstance(info.value, BackendDeclined)
    tried = ["64x32/128"] + [f"{m}x{n}/{t}" for m, n, t in selfcheck.FALLBACK_TILES]
    assert len(info.value.reasons) == len(tried)
    for reason, tiles in zip(info.value.reasons, tried):
        assert reason.startswith(f"self-check failed for forward {tiles} D=64 float32 causal: ")
    notes, reasons = selfcheck.problems([cfg], *FLAGS, "float32")
    assert notes == [] and reasons == info.value.reasons
    with pytest.raises(SelfCheckFailed):
        selfcheck.choose(cfg, *FLAGS, "float32")
    assert len(fake_runs.calls) == len(tried)            # the refusal is remembered, not re-checked


def test_switched_off_checks_and_refuses_nothing(fake_runs, monkeypatch):
    cfg = _cfg()
    fake_runs.bad = {(64, 32, 128)} | set(selfcheck.FALLBACK_TILES)
    with pytest.raises(SelfCheckFailed):
        selfcheck.choose(cfg, *FLAGS, "float32")
    runs = len(fake_runs.calls)
    monkeypatch.setenv(selfcheck.ENV_VAR, "0")
    assert selfcheck.choose(cfg, *FLAGS, "float32") == cfg
    assert selfcheck.choose(_cfg(bm=32), *FLAGS, "float32").block_m == 32
    assert len(fake_runs.calls) == runs
    assert selfcheck.problems([cfg], *FLAGS, "float32") == ([], [])


def test_exception_in_a_check_is_a_failure(monkeypatch):
    def boom(spec, like):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS\n  while launching")

    monkeypatch.setitem(selfcheck._CHECKS, "forward", boom)
    verdict = selfcheck._run(Specialisation(_cfg(), *FLAGS, "float32"), {})
    assert not verdict.passed
    assert verdict.detail == "raised RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS while launching"


def test_racing_threads_run_one_check_and_never_see_half_of_it(fake_runs, monkeypatch):
    started, release = threading.Event(), threading.Event()
    real_fake = selfcheck._run

    def slow(spec, like):
        started.set()
        assert release.wait(10)
        return real_fake(spec, like)

    monkeypatch.setattr(selfcheck, "_run", slow)
    spec = Specialisation(_cfg(), *FLAGS, "float32")
    results, barrier = [], threading.Barrier(8)

    def call():
        barrier.wait()
        results.append(selfcheck.check(spec))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    assert started.wait(10)
    time.sleep(0.2)
    assert results == []                 # the others wait for the running check, they do not see "no verdict"
    assert selfcheck.verdicts() == {}     # nor is a verdict stored before the check ends
    release.set()
    for t in threads:
        t.join(10)
    assert len(fake_runs.calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results) and results[0].passed


def test_different_specialisations_check_in_parallel(fake_runs, monkeypatch):
    # The lock is per specialisation: a check of A that waits for B's check to start would hang if checks were
    # serialised behind one lock. Waits are bounded, so a regression fails instead of hanging.
    b_started = threading.Event()
    real_fake = selfcheck._run

    def run(spec, like):
        if spec.dtype == "float32":
            assert b_started.wait(10), "check of B never started while A's was running"
        else:
            b_started.set()
        return real_fake(spec, like)

    monkeypatch.setattr(selfcheck, "_run", run)
    a, b = (Specialisation(_cfg(), *FLAGS, dt) for dt in ("float32", "float16"))
    t = threading.Thread(target=selfcheck.check, args=(a,))
    t.start()
    assert selfcheck.check(b).passed
    t.join(15)
    assert selfcheck.verdicts()[(0, a)].passed


# ---- the numeric helpers (no kernels) ----

def test_bfloat16_storage_rounds_like_torch(rng):
    torch = pytest.importorskip("torch")
    x = (rng.standard_normal(2000) * np.exp2(rng.integers(-20, 20, 2000))).astype(np.float32)
    bits = problem.to_storage(x, "bfloat16")
    assert bits.dtype == np.int16
    assert np.array_equal(bits, torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy())
    assert np.array_equal(problem.widen(bits, "bfloat16"), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_max_abs_catches_unwritten_elements():
    ref = np.array([[1.0, 2.0], [np.inf, 3.0]])
    assert problem.max_abs(ref + 1e-3, ref) == pytest.approx(1e-3)
    for bad in ([[np.nan, 2.0], [np.inf, 3.0]], [[1.0, 2.0], [5.0, 3.0]], [[1.0, 2.0], [-np.inf, 3.0]]):
        assert problem.max_abs(np.array(bad), ref) == np.inf
    assert problem.rel_l2(np.array([1.0, np.nan]), np.array([1.0, 1.0])) == np.inf


@pytest.mark.parametrize("flags", [(False, True, False), (True, False, True), (True, True, False)])
def test_textbook_float32_is_close_but_not_exact(flags):
    # The bound of a float32 kernel is 4x this error: it must be float32-sized, not 0 and not large.
    p = problem.draw_problem(Specialisation(_cfg(bm=8, bn=8, nt=16, bucket=32), *flags, "float32"))
    ref_out, ref_lse = attention_ref(p.q, p.k, p.v, softmax_scale=p.scale, window_size=p.window_size,
                                     softcap=p.softcap)
    out, lse = problem.textbook_float32(p)
    assert 0 < problem.max_abs(out, ref_out) < 1e-5
    assert problem.max_abs(lse, ref_lse) < 1e-5


def test_problem_sizes_are_odd_and_span_tiles():
    p = problem.draw_problem(Specialisation(_cfg(bm=64, bn=32), True, True, True, "float16"))
    assert p.q.shape == (1, 67, 2, 63) and p.k.shape == (1, 69, 1, 63)   # 2 query tiles, 3 key tiles, ragged
    assert p.stored["q"].dtype == np.float16 and np.array_equal(p.stored["q"].astype(np.float32), p.q)
    assert p.window_left == 35 and p.window_right == 0 and p.softcap > 0
    assert 0.5 < p.q.std() < 1.5                                            # random N(0, 1), not constants


# ---- the check's own small grids do not warn the user ----

def _occupancy_warnings():
    from numba.core import config

    return getattr(config, "CUDA_LOW_OCCUPANCY_WARNINGS", None)


def test_low_occupancy_warning_is_off_while_a_check_runs_and_back_after(monkeypatch):
    # Seen on an H200: the check's 4-block launch made numba-cuda print "Grid size 4 will likely result in GPU
    # under-utilization" at a user's first call.
    seen = []

    def spy(spec, like):
        seen.append(_occupancy_warnings())
        return [], ["out: max abs error 1e-07 <= 1e-05"]

    monkeypatch.setitem(selfcheck._CHECKS, "forward", spy)
    before = _occupancy_warnings()
    if before is None:
        pytest.skip("numba-cuda is not installed: numba has no CUDA_LOW_OCCUPANCY_WARNINGS")
    assert before    # numba-cuda's default: on
    verdict = selfcheck._run(Specialisation(_cfg(), *FLAGS, "float32"), {})
    assert verdict.passed and seen == [0]
    assert _occupancy_warnings() == before


def test_low_occupancy_warning_comes_back_when_checks_on_two_threads_overlap(monkeypatch):
    inside, release = threading.Barrier(2), threading.Event()

    def slow(spec, like):
        inside.wait(timeout=10)        # both checks are running at once here
        release.wait(timeout=10)
        return [], ["ok"]

    monkeypatch.setitem(selfcheck._CHECKS, "forward", slow)
    before = _occupancy_warnings()
    specs = [Specialisation(_cfg(bm=bm), *FLAGS, "float32") for bm in (64, 32)]
    threads = [threading.Thread(target=selfcheck._run, args=(s, {})) for s in specs]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert _occupancy_warnings() == 0
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert _occupancy_warnings() == before


def test_low_occupancy_warning_comes_back_when_a_check_raises(monkeypatch):
    def boom(spec, like):
        raise RuntimeError("compile failed")

    monkeypatch.setitem(selfcheck._CHECKS, "forward", boom)
    before = _occupancy_warnings()
    verdict = selfcheck._run(Specialisation(_cfg(), *FLAGS, "float32"), {})
    assert not verdict.passed and "compile failed" in verdict.detail
    assert _occupancy_warnings() == before
