"""The bench as a library and as a command: result records and a DataFrame, P50/P95/P99, the busy-machine
warning, a plot with error bars and a log axis that leaves matplotlib's backend alone, torch's thread count put
back, ``tqdm.auto`` progress, subcommands, ``--version`` and the exit status of a named backend that cannot run."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from numba_flash import bench
from numba_flash.bench.harness import BUSY_SPREAD, TimingStats

REPO = Path(__file__).resolve().parents[2]


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(2**32))


@pytest.fixture(scope="module")
def tiny_results():
    """One small sweep through the Python API, shared by the tests that read it."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bench.NoisyTimingWarning)   # a shared CI machine may well be busy
        res = bench.run("tiny", nheads_kv=2, seqlen=[9, 17], causal=True, backends="cpu", compare="naive",
                        repeats=4, seed=seed, progress=False)
    return res, seed


def test_run_returns_records_with_percentiles_and_a_dataframe(tiny_results):
    res, seed = tiny_results
    assert isinstance(res, bench.BenchResults) and len(res) == 2 * 2 * 2   # 2 lengths x (cpu, naive) x 2 passes
    assert res.meta["seed"] == seed and res.meta["repeats"] == 4
    for row in res:
        assert row.status == "ok", row.status
        s = row.stats
        assert s.n == 4 and s.min_ms <= s.p50_ms <= s.p95_ms <= s.p99_ms <= s.max_ms
        np.testing.assert_allclose([s.p50_ms, s.p95_ms, s.p99_ms], np.percentile(row.times_ms, [50, 95, 99]))
        assert row.max_err < 1e-4, (row.label, seed)
        assert row.case.nheads_kv == 2 and row.case.causal
    records = res.records()
    assert [r["seqlen"] for r in records if r["name"] == "cpu" and r["pass"] == "fwd"] == [9, 17]
    df = res.to_dataframe()
    assert list(df.columns) == list(bench.CSV_COLUMNS) and len(df) == len(res)
    assert (df["p95_ms"] >= df["median_ms"]).all() and (df["p99_ms"] <= df["max_ms"]).all()
    text = res.table()
    assert "p95 ms" in text and "p99 ms" in text and text.count("\n") >= len(res)
    assert "<table>" in res._repr_html_() and "Hkv=2" in repr(res)


def test_plot_has_error_bars_a_log_axis_and_the_whole_case_in_its_title(tiny_results):
    from matplotlib.container import ErrorbarContainer

    res, _ = tiny_results
    fig = res.plot()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    title = ax.get_title()
    for part in ("Hq=4", "Hkv=2", "D=64", "causal", "float32", "bshd", "S=9,17", "numba", "threads"):
        assert part in title, (part, title)
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 4 and all(c.has_yerr for c in bars)        # (cpu, naive) x (fwd, bwd)
    # Each bar spans the TFLOP/s of the P95 call (bottom) to that of the fastest call (top).
    row = next(r for r in res if r.name == "cpu" and r.pass_ == "fwd" and r.case.seqlen == 9)
    label = "cpu (cpu) fwd"
    (container,) = [c for c in bars if c.get_label() == label]
    segments = container.lines[2][0].get_segments()
    (low, high) = segments[0][:, 1]
    assert low == pytest.approx(row.tflops_at(row.stats.p95_ms)) and high == pytest.approx(
        row.tflops_at(row.stats.min_ms))


def test_noisy_timings_are_flagged(rng):
    """A pass whose slowest call took far longer than its fastest is reported; an even one is not."""
    case = bench.Case("custom", 1, 2, 2, 16, 16, False, "float32", "bshd")
    base = float(rng.uniform(0.05, 5.0))
    even = list(base * rng.uniform(1.0, 1.3, size=8))
    stalled = even[:-1] + [base * BUSY_SPREAD * float(rng.uniform(2.0, 200.0))]
    assert not TimingStats.of(even).busy and TimingStats.of(stalled).busy
    rows = [bench.Row(case, "cpu", "backend", "cpu", "fwd", times_ms=even),
            bench.Row(case, "naive", "peer", "cpu", "fwd", times_ms=stalled)]
    res = bench.BenchResults(rows, {"numba_threads": 2, "cpu": "test"})
    assert [r.name for r in res.noisy] == ["naive"]
    with pytest.warns(bench.NoisyTimingWarning, match=r"naive \(cpu\) fwd S=16: the slowest of 8 calls took"):
        res.warn_if_noisy()


