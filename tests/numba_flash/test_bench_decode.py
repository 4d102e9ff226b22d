"""``numba-flash bench --decode`` and ``--varlen`` end to end on tiny sizes, through the command's entry point:
the JSON and CSV figures are consistent with each other and with their definitions (GB/s of cache read, fraction
of the copy's GB/s, speedup over SDPA, work-normalised time), the error column is measured against the float64
reference, the decoding step leaves the cache as it was, and bad arguments exit 2 with a message."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from numba_flash import bench, cli
from numba_flash.bench.decode import DECODE_COLUMNS
from numba_flash.bench.varlen import VARLEN_COLUMNS

TINY = ["--nheads", "4", "--nheads-kv", "2", "--headdim", "32", "--repeats", "3", "--backend", "cpu"]


def _finite_positive(*xs: float) -> bool:
    return all(x is not None and math.isfinite(x) and x > 0 for x in xs)


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode")
    rc = cli.main(["bench", "--decode", "--cache-lens", "64,300", *TINY, "--json", str(tmp / "d.json"),
                   "--csv", str(tmp / "d.csv")])
    with open(tmp / "d.csv") as f:
        rows = list(csv.DictReader(f))
    return rc, json.loads((tmp / "d.json").read_text()), rows


def test_decode_json_fields_and_definitions(decode_run):
    rc, doc, csv_rows = decode_run
    assert rc == 0
    assert doc["meta"]["mode"] == "decode" and doc["meta"]["repeats"] == 3
    results = doc["results"]
    assert [list(r) for r in results] == [list(DECODE_COLUMNS)] * len(results)
    assert len(csv_rows) == len(results) and list(csv_rows[0]) == list(DECODE_COLUMNS)
    by = {(r["cache_len"], r["name"]): r for r in results}
    torch_there = all(by[(n, "torch")]["status"] == "ok" for n in (64, 300))
    for n in (64, 300):
        cpu, copy = by[(n, "cpu")], by[(n, "copy")]
        for r in (cpu, copy):
            assert r["status"] == "ok" and r["repeats"] == 3, r
            assert (r["batch"], r["nheads"], r["nheads_kv"], r["headdim"], r["dtype"]) == (1, 4, 2, 32, "float32")
            assert r["cache_bytes"] == 2 * n * 2 * 32 * 4
            assert _finite_positive(r["min_ms"], r["median_ms"], r["p95_ms"], r["p99_ms"], r["gbps"])
            assert r["min_ms"] <= r["median_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"]
            assert r["gbps"] == pytest.approx(r["cache_bytes"] / (r["median_ms"] * 1e-3) / 1e9)
        assert cpu["kind"] == "backend" and copy["kind"] == "yardstick"
        assert cpu["frac_of_copy"] == pytest.approx(cpu["gbps"] / copy["gbps"])
        assert 0 <= cpu["max_err"] < 1e-5, cpu["max_err"]
        assert copy["max_err"] is None and copy["frac_of_copy"] is None
        if torch_there:
            sdpa = by[(n, "torch")]
            assert sdpa["kind"] == "peer" and 0 <= sdpa["max_err"] < 1e-5
            assert cpu["speedup_vs_sdpa"] == pytest.approx(sdpa["median_ms"] / cpu["median_ms"])


def test_decode_prints_header_and_table(decode_run, capsys):
    rc = cli.main(["bench", "--decode", "--cache-lens", "16", *TINY, "--compare", "none", "--no-check"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "case: decode B=1 Hq=4 Hkv=2 Sq=1 cache_len=16 D=32 float32" in out
    for column in ("p50 ms", "p95 ms", "p99 ms", "GB/s", "% of copy", "x sdpa", "max err"):
        assert column in out
    assert "torch" not in out.split("cache len", 1)[1]   # --compare none: no SDPA row


def test_decode_error_column_catches_a_wrong_answer(rng, monkeypatch):
    """A backend whose decoding step returned zeros shows an error of the size of the output, not ~1e-7."""
    from numba_flash.backend_registry import Dispatcher

    case = bench.make_decode_cases(nheads=4, nheads_kv=2, headdim=16, cache_lens=[32])[0]
    real = Dispatcher.with_kvcache
    monkeypatch.setattr(Dispatcher, "with_kvcache", lambda self, q, *a, **kw: np.zeros_like(real(self, q, *a, **kw)))
    rows = bench.run_decode_case(case, ["cpu"], [], 1, True, rng)
    assert rows[0].name == "cpu" and rows[0].max_err > 1e-2, rows[0]


def test_decode_step_leaves_the_cache_untouched(rng):
    case = bench.make_decode_cases(nheads=4, nheads_kv=2, headdim=16, cache_lens=[40])[0]
    inputs = bench.DecodeInputs.draw(case, rng)
    before = (inputs.k_cache.copy(), inputs.v_cache.copy())
    assert inputs.k_cache.std() > 0.5      # random N(0, 1), not zeros
    from numba_flash.bench.decode import backend_step, max_err_head0

    step = backend_step("cpu", inputs)
    for _ in range(3):
        out = step.fn()
    assert max_err_head0(out, inputs.reference_head0()) < 1e-5
    np.testing.assert_array_equal(inputs.k_cache, before[0])
    np.testing.assert_array_equal(inputs.v_cache, before[1])


def test_decode_defaults_are_the_issue_s_point():
    cases = bench.make_decode_cases()
    assert [c.cache_len for c in cases] == [8192, 16384, 32768, 65536]
    c = cases[-1]
    assert (c.batch, c.nheads, c.nheads_kv, c.headdim, c.dtype) == (1, 32, 8, 128, "float32")
    assert c.cache_bytes == 2 * 65536 * 8 * 128 * 4      # 512 MiB read per step


def test_varlen_json_fields_and_definitions(tmp_path):
    rc = cli.main(["bench", "--varlen", "--total-tokens", "300", "--causal", "--seed", "7", *TINY,
                   "--json", str(tmp_path / "v.json"), "--csv", str(tmp_path / "v.csv")])
    assert rc == 0
    doc = json.loads((tmp_path / "v.json").read_text())
    lengths = doc["meta"]["lengths"]
    assert sum(lengths) == 300 and len(lengths) > 1 and doc["meta"]["seed"] == 7
    assert lengths == bench.draw_lengths(300, np.random.default_rng(7))   # the seed replays the mix
    packed, dense = doc["results"]
    assert [list(r) for r in doc["results"]] == [list(VARLEN_COLUMNS)] * 2
    with open(tmp_path / "v.csv") as f:
        assert list(next(csv.DictReader(f))) == list(VARLEN_COLUMNS)
    assert (packed["form"], dense["form"]) == ("packed", "dense")
    assert packed["tokens"] == 300 and packed["n_seqs"] == len(lengths) == dense["n_seqs"]
    assert packed["max_seqlen"] == max(lengths) and packed["causal"] is True
    # The dense peer does the same work up to rounding its one length.
    assert dense["flops"] == pytest.approx(packed["flops"], rel=0.1)
    for r in (packed, dense):
        assert r["status"] == "ok" and r["repeats"] == 3
        assert _finite_positive(r["min_ms"], r["median_ms"], r["p99_ms"], r["tflops"], r["tokens_per_s"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["median_ms"] * 1e-3))
    assert packed["work_time_vs_dense"] == pytest.approx(
        (packed["median_ms"] / packed["flops"]) / (dense["median_ms"] / dense["flops"]))
    assert 0 <= packed["max_err"] < 1e-5


def test_draw_lengths_is_seeded_long_tailed_and_exact():
    a = bench.draw_lengths(16384, np.random.default_rng(3))
    assert a == bench.draw_lengths(16384, np.random.default_rng(3)) and sum(a) == 16384
    assert max(a) <= 4096 and min(a[:-1]) >= 8            # the last one is cut to fit the total
    assert max(a) > 3 * np.median(a)                       # a long tail, not equal lengths


@pytest.mark.parametrize("args, message", [
    (["--decode", "--seqlen", "512"], "--seqlen does not apply to --decode; use --cache-lens"),
    (["--decode", "--nheads", "6", "--nheads-kv", "4"], "must be a multiple of --nheads-kv"),
    (["--decode", "--varlen"], "not allowed with argument"),
    (["--cache-lens", "128"], "--cache-lens needs --decode"),
    (["--total-tokens", "128"], "--total-tokens needs --varlen"),
    (["--decode", "--cache-lens", "0"], "positive"),
    (["--decode", "--compare", "naive"], "--compare: --decode compares with torch (SDPA) or none"),
    (["--decode", "--causal"], "--causal does not apply to --decode"),
    (["--decode", "--plot", "x.png"], "--plot does not apply to --decode"),
    (["--decode", "--backend", "nosuch"], "unknown backend nosuch"),
    (["--varlen", "--compare", "torch"], "--compare does not apply to --varlen"),
    (["--varlen", "--cache-lens", "64"], "--cache-lens does not apply to --varlen"),
    (["--varlen", "--dtype", "bf16"], "--dtype: --varlen runs float32 or float16"),
])
def test_bad_arguments_exit_2_with_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "usage:" in err, err


def test_a_named_backend_that_cannot_run_exits_3(capsys):
    if bench.torch_cuda_available():
        pytest.skip("a GPU is here: the cuda backend can run")
    rc = cli.main(["bench", "--decode", "--cache-lens", "16", "--nheads", "2", "--headdim", "16", "--repeats", "1",
                   "--backend", "cuda", "--compare", "none"])
    captured = capsys.readouterr()
    assert rc == 3 and "cuda" in captured.err, captured
    assert "cannot run" in captured.err and "nothing was run" in captured.err, captured
