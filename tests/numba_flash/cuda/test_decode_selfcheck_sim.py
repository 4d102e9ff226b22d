"""The decode kernel's first-use self-check (numba_flash/cuda/selfcheck/decode_check.py) under the Numba CUDA simulator: good
specialisations pass with a margin, a broken one is replaced by a fallback config, and when none passes the call
is refused before the append, so the cache is left as it was. Broken kernels as in test_selfcheck_sim.py: the
real kernel, then its partial outputs scaled by 1.001.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_decode_selfcheck_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from kvcache_cases import copy_args, random_case
from selfcheck_cases import checked_runs, spoil
from selfcheck_cases import tiles as _tiles

from backends import backend_registry
from numba_flash import NoBackendError, attention_ref_kvcache
from numba_flash.cuda import TileOverride, tile_config_for, tile_config_override
from numba_flash.cuda import selfcheck
from numba_flash.cuda.selfcheck import Specialisation

pytestmark = [pytest.mark.cudasim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

TILES = dict(block_m=4, block_n=8, threads=16)
BROKEN = (4, 8, 16)
FALLBACK = (8, 8, 32)


@pytest.fixture
def runs(monkeypatch):
    """Check on, verdicts fresh, one toy fallback; ``runs`` lists the specialisations actually checked."""
    yield from checked_runs(monkeypatch, FALLBACK)


def _break(monkeypatch, broken):
    """The decode kernel's factory (``make_decode_kernel``) returns, for configs whose tiles are in ``broken``, the
    real kernel followed by its part_out (argument 5) scaled by 1.001."""
    spoil(monkeypatch, "make_decode_kernel", 5, lambda cfg, kw: _tiles(cfg) in broken)


@pytest.mark.parametrize("dtype,flags", [("float32", (False, False, False, False)),
                                         ("float32", (True, True, True, True)),
                                         ("float16", (False, True, True, False)),
                                         ("bfloat16", (True, False, False, True))])
def test_good_decode_kernels_pass_with_a_margin(runs, dtype, flags):
    # flags: has_left, has_right, softcap, alibi. A false failure would throw a good kernel away on a GPU.
    cfg = tile_config_for(16, dtype, kernel="decode", override=TileOverride(**TILES))
    verdict = selfcheck.check(Specialisation(cfg, *flags[:3], dtype, alibi=flags[3]))
    assert verdict.passed, verdict.reason
    parts = verdict.detail.split("; ")
    assert [p.split(":")[0] for p in parts] == ["dense out", "dense lse", "paged out", "paged lse"]
    for part in parts:
        err, bound = (float(x) for x in part.split(" error ")[1].split(" <= "))
        assert err <= bound / 4, verdict.reason


def _call(rng):
    args = random_case(rng, batch=3, sq=2, hq=4, hkv=2, d=7, capacity=19, s_new=2, paged=True, page=4)
    return args, attention_ref_kvcache(**args, causal=True)


def test_broken_decode_kernel_falls_back(rng, runs, monkeypatch):
    _break(monkeypatch, (BROKEN,))
    args, (want_out, _, want_k, _) = _call(rng)
    given = copy_args(args)
    with tile_config_override(**TILES):
        out = backend_registry.get("flash", backend="cuda").with_kvcache(**given, causal=True, num_splits=3)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(given["k_cache"], want_k, atol=2e-6, rtol=0)
    assert [(s.cfg.kernel, _tiles(s.cfg), s.has_right) for s in runs] == [("decode", BROKEN, True),
                                                                          ("decode", FALLBACK, True)]
    (failed,) = [v for v in selfcheck.verdicts().values() if not v.passed]
    assert failed.detail.startswith("dense out: max abs error")


def test_nothing_passes_the_call_is_refused_and_the_cache_untouched(rng, runs, monkeypatch):
    _break(monkeypatch, (BROKEN, FALLBACK))
    args, _ = _call(rng)
    for _ in range(2):
        given = copy_args(args)
        with tile_config_override(**TILES), pytest.raises(NoBackendError, match="backend 'cuda' cannot serve") as info:
            backend_registry.get("flash", backend="cuda").with_kvcache(**given, causal=True)
        reasons = info.value.reasons["cuda"]
        assert [r.split(":")[0] for r in reasons] == ["self-check failed for decode 4x8/16 D=16 float32 causal",
                                                      "self-check failed for decode 8x8/32 D=16 float32 causal"]
        for name in ("k_cache", "v_cache"):
            np.testing.assert_array_equal(given[name], args[name])   # refused before the append
    assert len(runs) == 2                                           # the second call was refused up front
