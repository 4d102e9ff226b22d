"""tools/gpu_warm_cache.py, the GPU check's warm-cache case (a new process's first call with a warm disk cache of
compiled kernels), tested without a GPU: its verdicts, the order of its runs and their cache directories, and its
place in tools/gpu_check.py's results and summary. The child processes themselves need a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def tools(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import gpu_check
    import gpu_warm_cache

    return gpu_check, gpu_warm_cache


def _record(first_fwd=0.2, compiled=0, distrusted=0):
    return dict(import_s=1.0, first_fwd_s=first_fwd, first_bwd_s=0.3, second_fwd_s=0.001, selfchecked=2,
                cache=dict(loaded=5, compiled=compiled, stored=compiled, distrusted=distrusted), cache_dir="x")


@pytest.mark.parametrize("rec, ok", [(_record(), True), (_record(compiled=1), False), (_record(first_fwd=0.6), False),
                                     (_record(distrusted=1), False)])
def test_a_warm_run_passes_only_without_compiling_within_the_goal(tools, rec, ok):
    _, gwc = tools
    judged = gwc.judge("warm", rec)
    assert judged["ok"] is ok and judged["kind"] == "warm_cache"
    assert "ok" not in gwc.judge("cold", rec)   # a cold run compiles by design: measured, not judged
    assert ("MISSED" in gwc.describe(judged)) is not ok


def test_runs_cold_then_warm_in_one_directory_and_warmup_in_another(tools, tmp_path):
    _, gwc = tools
    stale = tmp_path / "cache" / "old.nfk"
    stale.parent.mkdir()
    stale.write_text("left from an earlier run")
    seen, warmed = [], []

    def runner(cache, dtype, head_dim, device):
        seen.append((Path(cache).name, sorted(p.name for p in Path(cache).glob("*")) if Path(cache).exists() else []))
        Path(cache).mkdir(exist_ok=True)
        (Path(cache) / "entry.nfk").write_text("")
        return _record(compiled=0 if seen[-1][1] else 3)

    def warmer(cache, dtype, head_dim):
        warmed.append((Path(cache).name, dtype, head_dim))
        return dict(cc="9.0", exit=0)

    records = gwc.measure(str(tmp_path), "bfloat16", 64, "cuda", warmup=True, runner=runner, warmer=warmer)
    assert [r["run"] for r in records] == ["cold", "warm", "after_warmup"]
    assert seen == [("cache", []), ("cache", ["entry.nfk"]), ("cache-warmup", [])]   # the cold one emptied first
    assert warmed == [("cache-warmup", "bfloat16", 64)] and records[2]["warmup"]["cc"] == "9.0"
    assert records[1]["ok"] is True


def test_gpu_check_records_and_summarises_the_case(tools, tmp_path, monkeypatch, capsys):
    gpu_check, gwc = tools
    calls = []
    monkeypatch.setattr(gwc, "measure", lambda out, device, warmup: calls.append((device, warmup)) or
                        [gwc.judge("cold", _record(compiled=4)), gwc.judge("warm", _record(first_fwd=0.31))])
    assert gpu_check.main(["--out", str(tmp_path), "--only", "warm-cache", "--device", "cpu"]) == 0
    assert calls == [("cpu", False)]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["run"], r["job"]) for r in rows] == [("warm_cache", "cold", "warm-cache"),
                                                                ("warm_cache", "warm", "warm-cache")]
    summary = (tmp_path / "summary.txt").read_text()
    assert "warm cache warm: ok first forward 0.310 s" in summary and "warm cache cold:" in summary


def test_the_tool_parses_its_arguments(tools):
    _, gwc = tools
    with pytest.raises(SystemExit) as exit_:
        gwc.main(["--help"])
    assert exit_.value.code == 0
    with pytest.raises(SystemExit) as exit_:
        gwc.main([])   # --out is required
    assert exit_.value.code == 2