def test_noisy_timing_warning_reads_as_short_lines(rng):
    """Several disturbed passes give one warning of short lines, a measurement each, with the advice said once
    (it was one line of about 300 characters per measurement, joined by semicolons)."""
    base = float(rng.uniform(0.05, 5.0))
    seqlens = sorted(int(s) for s in rng.choice(np.arange(9, 4000), size=int(rng.integers(3, 6)), replace=False))
    rows = []
    for s in seqlens:
        case = bench.Case("custom", 1, 2, 2, s, 16, False, "float32", "bshd")
        times = list(base * rng.uniform(1.0, 1.3, size=7)) + [base * BUSY_SPREAD * float(rng.uniform(2.0, 200.0))]
        rows += [bench.Row(case, name, "peer", "cpu", "fwd", times_ms=times) for name in ("naive", "torch")]
    res = bench.BenchResults(rows, {"numba_threads": 2, "cpu": "test"})
    with pytest.warns(bench.NoisyTimingWarning) as caught:
        res.warn_if_noisy()
    (warning,) = caught
    text = str(warning.message)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    for r in rows:   # every measurement keeps its label, its spread and its range
        line = next(line for line in text.splitlines() if f"{r.label}:" in line)
        assert f"{r.stats.spread:.1f}x" in line and f"{r.stats.max_ms:.3g} ms" in line, (r.label, text)
    assert text.count("rerun on an idle machine") == 1 and text.count("OpenMP") == 1, text


def test_progress_goes_through_tqdm_auto(rng, monkeypatch):
    """tqdm.auto picks a notebook widget in Jupyter and text elsewhere; the bench must ask it, not tqdm.tqdm."""
    tqdm_auto = pytest.importorskip("tqdm.auto")
    made = []

    class Recorder:
        def __init__(self, total, **kw):
            self.total, self.n = total, 0
            made.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(tqdm_auto, "tqdm", Recorder)
    bench.run("tiny", seqlen=[5, 6], backends="cpu", compare="none", grad=False, repeats=1, check=False,
              seed=_seed(rng), progress=True)
    assert len(made) == 1 and made[0].total == 2 and made[0].n == 2


def test_a_notebook_bar_leaves_its_final_state_in_text(rng, monkeypatch, capsys):
    """In Jupyter tqdm.auto gives a widget, whose text form, the one a saved notebook keeps (nbclient, GitHub and the
    docs keep no widget state), is the state it was first shown in: 0/n. The bar's end must reach the text too."""
    pytest.importorskip("ipywidgets")
    tqdm_notebook = pytest.importorskip("tqdm.notebook")
    tqdm_auto = pytest.importorskip("tqdm.auto")
    from numba_flash.bench.engine import progress_bar

    monkeypatch.setattr(tqdm_auto, "tqdm", tqdm_notebook.tqdm)
    total = int(rng.integers(3, 12))
    with progress_bar(total, enabled=True) as tick:
        for _ in range(total):
            tick()
    out, err = capsys.readouterr()
    assert f"0/{total}" in out + err        # the widget's text form, as a notebook saves it
    last = [line for line in err.splitlines() if line.strip()][-1:]
    assert last and f"{total}/{total}" in last[0], (out, err)


