"""The asv suite really runs: ``asv check``, a quick run of the tiny config, and ``asv publish``'s dashboard.

Everything asv writes (machine file, results, html) goes to a temporary directory: the configuration is copied
there with absolute paths back to this checkout, and HOME points there so ``~/.asv-machine.json`` stays put.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_asv_check_run_publish(asv_env):
    asv(asv_env, "machine", "--yes", "--machine", MACHINE)
    check = asv(asv_env, "check", "--python=same")
    assert "No problems found" in check.stdout + check.stderr

    asv(asv_env, "run", "--python=same", "--quick", "--machine", MACHINE, "--set-commit-hash", asv_env["head"],
        "--bench", "tiny", "--show-stderr", timeout=480)

    results = list((asv_env["tmp"] / "results" / MACHINE).glob(f"{asv_env['head'][:8]}*.json"))
    assert len(results) == 1, results
    recorded = json.loads(results[0].read_text())["results"]
    for name in ("attention.Forward.time_forward", "attention.Backward.time_backward",
                 "attention.Forward.peakmem_forward", "attention.Accuracy.track_max_error_forward",
                 "attention.Accuracy.track_max_error_backward"):
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

    asv(asv_env, "publish")
    html = asv_env["tmp"] / "html"
    assert (html / "index.html").is_file()
    index = json.loads((html / "index.json").read_text())
    for name in ("attention.Forward.time_forward", "attention.Backward.time_backward",
                 "attention.Forward.peakmem_forward", "attention.GpuEvents.track_gpu_ms_forward",
                 "attention.Accuracy.track_max_error_forward", "attention.Accuracy.track_max_error_backward"):
        assert name in index["benchmarks"], name
    assert index["benchmarks"]["attention.GpuEvents.track_gpu_ms_forward"]["unit"] == "ms"
    # Each graph file is [[revision, [one value per parameter combination]], ...]: the run shows up as a point.
    graphs = [g for g in (html / "graphs").rglob("attention.Forward.time_forward.json") if "summary" not in g.parts]
    assert graphs, "no graph data written for time_forward"
    points = json.loads(graphs[0].read_text())
    assert len(points) == 1 and any(x is not None and x > 0 for x in points[0][1]), points
