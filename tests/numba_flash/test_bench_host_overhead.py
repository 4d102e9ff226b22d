"""``numba-flash bench --host-overhead``: its table of rows, the records' keys and their consistency, a failing row
reported rather than lost, the command end to end with --json, and the flags that do not apply refused (exit 2).
Performance goals live in the bench's output, never here."""

from __future__ import annotations

import json
import math

import pytest

from numba_flash import cli
from numba_flash.bench import host_overhead
from numba_flash.bench.host_overhead import HostCase, host_cases, measure


def test_the_table_covers_every_backend_call_and_size():
    rows = host_cases(torch_available=True)
    keys = {(r.backend, r.call, r.seqlen_q, r.seqlen_k) for r in rows}
    assert ("cpu", "forward", 1, 16) in keys and ("torch", "forward_backward", 64, 64) in keys
    assert ("cpu", "decode", 1, 64) in keys and not any(c == "decode" and sq != 1 for _, c, sq, _ in keys)
    assert len(keys) == len(rows) == 2 * (2 * 2 + 2)
    assert all(r.sdpa is not None for r in rows)
    assert {r.backend for r in host_cases(torch_available=False)} == {"cpu"}
    assert all(r.sdpa is None for r in host_cases(torch_available=False))


def test_a_record_s_figures_agree_with_each_other():
    pytest.importorskip("torch")
    (case,) = host_cases(["cpu"], ["forward"], [(1, 16)])
    r = measure(case, repeats=20, rounds=2, warmup=2)
    assert r["status"] == "ok" and (r["backend"], r["call"], r["seqlen_q"], r["seqlen_k"]) == ("cpu", "forward", 1, 16)
    assert 0 < r["min_us"] <= r["p50_us"] <= r["p95_us"]
    assert 0 < r["torch_sdpa_min_us"] <= r["torch_sdpa_p50_us"]
    assert math.isclose(r["ratio"], r["p50_us"] / r["torch_sdpa_p50_us"])


def test_a_row_without_sdpa_and_a_failing_row():
    """A stub device's row (no SDPA to compare with) gets no ratio; a row that raises reports why."""
    stub = HostCase("stub", "forward", 1, 16, setup=lambda rng: (lambda: None))
    r = measure(stub, repeats=10, rounds=2, warmup=1)
    assert r["status"] == "ok" and "ratio" not in r and r["p50_us"] >= 0

    def broken(rng):
        raise RuntimeError("no device")
    r = measure(HostCase("stub", "decode", 1, 16, setup=broken), repeats=10)
    assert r["status"] == "error: RuntimeError: no device" and "p50_us" not in r
    assert "error: RuntimeError" in host_overhead.format_host_table([r])


def test_the_command_writes_one_record_per_row(tmp_path, monkeypatch, capsys):
    # the same command on fewer rows: the table's first two, as the command builds them
    real = host_overhead.host_cases
    monkeypatch.setattr(host_overhead, "host_cases",
                        lambda *a, **k: [r for r in real(*a, **k) if r.seqlen_k == 16][:2])
    path = tmp_path / "host.json"
    rc = cli.main(["bench", "--host-overhead", "--backend", "cpu", "--repeats", "1", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["meta"]["mode"] == "host-overhead"
    records = data["results"]
    assert [(r["backend"], r["call"]) for r in records] == [("cpu", "forward"), ("cpu", "forward_backward")]
    for r in records:
        assert {"backend", "call", "p50_us", "p95_us"} <= set(r) and r["status"] == "ok"
    out = capsys.readouterr().out
    assert "x sdpa" in out and "forward_backward" in out


@pytest.mark.parametrize("args, message", [
    (["--seqlen", "5"], "--seqlen does not apply to --host-overhead"),
    (["--causal"], "--causal does not apply to --host-overhead"),
    (["--backend", "rocm"], "--host-overhead times cpu, torch"),
    (["--decode"], "not allowed with argument"),
])
def test_flags_that_do_not_apply_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--host-overhead", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_each_row_is_judged_by_its_own_goal():
    assert host_overhead.meets_goal({"ratio": 2.9}) and not host_overhead.meets_goal({"ratio": 3.1})
    # the cuda stub's rows have no SDPA beside them: their P95 against their goal in microseconds
    assert host_overhead.meets_goal({"p95_us": 19.0, "goal_p95_us": 20.0})
    assert host_overhead.meets_goal({"p95_us": 21.0, "goal_p95_us": 20.0}) is False
    assert host_overhead.meets_goal({"p95_us": 21.0}) is None and host_overhead.meets_goal({}) is None


def test_the_cuda_stub_s_records_join_the_table(monkeypatch, capsys, tmp_path):
    """The cuda rows come from host_overhead_cuda's subprocess (faked here; the real one is test_thin_launch's):
    they get their sizes and a status, are judged by their P95 goal, and a failure is a row saying why."""
    from numba_flash.bench import host_overhead_cuda

    fake = [{"backend": "cuda", "call": c, "p50_us": p, "p95_us": p + 1, "launches": n, "goal_p95_us": g}
            for c, p, n, g in (("forward", 9.0, 1, 20.0), ("backward", 60.0, 3, 50.0), ("decode", 8.0, 2, 20.0))]
    asked = []
    monkeypatch.setattr(host_overhead_cuda, "host_overhead_records", lambda calls: asked.append(calls) or fake)
    path = tmp_path / "host.json"
    assert cli.main(["bench", "--host-overhead", "--backend", "cuda", "--repeats", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["results"]
    assert asked == [400]
    assert [(r["call"], r["seqlen_q"], r["seqlen_k"], r["status"]) for r in rows] == [
        ("forward", 64, 64, "ok"), ("backward", 64, 64, "ok"), ("decode", 1, 1024, "ok")]
    table = host_overhead.format_host_table(rows)
    goal_column = [line.split()[-1] for line in table.splitlines()[2:]]
    assert goal_column == ["yes", "no", "yes"], table

    def broken(calls):
        raise RuntimeError("host overhead (cuda, stub) failed: no torch")
    monkeypatch.setattr(host_overhead_cuda, "host_overhead_records", broken)
    (row,) = host_overhead.cuda_stub_records(10)
    assert row["backend"] == "cuda" and row["status"] == "error: RuntimeError: host overhead (cuda, stub) failed: no torch"
