"""``numba-flash bench --variants`` end to end on a tiny size through the command's entry point: every variant has
a row per backend, the ratios follow from the times they divide, backends without a variant say so, and bad
arguments exit 2 with a message."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from numba_flash import cli
from numba_flash.bench.variants import VARIANTS, VARIANTS_COLUMNS, make_variants_case, variant_arguments

pytest.importorskip("torch")
TINY = ["--seqlen", "64", "--nheads", "2", "--headdim", "16", "--repeats", "2", "--compare", "none"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from backends.cpu import CpuBackend

    tmp = tmp_path_factory.mktemp("variants")
    # the cpu backend as one without mods: it would compile a kernel per mod here (tests/numba_flash/cpu runs them)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuBackend, "SUPPORTS_MODS", False)
        rc = cli.main(["bench", "--variants", *TINY, "--json", str(tmp / "v.json"), "--csv", str(tmp / "v.csv")])
    with open(tmp / "v.csv") as f:
        rows = list(csv.DictReader(f))
    return rc, json.loads((tmp / "v.json").read_text()), rows


def test_rows_ratios_and_skips(run):
    rc, doc, csv_rows = run
    assert rc == 0 and doc["meta"]["mode"] == "variants"
    results = doc["results"]
    assert set(csv_rows[0]) == set(VARIANTS_COLUMNS) and len(csv_rows) == len(results)
    by_name = {}
    for r in results:
        by_name.setdefault(r["name"], {})[r["variant"]] = r
    assert set(by_name) == {"cpu", "rocm"}
    for name, rows in by_name.items():
        assert list(rows) == list(VARIANTS)
        plain = rows["plain"]["median_ms"]
        for r in rows.values():
            if r["status"] == "ok":
                assert r["time_vs_plain"] == pytest.approx(r["median_ms"] / plain, rel=1e-12)
                assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert all(r["status"] == "ok" for r in by_name["rocm"].values())          # the torch path runs them all
    assert by_name["cpu"]["mask_mod"]["status"].startswith("skipped:")
    assert "not supported" in by_name["cpu"]["mask_mod"]["status"]


def test_the_mask_mod_hides_seven_eighths_and_the_bias_mod_is_a_distance():
    case = make_variants_case(1, 3, 64, 16)
    args = variant_arguments(case, np.random.default_rng(0))
    same_doc = args["mask_mod"]["mask_mod"]
    seen = np.array([[same_doc(0, 0, i, j) for j in range(64)] for i in range(64)])
    assert seen.mean() == pytest.approx(1 / 8)
    bias = args["bias_mod"]["bias_mod"]
    assert bias(0, 2, 10, 3) == pytest.approx(-args["alibi"]["alibi_slopes"][2] * 7)


@pytest.mark.parametrize("extra,match", [
    (["--causal"], "--causal does not apply to --variants"),
    (["--seqlen", "100"], "must be a multiple of 8"),
    (["--compare", "torch"], "--compare: --variants compares with flex"),
    (["--seqlen", "64,128"], "--variants takes one sequence length"),
])
def test_bad_arguments_exit_2(extra, match, capsys):
    args = ["bench", "--variants", "--nheads", "2", "--repeats", "1"] + extra
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err
