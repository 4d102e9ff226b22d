"""The first-use self-check under the Numba CUDA simulator, with deliberately broken kernels.

A broken kernel is made by wrapping a kernel factory of ``numba_flash.cuda.host.launch`` so that one specialisation
(tile config) launches the real kernel and then spoils its output slightly (scaled by 1.001) or raises; every other
specialisation is the real kernel. The check is switched on (it is off by default under the simulator), and the
fallback list is cut to one toy config (8x8/32) so that a fallback costs a second, not a production-size run.
Tiles are the toy 8x8/16 of the other simulator tests; sizes are odd.
Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_selfcheck_sim.py
"""

import numpy as np
import pytest
from selfcheck_cases import checked_runs, spoil
from selfcheck_cases import tiles as _tiles

from backends import backend_registry
from numba_flash import NoBackendError, attention_ref, attention_ref_backward
from numba_flash.cuda import TileOverride, tile_config_for, tile_config_override
from numba_flash.cuda.host import launch
from numba_flash.cuda import selfcheck
from numba_flash.cuda.selfcheck import Specialisation

pytestmark = pytest.mark.cudasim

TILES = dict(block_m=8, block_n=8, threads=16)
BROKEN = (8, 8, 16)
FALLBACK = (8, 8, 32)


@pytest.fixture
def runs(monkeypatch):
    """Check on, verdicts fresh, one toy fallback; ``runs`` lists the specialisations actually checked."""
    yield from checked_runs(monkeypatch, FALLBACK)


def _break(monkeypatch, factory_name, out_arg, broken=(BROKEN,), how="scale"):
    """Make ``launch.<factory_name>`` return, for configs whose tiles are in ``broken``, a kernel that runs the
    real one and then multiplies argument ``out_arg`` by 1.001 (``how="scale"``) or raises (``how="raise"``)."""
    spoil(monkeypatch, factory_name, out_arg, lambda cfg, kw: _tiles(cfg) in broken, how)


def _qkv(rng, sq=19, sk=23, hq=2, hkv=1, d=13):
    return (rng.standard_normal((1, sq, hq, d)).astype(np.float32),
            rng.standard_normal((1, sk, hkv, d)).astype(np.float32),
            rng.standard_normal((1, sk, hkv, d)).astype(np.float32))


def _forward(q, k, v, **kw):
    with tile_config_override(**TILES):
        return backend_registry.get("flash", backend="cuda").forward(q, k, v, return_lse=True, **kw)


def _explain(q, k, v, **kw):
    with tile_config_override(**TILES):
        return backend_registry.get("flash").explain(q, k, v, backend="cuda", **kw)


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_off_by_default_under_the_simulator(rng, runs, monkeypatch):
    monkeypatch.delenv(selfcheck.ENV_VAR)
    assert not selfcheck.enabled()
    q, k, v = _qkv(rng)
    _forward(q, k, v, causal=True)
    assert runs == []


def test_good_specialisation_passes_once_and_is_cached(rng, runs):
    q, k, v = _qkv(rng)
    for _ in range(2):
        out, _ = _forward(q, k, v, causal=True)
        ref, _ = attention_ref(q, k, v, causal=True)
        assert np.max(np.abs(out - ref)) <= 1e-5
    assert [(s.cfg.kernel, _tiles(s.cfg), s.dtype, s.has_right) for s in runs] == [
        ("forward", BROKEN, "float32", True)]
    (verdict,) = selfcheck.verdicts().values()
    assert verdict.passed and "out: max abs error" in verdict.detail
    text = _explain(q, k, v, causal=True)
    assert "cuda [priority 30]: can serve  <- chosen" in text and "self-check" not in text


def test_broken_forward_falls_back_and_explain_says_why(rng, runs, monkeypatch):
    _break(monkeypatch, "make_forward_kernel", out_arg=3)
    q, k, v = _qkv(rng)
    ref, ref_lse = attention_ref(q, k, v, causal=True)

    # With the check off the broken specialisation really serves the call, wrongly: what the check must catch.
    monkeypatch.setenv(selfcheck.ENV_VAR, "0")
    wrong, _ = _forward(q, k, v, causal=True)
    assert np.max(np.abs(wrong - ref)) > 1e-4
    monkeypatch.setenv(selfcheck.ENV_VAR, "1")

    out, lse = _forward(q, k, v, causal=True)
    assert np.max(np.abs(out - ref)) <= 1e-5
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-5)
    assert [_tiles(s.cfg) for s in runs] == [BROKEN, FALLBACK]

    text = _explain(q, k, v, causal=True)
    assert "self-check failed for forward 8x8/16 D=16 float32 causal: out: max abs error" in text
    assert "using 8x8/32 instead" in text and "<- chosen" in text

    out2, _ = _forward(q, k, v, causal=True)            # verdicts are kept: no second check
    assert np.max(np.abs(out2 - ref)) <= 1e-5
    assert len(runs) == 2
    # Another flag set is another specialisation, checked on its own first use.
    out3, _ = _forward(q, k, v, window_size=(5, -1))
    assert np.max(np.abs(out3 - attention_ref(q, k, v, window_size=(5, -1))[0])) <= 1e-5
    assert [(_tiles(s.cfg), s.has_left, s.has_right) for s in runs[2:]] == [(BROKEN, True, False),
                                                                             (FALLBACK, True, False)]


