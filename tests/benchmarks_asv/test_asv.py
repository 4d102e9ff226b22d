"""The asv suite really runs: ``asv check``, a quick run of the tiny config, and ``asv publish``'s dashboard,
which after ``tools/asv_offline.py`` renders in a headless Chromium that can reach nothing but this machine.

Everything asv writes (machine file, results, html) goes to a temporary directory: the configuration is copied
there with absolute paths back to this checkout, and HOME points there so ``~/.asv-machine.json`` stays put.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
MACHINE = "numba-flash-test"

pytestmark = pytest.mark.slow

asv_util = pytest.importorskip("asv.util")


@pytest.fixture(scope="module")
def asv_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("asv")
    conf = asv_util.load_json(str(REPO / "asv.conf.json"), js_comments=True)
    assert conf["benchmark_dir"] == "benchmarks_asv"
    assert conf["launch_method"] == "spawn"
    assert conf["environment_type"] == "virtualenv"
    assert "torch" in conf["matrix"]["req"]
    conf.update(repo=str(REPO), benchmark_dir=str(REPO / "benchmarks_asv"), env_dir=str(tmp / "env"),
                results_dir=str(tmp / "results"), html_dir=str(tmp / "html"),
                # The commit being tested may sit on any branch, or none (a CI checkout): publish follows HEAD.
                branches=["HEAD"])
    conf_path = tmp / "asv.conf.json"
    conf_path.write_text(json.dumps(conf, indent=1))
    env = dict(os.environ, HOME=str(tmp), NUMBA_FLASH_ASV_CONFIGS="tiny")
    env.pop("NUMBA_FLASH_ASV_FULL", None)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    return {"tmp": tmp, "conf": str(conf_path), "env": env, "head": head.stdout.strip()}


def asv(env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asv", *args, "--config", env["conf"]]
    proc = subprocess.run(cmd, cwd=env["tmp"], env=env["env"], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def published(asv_env):
    """``asv check``, a quick run of the tiny config and ``asv publish``, once for the tests below."""
    asv(asv_env, "machine", "--yes", "--machine", MACHINE)
    check = asv(asv_env, "check", "--python=same")
    assert "No problems found" in check.stdout + check.stderr
    asv(asv_env, "run", "--python=same", "--quick", "--machine", MACHINE, "--set-commit-hash", asv_env["head"],
        "--bench", "tiny", "--show-stderr", timeout=480)
    asv(asv_env, "publish")
    return asv_env


def test_asv_check_run_publish(published):
    asv_env = published
    results = list((asv_env["tmp"] / "results" / MACHINE).glob(f"{asv_env['head'][:8]}*.json"))
    assert len(results) == 1, results
    recorded = json.loads(results[0].read_text())["results"]
    for name in ("attention.Forward.time_forward", "attention.Backward.time_backward",
                 "attention.Memory.track_peak_memory_forward", "attention.Memory.track_peak_memory_backward",
                 "attention.Accuracy.track_max_error_forward", "attention.Accuracy.track_max_error_backward"):
        assert name in recorded, f"{name} missing from {sorted(recorded)}"
    # The registry's cpu backend and the numpy/torch peers give numbers; a backend this machine lacks is a
    # parameter all the same and skips cleanly: NaN (skipped), not None (failed).
    values = recorded["attention.Forward.time_forward"][0]
    params = recorded["attention.Forward.time_forward"][1]
    assert params[0] == ["'tiny'"] and params[2] == ["False", "True"]
    backends = [b.strip("'") for b in params[1]]
    assert backends == ["cpu", "cuda", "rocm", "numpy_naive", "torch_sdpa"]
    per_backend = len(params[2]) * len(params[3])
    by_backend = {b: values[i * per_backend:(i + 1) * per_backend] for i, b in enumerate(backends)}
    for name in ("cpu", "numpy_naive"):
        timed = [x for x in by_backend[name] if x is not None and x == x]
        assert timed and all(0 < x < 10 for x in timed), (name, by_backend[name])
    for name, device_node in (("cuda", "/dev/nvidiactl"), ("rocm", "/dev/kfd")):
        if not os.path.exists(device_node):
            assert all(x is not None and x != x for x in by_backend[name]), (name, by_backend[name])
    errors = recorded["attention.Accuracy.track_max_error_forward"]
    by_backend = {b: errors[0][i * per_backend:(i + 1) * per_backend] for i, b in enumerate(backends)}
    for name in ("cpu", "numpy_naive"):
        assert all(x is not None and 0 <= x < 1e-4 for x in by_backend[name]), (name, by_backend[name])
    # The call's own memory: a tiny forward allocates well under a few MiB (asv's peakmem_ reported the whole
    # process, about 150 MiB of imports).
    memory = recorded["attention.Memory.track_peak_memory_forward"][0]
    by_backend = {b: memory[i * per_backend:(i + 1) * per_backend] for i, b in enumerate(backends)}
    for name in ("cpu", "numpy_naive"):
        assert all(x is not None and 0 <= x < 8 * 2**20 for x in by_backend[name]), (name, by_backend[name])

    html = asv_env["tmp"] / "html"
    assert (html / "index.html").is_file()
    index = json.loads((html / "index.json").read_text())
    for name in ("attention.Forward.time_forward", "attention.Backward.time_backward",
                 "attention.Memory.track_peak_memory_forward", "attention.GpuEvents.track_gpu_ms_forward",
                 "attention.Accuracy.track_max_error_forward", "attention.Accuracy.track_max_error_backward"):
        assert name in index["benchmarks"], name
    assert index["benchmarks"]["attention.GpuEvents.track_gpu_ms_forward"]["unit"] == "ms"
    # The decode and varlen benchmarks are discovered (``asv check`` imported them); the tiny run does not time them.
    for name in ("inference.Decode.time_decode", "inference.Decode.track_frac_of_copy",
                 "inference.Decode.track_max_error", "inference.Varlen.time_forward",
                 "inference.VarlenRatio.track_work_time_vs_dense"):
        assert name in index["benchmarks"], name
    assert index["benchmarks"]["inference.Decode.track_frac_of_copy"]["unit"] == "fraction of copy bandwidth"
    assert index["benchmarks"]["attention.Memory.track_peak_memory_forward"]["unit"] == "bytes"
    # Each graph file is [[revision, [one value per parameter combination]], ...]: the run shows up as a point.
    graphs = [g for g in (html / "graphs").rglob("attention.Forward.time_forward.json") if "summary" not in g.parts]
    assert graphs, "no graph data written for time_forward"
    points = json.loads(graphs[0].read_text())
    assert len(points) == 1 and any(x is not None and x > 0 for x in points[0][1]), points


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser: Debian's chromium is not installed (apt-get install chromium; `make "
                "install` installs it when run as root with apt-get)")


@contextlib.contextmanager
def _serve(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on the loopback interface (asv's page fetches its JSON, which file:// forbids)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _rendered(browser: str, url: str, profile: Path) -> str:
    """The page's DOM after its scripts ran, in a browser that can reach nothing but the loopback address."""
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                           "--virtual-time-budget=15000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_dashboard_renders_offline_after_vendoring(published, tmp_path):
    """Offline, asv's page as published cannot load jQuery and shows asv's error page; after the vendoring step
    the benchmark grid and a benchmark's graph draw, with the run's data on their axes."""
    browser = _chromium()
    html = tmp_path / "html"
    shutil.copytree(published["tmp"] / "html", html)
    with _serve(html) as base:
        before = _rendered(browser, f"{base}/index.html", tmp_path / "profile0")
    assert "continental origin of swallow" in before and "flot-base" not in before

    proc = subprocess.run([sys.executable, str(REPO / "tools" / "asv_offline.py"), str(html)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 file(s) vendored" in proc.stdout
    page = (html / "index.html").read_text()
    assert not re.search(r"<(script|link)[^>]*(src|href)=\"https?://", page), "a CDN address is left in the page"
    assert (html / "vendor" / "bootstrap-3.1.1" / "dist" / "fonts" / "glyphicons-halflings-regular.woff").is_file()

    # Opened from disk, as docs/guide/bench.md tells users to (a served page fetched its JSON; from file:// the
    # browser refused and asv showed "Error fetching content").
    base = (html / "index.html").as_uri()
    grid = _rendered(browser, base, tmp_path / "profile1")
    graph = _rendered(browser, f"{base}#attention.Forward.time_forward", tmp_path / "profile2")
    assert "continental origin of swallow" not in grid and "Error fetching content" not in grid
    assert grid.count('class="flot-base"') >= 4, grid[-3000:]          # the summary grid's small graphs
    assert 'class="flot-base"' in graph and "backend-cpu" in graph     # the graph and its legend
    ticks = [float(t) for t in re.findall(r'class="flot-tick-label[^>]*>([-+0-9.e]+)<', graph)]
    assert ticks and max(ticks) > 0, ticks     # the y axis is scaled to the recorded times


def test_vendoring_refuses_a_cdn_address_it_does_not_know(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import asv_offline
    finally:
        sys.path.remove(str(REPO / "tools"))
    (tmp_path / "index.html").write_text('<script src="https://cdn.example.org/lib/9.9/newthing.min.js"></script>')
    with pytest.raises(asv_offline.OfflineError, match="newthing.min.js, which tools/asv_offline.py does not know"):
        asv_offline.make_offline(tmp_path, cache=tmp_path / "cache")
    with pytest.raises(asv_offline.OfflineError, match="run `asv publish` first"):
        asv_offline.make_offline(tmp_path / "nowhere", cache=tmp_path / "cache")
