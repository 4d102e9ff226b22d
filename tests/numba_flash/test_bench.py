"""``python -m numba_flash.bench`` end to end on the tiny config: the CSV/JSON figures are consistent with each
other and with the float64 reference, a sweep runs, --plot writes a PNG, and bad arguments give a clean error."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numba_flash import bench

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numba_flash.bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run shared by the tests that read its outputs (each run pays for compiling and importing torch)."""
    tmp = tmp_path_factory.mktemp("bench")
    seed = int(np.random.SeedSequence().entropy % 2**32)
    proc = run_bench("--config", "tiny", "--causal", "--backend", "cpu", "--compare", "naive,torch",
                     "--repeats", "3", "--seed", str(seed), "--csv", str(tmp / "out.csv"),
                     "--json", str(tmp / "out.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp / "out.csv") as f:
        rows = list(csv.DictReader(f))
    return proc, rows, json.loads((tmp / "out.json").read_text()), seed


EXPECTED_COLUMNS = ["config", "batch", "nheads", "nheads_kv", "seqlen", "headdim", "causal", "dtype", "layout",
                    "precision", "name", "kind", "device", "pass", "status", "repeats", "min_ms", "median_ms",
                    "p95_ms", "p99_ms", "max_ms", "spread", "flops", "tflops", "peak_mem_bytes", "mem_saved_vs_naive",
                    "speedup_vs_naive", "speedup_vs_sdpa", "max_err"]


def test_csv_columns_and_values(tiny_run):
    proc, rows, _, seed = tiny_run
    assert rows and list(rows[0]) == EXPECTED_COLUMNS
    b, h, s, d = 2, 4, 8, 64   # the tiny config
    names = {(r["name"], r["pass"]) for r in rows}
    assert {("cpu", "fwd"), ("cpu", "bwd"), ("naive", "fwd"), ("naive", "bwd")} <= names, names
    ok = {(r["name"], r["pass"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            assert r["name"] == "torch" and r["status"].startswith("skipped"), r  # only torch may be absent
            continue
        assert r["config"] == "tiny" and r["kind"] == ("peer" if r["name"] in ("naive", "torch") else "backend")
        assert (int(r["batch"]), int(r["nheads"]), int(r["nheads_kv"]), int(r["seqlen"]), int(r["headdim"])) \
            == (b, h, h, s, d)
        assert r["causal"] == "True" and r["dtype"] == "float32" and r["layout"] == "bshd" and r["precision"] == "ieee"
        assert r["device"] == "cpu" and int(r["repeats"]) == 3
        lo, med, hi = float(r["min_ms"]), float(r["median_ms"]), float(r["max_ms"])
        p95, p99 = float(r["p95_ms"]), float(r["p99_ms"])
        assert 0 < lo <= med <= p95 <= p99 <= hi, r
        assert float(r["spread"]) == pytest.approx(hi / lo, rel=1e-6)
        # The contract's FLOP count: forward 4*B*H*S*S*D, halved when causal; backward 2.5x the forward.
        flops = 4 * b * h * s * s * d / 2 * (1.0 if r["pass"] == "fwd" else 2.5)
        assert float(r["flops"]) == pytest.approx(flops)
        assert float(r["tflops"]) == pytest.approx(flops / (med * 1e-3) / 1e12, rel=1e-6)
        assert 0 <= float(r["max_err"]) < 1e-4, (r, seed)
        assert int(r["peak_mem_bytes"]) >= 0
        naive = ok[("naive", r["pass"])]
        assert float(r["speedup_vs_naive"]) == pytest.approx(float(naive["median_ms"]) / med, rel=1e-6)
        if int(naive["peak_mem_bytes"]) >= 2**20:
            assert float(r["mem_saved_vs_naive"]) == pytest.approx(
                1 - int(r["peak_mem_bytes"]) / int(naive["peak_mem_bytes"]), rel=1e-6)
        else:  # page-granular measurements of under a MiB give no meaningful ratio
            assert r["mem_saved_vs_naive"] == ""
        sdpa = ok.get(("torch", r["pass"]))
        if sdpa is not None:
            assert float(r["speedup_vs_sdpa"]) == pytest.approx(float(sdpa["median_ms"]) / med, rel=1e-6)
        else:
            assert r["speedup_vs_sdpa"] == ""
    # The table on stdout carries the same names, and the header names the machine and the thread counts.
    out = proc.stdout
    assert "threads: numba" in out and "machine:" in out and "warm-up" in out and "command:" in out


def test_json_matches_csv(tiny_run):
    _, rows, data, seed = tiny_run
    assert data["meta"]["seed"] == seed and data["meta"]["repeats"] == 3 and data["meta"]["cpu_count"] >= 1
    assert len(data["results"]) == len(rows)
    for j, c in zip(data["results"], rows):
        assert (j["name"], j["pass"], j["status"]) == (c["name"], c["pass"], c["status"])
        if j["status"] == "ok":
            assert j["median_ms"] == pytest.approx(float(c["median_ms"]))


def test_errors_are_measured_not_assumed(rng):
    """The max error column comes from comparing with the reference: a wrong result must show up in it."""
    case = bench.Case("tiny", 1, 2, 2, 9, 16, False, "float32", "bshd")
    inputs = bench.Inputs(case, rng)
    ref = bench.Reference(inputs)
    runner = bench.make_runner("naive", "peer")
    runner.prepare(case, inputs)
    good = bench.run_pass(runner, case, "fwd", 1, ref)
    assert good.status == "ok" and good.max_err < 1e-5

    class Broken(bench.NaiveNumpyRunner):
        def forward(self):
            return super().forward() * 1.01

    broken = Broken("broken")
    broken.prepare(case, inputs)
    assert bench.run_pass(broken, case, "fwd", 1, ref).max_err > 1e-4


def test_seqlen_sweep_and_plot(tmp_path):
    png, out_csv = tmp_path / "sweep.png", tmp_path / "sweep.csv"
    proc = run_bench("--batch", "1", "--nheads", "2", "--headdim", "32", "--seqlen", "17,33", "--no-grad",
                     "--backend", "cpu", "--compare", "naive", "--repeats", "2", "--csv", str(out_csv),
                     "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert sorted({int(r["seqlen"]) for r in rows}) == [17, 33]
    assert {r["pass"] for r in rows} == {"fwd"}
    assert all(r["status"] == "ok" and float(r["max_err"]) < 1e-4 for r in rows), rows
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "4/4" in proc.stderr, proc.stderr   # the progress bar: 2 lengths x (cpu, naive) x 1 pass


@pytest.mark.parametrize("args, message", [
    (["--config", "huge"], "invalid choice"),
    (["--seqlen", "0"], "positive"),
    (["--seqlen", "12,abc"], "positive integer"),
    (["--nheads", "6", "--nheads-kv", "4"], "multiple of --nheads-kv"),
    (["--backend", "nosuch"], "unknown backend"),
    (["--compare", "pytorch"], "unknown peer"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--repeats", "0"], "positive"),
    (["--headdim", "300"], "larger than 256"),
    (["--seed", "-1"], "non-negative integer"),
    (["--csv", "/nonexistent-dir/out.csv"], "does not exist"),
    (["--json", "{tmp}"], "is a directory"),
    (["--plot", "{tmp}/tflops.txt"], "must end in one of"),
    (["--config", "tiny", "extra"], "unrecognized arguments"),
])
def test_bad_arguments_give_a_clean_error(tmp_path, capsys, args, message):
    # In this process (a subprocess each cost a Python start and the imports, ~5 s): the command line's entry point
    # exits with status 2 and argparse's usage and message, and raises nothing else (which would be a traceback).
    from numba_flash.cli import bench_main

    try:
        code = bench_main([a.format(tmp=tmp_path) for a in args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err, err


def test_console_script_runs(tmp_path):
    script = Path(sys.executable).with_name("numba-flash")
    if not script.exists():
        pytest.skip("the numba-flash console script is not installed (pip install -e .)")
    out_csv = tmp_path / "out.csv"
    proc = subprocess.run([str(script), "bench", "--config", "tiny", "--no-grad", "--backend", "cpu", "--compare",
                           "none", "--repeats", "1", "--csv", str(out_csv)], cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert [(r["name"], r["pass"], r["status"]) for r in rows] == [("cpu", "fwd", "ok")]


def test_console_script_accepts_bench_subcommand():
    args, cases, runners = bench.parse_args(["bench", "--config", "small", "--causal", "--nheads-kv", "2",
                                             "--backend", "cpu", "--compare", "none"])
    assert cases[0].config == "small" and cases[0].nheads_kv == 2 and cases[0].causal
    assert runners == [("cpu", "backend")]


def test_out_of_memory_sizes_skip_instead_of_failing(rng, monkeypatch):
    """Where the S x S peers or the float64 reference cannot fit in memory, they are skipped with the reason and
    the backends still run; nothing tries the allocation (an overcommitting kernel would kill the process)."""
    monkeypatch.setattr(bench.memory, "available_host_bytes", lambda: 4096)
    case = bench.Case("custom", 1, 2, 2, 40, 16, True, "float32", "bshd")
    runners = [bench.make_runner("cpu", "backend"), bench.make_runner("naive", "peer")]
    notes = []
    rows = bench.run_case(case, runners, ("fwd",), 1, True, rng, notes=notes)
    by_name = {r.name: r for r in rows}
    assert by_name["naive"].status.startswith("skipped: the S x S scores need about"), by_name["naive"].status
    assert by_name["cpu"].status == "ok" and by_name["cpu"].max_err is None
    assert len(notes) == 1 and "max err not computed at S=40" in notes[0]