def test_torch_threads_are_matched_during_the_run_and_restored_after(rng, capsys):
    torch = pytest.importorskip("torch")
    import numba

    before = torch.get_num_threads()
    other = numba.get_num_threads() + 1      # anything but numba's count, so that a missing restore shows
    torch.set_num_threads(other)
    try:
        status = bench.main(["--config", "tiny", "--no-grad", "--backend", "cpu", "--compare", "torch",
                             "--repeats", "1", "--no-check", "--seed", str(_seed(rng))])
        out = capsys.readouterr().out
        assert status == 0, out
        assert f"threads: numba {numba.get_num_threads()}, torch {numba.get_num_threads()}" in out
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


def _python(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_plotting_leaves_matplotlib_s_backend_alone(tmp_path, rng):
    """In a notebook the inline backend must survive a bench run: no matplotlib.use, no pyplot figure."""
    png = tmp_path / "sweep.png"
    code = (
        "import sys, matplotlib; matplotlib.use('svg'); from numba_flash import bench; "
        f"s = bench.main(['--config', 'tiny', '--seqlen', '5,7', '--no-grad', '--backend', 'cpu', '--compare', "
        f"'none', '--repeats', '1', '--no-check', '--seed', '{_seed(rng)}', '--plot', {str(png)!r}]); "
        "assert s == 0; import matplotlib.pyplot as plt; "
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend(); assert not plt.get_fignums(); "
        "print('backend kept')")
    proc = _python("-c", code)
    assert proc.returncode == 0 and "backend kept" in proc.stdout, proc.stdout + proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_subcommands_version_and_a_named_backend_that_cannot_run(rng):
    """``numba-flash`` with bench/warmup/explain and --version; a bare flag list still means bench."""
    from numba_flash import __version__, backend_registry

    version = _python("-m", "numba_flash", "--version", timeout=60)
    assert version.returncode == 0 and version.stdout.startswith(f"numba-flash {__version__} (numba ")

    explain = _python("-m", "numba_flash", "explain", "--config", "small", "--nheads-kv", "2", "--causal",
                      timeout=60)
    assert explain.returncode == 0, explain.stderr
    assert "B=2 Sq=64 Sk=64 Hq=4 Hkv=2 D=64 causal" in explain.stdout and "chosen: cpu" in explain.stdout

    bare = _python("-m", "numba_flash", "--config", "tiny", "--no-grad", "--backend", "cpu", "--compare", "none",
                   "--repeats", "1", "--no-check", "--seed", str(_seed(rng)))
    assert bare.returncode == 0 and "case: tiny B=2" in bare.stdout, bare.stdout + bare.stderr

    if "cuda" in backend_registry.available("flash"):
        pytest.skip("this machine can run the cuda backend")
    forced = _python("-m", "numba_flash.bench", "--config", "tiny", "--no-grad", "--backend", "cpu,cuda",
                     "--compare", "none", "--repeats", "1", "--no-check")
    assert forced.returncode == 3, forced.stdout + forced.stderr
    assert "cuda named with --backend cannot run" in forced.stderr and "nothing was run" in forced.stderr
    assert "fwd S=8" not in forced.stdout      # refused before any case was timed, cpu's included
    unserved = _python("-m", "numba_flash", "explain", "--config", "tiny", "--backend", "cuda", timeout=60)
    assert unserved.returncode == 3 and "chosen: none" in unserved.stdout


def test_warmup_subcommand(rng):
    proc = _python("-m", "numba_flash", "warmup", "--dtype", "float32", "--mods")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numba's cache:" in proc.stdout and "float32: forward and backward ready in" in proc.stdout
    assert "with their variant for mods); matches the reference" in proc.stdout
    bad = _python("-m", "numba_flash", "warmup", "--dtype", "int8", timeout=60)
    assert bad.returncode == 2 and "--dtype" in bad.stderr


def test_importing_the_bench_and_the_command_stays_light():
    """numpy and numba are all ``import numba_flash.bench`` and ``numba_flash.cli`` need; the rest loads on use."""
    code = ("import sys, numba_flash.bench, numba_flash.cli, numba_flash.warmup, backends; "
            "heavy = [m for m in ('torch', 'matplotlib', 'pandas', 'tqdm', 'tabulate', 'threadpoolctl', "
            "'numba.cuda') if m in sys.modules]; assert not heavy, heavy")
    proc = _python("-c", code, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("word, hint", [("bencj", "did you mean 'bench'?"), ("explian", "did you mean 'explain'?"),
                                        ("frobnicate", "the commands are bench, warmup, explain")])
def test_a_misspelt_subcommand_is_named_with_the_closest_one(capsys, word, hint):
    """A word where the subcommand goes used to reach bench as 'unrecognized arguments'."""
    from numba_flash.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([word, "--repeats", "1"])
    assert exit_.value.code == 2
    assert f"unknown command {word!r}; {hint}" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--softcap", "-1"], "softcap: expected a finite number >= 0"),
    (["--window=-5,2"], "window_size: expected each bound >= 0, or -1 for unbounded, got (-5, 2)"),
    (["--backend", "nonexistent"], "(nonexistent: no such backend (registered: "),
    (["--array", "torch", "--device", "nonsense"], "--device nonsense: "),
])
def test_explain_turns_a_bad_option_into_one_error_line(capsys, flags, words):
    """The library's AttentionInputError and NoBackendError, and torch's refusal of a device, used to end explain in
    a traceback; bench words the same mistakes as one line with exit 2."""
    from numba_flash.cli import main

    if "torch" in flags:
        pytest.importorskip("torch")
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--config", "tiny", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "numba-flash explain: error: " in err and words in err, err
    assert "Traceback" not in err


