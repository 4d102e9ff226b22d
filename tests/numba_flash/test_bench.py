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
from numba_flash.semantics import attention_flops

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


def test_csv_columns_and_values(tiny_run):
    proc, rows, _, seed = tiny_run
    assert rows and list(rows[0]) == list(bench.CSV_COLUMNS)
    b, h, s, d = bench.CONFIGS["tiny"]
    names = {(r["name"], r["pass"]) for r in rows}
    assert {("cpu", "fwd"), ("cpu", "bwd"), ("naive", "fwd"), ("naive", "bwd")} <= names, names
    for r in rows:
        if r["status"] != "ok":
            assert r["name"] == "torch" and r["status"].startswith("skipped"), r  # only torch may be absent
            continue
        assert (int(r["batch"]), int(r["nheads"]), int(r["seqlen"]), int(r["headdim"])) == (b, h, s, d)
        assert r["causal"] == "True" and r["dtype"] == "float32" and int(r["repeats"]) == 3
        lo, med, hi = float(r["min_ms"]), float(r["median_ms"]), float(r["max_ms"])
        assert 0 < lo <= med <= hi, r
        flops = attention_flops(b, h, s, s, d, causal=True, mode=r["pass"])
        assert float(r["flops"]) == pytest.approx(flops)
        assert float(r["tflops"]) == pytest.approx(flops / (med * 1e-3) / 1e12, rel=1e-6)
        assert 0 <= float(r["max_err"]) < 1e-4, (r, seed)
        assert int(r["peak_mem_bytes"]) >= 0
        if r["name"] == "naive":
            assert float(r["speedup_vs_naive"]) == pytest.approx(1.0)
        else:
            assert float(r["speedup_vs_naive"]) > 0
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


@pytest.mark.parametrize("args, message", [
    (["--config", "huge"], "invalid choice"),
    (["--seqlen", "0"], "positive"),
    (["--seqlen", "12,abc"], "positive integer"),
    (["--nheads", "6", "--nheads-kv", "4"], "multiple of --nheads-kv"),
    (["--backend", "nosuch"], "unknown backend"),
    (["--compare", "pytorch"], "unknown peer"),
    (["--dtype", "fp8"], "invalid choice"),
])
def test_bad_arguments_give_a_clean_error(args, message):
    proc = run_bench(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "usage:" in proc.stderr


def test_console_script_accepts_bench_subcommand():
    args, cases, runners = bench.parse_args(["bench", "--config", "small", "--causal", "--nheads-kv", "2",
                                             "--backend", "cpu", "--compare", "none"])
    assert cases[0].config == "small" and cases[0].nheads_kv == 2 and cases[0].causal
    assert runners == [("cpu", "backend")]