def test_exception_while_checking_is_a_failure(rng, runs, monkeypatch):
    _break(monkeypatch, "make_forward_kernel", out_arg=3, how="raise")
    q, k, v = _qkv(rng)
    out, _ = _forward(q, k, v, causal=True)
    assert np.max(np.abs(out - attention_ref(q, k, v, causal=True)[0])) <= 1e-5
    assert "raised RuntimeError: CUDA_ERROR_LAUNCH_FAILED (pretend)" in _explain(q, k, v, causal=True)


def test_nothing_passes_the_backend_declines(rng, runs, monkeypatch):
    _break(monkeypatch, "make_forward_kernel", out_arg=3, broken=(BROKEN, FALLBACK))
    q, k, v = _qkv(rng)
    for _ in range(2):
        with pytest.raises(NoBackendError, match="backend 'cuda' cannot serve") as info:
            _forward(q, k, v, causal=True)
        reasons = info.value.reasons["cuda"]
        assert len(reasons) == 2
        assert reasons[0].startswith("self-check failed for forward 8x8/16 D=16 float32 causal: out: max abs error")
        assert reasons[1].startswith("self-check failed for forward 8x8/32 D=16 float32 causal: out: max abs error")
    assert len(runs) == 2                                 # the second call was refused up front
    text = _explain(q, k, v, causal=True)
    assert "chosen: none" in text and "self-check failed for forward 8x8/16" in text
    # Only the refused kernel is refused: the backward kernels are other specialisations.
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = attention_ref(q, k, v, causal=True)
    with tile_config_override(**TILES):
        grads = backend_registry.get("flash", backend="cuda").backward(dout, q, k, v, out.astype(np.float32),
                                                                       lse.astype(np.float32), causal=True)
    for got, want in zip(grads, attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(got, want) <= 1e-5


def test_broken_backward_kernel_falls_back(rng, runs, monkeypatch):
    _break(monkeypatch, "make_dq_kernel", out_arg=6)
    q, k, v = _qkv(rng)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = _forward(q, k, v, causal=True)
    with tile_config_override(**TILES):
        grads = backend_registry.get("flash", backend="cuda").backward(dout, q, k, v, out, lse, causal=True)
    for got, want in zip(grads, attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(got, want) <= 1e-5
    checked = [(s.cfg.kernel, _tiles(s.cfg)) for s in runs]
    assert checked == [("forward", BROKEN), ("backward_dkdv", BROKEN), ("backward_dq", BROKEN),
                       ("backward_dq", FALLBACK)]
    failed = [v for v in selfcheck.verdicts().values() if not v.passed]
    assert len(failed) == 1 and failed[0].detail.startswith("dq: relative L2 error")
    # explain() takes a forward call but notes the backward kernel it would use later.
    assert "self-check failed for backward_dq 8x8/16 D=16 float32 causal: dq: relative L2 error" in _explain(
        q, k, v, causal=True)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_check_copies_the_calls_contiguity(rng, runs, monkeypatch, layout):
    # numba compiles one variant per array contiguity; the check must run the variant the call runs.
    seen = []
    real = launch.launch_forward

    def spy(cfg, q, *args, **kw):
        seen.append(q.is_c_contiguous())
        return real(cfg, q, *args, **kw)

    monkeypatch.setattr(launch, "launch_forward", spy)
    q, k, v = _qkv(rng)
    if layout == "bhsd":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    out, _ = _forward(q, k, v, layout=layout)
    assert np.max(np.abs(out - attention_ref(q, k, v, layout=layout)[0])) <= 1e-5
    assert seen == [layout == "bshd"] * 2                 # the check's launch, then the call's


_KERNELS = ["forward", "backward_dkdv", "backward_dq"]


@pytest.mark.parametrize("dtype,flags", [("float32", (False, False, False, False, False, False)),
                                         ("float16", (True, True, True, True, True, True)),
                                         ("bfloat16", (False, True, False, True, False, True))])
@pytest.mark.parametrize("kernel", _KERNELS)
def test_good_kernels_pass_in_every_dtype(runs, kernel, dtype, flags):
    # A false failure would throw a good kernel away on a GPU: the real kernels must pass with a margin.
    # flags: has_left, has_right, softcap, alibi, attn_bias, dropout.
    spec = Specialisation(tile_config_for(16, dtype, kernel=kernel, override=TileOverride(**TILES)),
                          *flags[:3], dtype, alibi=flags[3], bias=flags[4], dropout=flags[5])
    verdict = selfcheck.check(spec)
    assert verdict.passed, verdict.reason
    for part in verdict.detail.split("; "):
        err, bound = (float(x) for x in part.split(" error ")[1].split(" <= "))
        assert err <= bound / 4, verdict.reason


@pytest.mark.slow
@pytest.mark.parametrize("kernel,dtype", [("forward", "float16"), ("backward_dkdv", "float32"),
                                          ("backward_dq", "bfloat16")])
def test_production_configs_pass(runs, kernel, dtype):
    # The picker's own D = 64 configs (64 or 128 threads), as a GPU would check them first; about 5-10 s each here.
    cfg = tile_config_for(64, dtype, kernel=kernel)
    assert cfg.threads >= 64
    verdict = selfcheck.check(Specialisation(cfg, False, True, False, dtype))
    assert verdict.passed, verdict.reason