def test_explain_takes_head_dims_the_library_takes(capsys):
    """The benchmarks stop at D = 256 (the most every backend they time supports); explain only asks the registry."""
    from numba_flash.cli import main

    assert main(["explain", "--config", "tiny", "--headdim", "300"]) == 0
    assert "D=300" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--config", "tiny", "--headdim", "600"])
    assert exit_.value.code == 2 and "headdim 600 is larger than 576, the most the library supports" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["explain", "--config", "tiny", "--casual"], "unrecognized arguments: --casual; --casual: did you mean --causal?"),
    (["--config", "tiny", "--no-grd"], "unrecognized arguments: --no-grd; --no-grd: did you mean --no-grad?"),
    (["explain", "--config", "tiny", "--zzz", "1"], "unrecognized arguments: --zzz 1\n"),
])
def test_a_misspelt_flag_names_the_closest_one(capsys, argv, words):
    """argparse (3.11) said only 'unrecognized arguments'; the flag meant is named where one is close, by the
    subcommand that got it."""
    from numba_flash.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err, err
    assert err.startswith("usage: numba-flash " + ("explain" if argv[0] == "explain" else "bench"))


def test_explain_takes_precision(capsys):
    from numba_flash.cli import main

    assert main(["explain", "--config", "tiny", "--precision", "tf32"]) == 0
    assert "precision=tf32" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["explain", "--config", "tiny", "--precision", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_bench_takes_precision_and_says_so(capsys):
    """--precision tf32 reaches the backends (a permission: the cpu backend computes float32 as before, so its
    error is float32's) and names itself in the header and the records; a mode that does not take it refuses."""
    from numba_flash import bench
    from numba_flash.cli import main

    res = bench.run("tiny", precision="tf32", backends="cpu", compare="none", repeats=1, grad=False)
    (record,) = res.records()
    assert record["precision"] == "tf32" and record["status"] == "ok" and record["max_err"] < 1e-5
    assert main(["--config", "tiny", "--precision", "tf32", "--backend", "cpu", "--compare", "none", "--repeats",
                 "1", "--no-grad"]) == 0
    assert "precision=tf32" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--decode", "--precision", "tf32"])
    assert exit_.value.code == 2
    assert "--precision tf32 applies to the plain sweep, not to --decode" in capsys.readouterr().err
    with pytest.raises(bench.BenchArgumentError, match="precision: unknown 'tf16'"):
        bench.run("tiny", precision="tf16")
