"""What a new user meets first: a misspelt backend refused where it is named, a bench that refuses a backend this
machine cannot run before timing anything, and float64 benched where the backends run it (issue 47, finding 7)."""

from __future__ import annotations

import pytest

from numba_flash import AttentionInputError, backend_registry
from numba_flash.bench import runners as bench_runners


def test_get_refuses_an_unknown_backend_at_once():
    with pytest.raises(AttentionInputError) as info:
        backend_registry.get("flash", backend="gpu")
    message = str(info.value)
    assert message.startswith("backend: expected one of the registered backends")
    assert all(name in message for name in backend_registry.names("flash")), message
    assert "got 'gpu'" in message
    with pytest.raises(AttentionInputError, match="did you mean 'cpu'"):
        backend_registry.get("flash", backend="cpus")
    backend_registry.get("flash", backend="cpu")   # a registered name still works, available or not
    backend_registry.get("flash")


def _never_called(*args, **kwargs):
    raise AssertionError("a runner was timed before the unavailable backend was refused")


def test_a_named_backend_that_cannot_run_is_refused_before_any_work(monkeypatch, capsys):
    """On a machine without a GPU, ``--backend cuda`` used to time the peers first and exit 3 at the end."""
    from numba_flash.bench import cli
    from numba_flash.cli import bench_main

    be = next(b for b in backend_registry.backends("flash") if b.name == "cuda")
    if not be.unavailable_reasons(forced=True):
        pytest.skip("this machine can run the cuda backend")
    monkeypatch.setattr(cli, "execute", _never_called)
    code = bench_main(["--config", "tiny", "--backend", "cuda", "--no-grad", "--repeats", "1"])
    assert code == cli.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "cuda named with --backend cannot run" in err and "nothing was run" in err, err


def test_a_named_backend_that_turns_the_arrays_down_is_refused_before_any_work(monkeypatch, capsys):
    """As the cuda backend turns float64 down: here the cpu backend, made to turn every call down, stands in (on
    this machine no real backend both runs and refuses a dtype)."""
    from numba_flash.bench import cli
    from numba_flash.cli import bench_main

    be = next(b for b in backend_registry.backends("flash") if b.name == "cpu")
    monkeypatch.setattr(type(be), "not_supported_reasons", lambda self, call, forced=False: ["float64 not supported"])
    monkeypatch.setattr(cli, "execute", _never_called)
    code = bench_main(["--config", "tiny", "--backend", "cpu", "--dtype", "float64", "--no-grad", "--repeats",
                       "1"])
    assert code == cli.EXIT_UNAVAILABLE
    assert "cpu named with --backend cannot run (cpu: float64 not supported" in capsys.readouterr().err


def test_float64_is_benched_where_the_backend_runs_it(tmp_path):
    from numba_flash.bench.cli import parse_args

    args, cases, runners = parse_args(["--config", "tiny", "--dtype", "float64", "--backend", "cpu"])
    assert {c.dtype for c in cases} == {"float64"}
    rows = bench_runners.BackendRunner("cpu")
    from numba_flash.bench.cases import Inputs
    import numpy as np

    rows.prepare(cases[0], Inputs(cases[0], np.random.default_rng(0)))
    assert rows.arrays["q"].dtype == np.float64
