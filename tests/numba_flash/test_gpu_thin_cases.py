"""tools/gpu_thin_cases.py (the thin-launch cases of tools/gpu_check.py) where it can run without a GPU: its
helpers, its wiring into gpu_check's jobs, and its skip on the cpu device."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def cases(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.syspath_prepend(str(TOOLS.parent))
    import gpu_thin_cases

    return gpu_thin_cases


def test_bits_equal_tells_bits_apart(cases):
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert cases.bits_equal(a, a.clone())
    assert not cases.bits_equal(a, torch.tensor([-0.0, 1.0, float("nan")]))   # -0.0 == 0.0, but not in bits
    assert not cases.bits_equal(a, a.double())
    assert not cases.bits_equal(a.half(), a.bfloat16())   # same width, other dtype
    d = cases.differences({"x": (a, a)}, (a, a + 1))
    assert d == {"x.0": 0.0, "x.1": 1.0}


def test_thin_toggle_restores_the_environment(cases, monkeypatch):
    monkeypatch.delenv(cases.ENV_VAR, raising=False)
    with cases.thin(True):
        assert os.environ[cases.ENV_VAR] == "1"
    assert cases.ENV_VAR not in os.environ
    monkeypatch.setenv(cases.ENV_VAR, "1")
    with cases.thin(False):
        assert os.environ[cases.ENV_VAR] == "0"
    assert os.environ[cases.ENV_VAR] == "1"


def test_per_call_us_and_the_record(cases):
    n = []
    assert cases.per_call_us(lambda: n.append(1), 10, lambda: None) >= 0
    assert len(n) == 11   # one untimed call first
    rec = cases.judge({"a": 0.0, "b": 1.0}, {"forward_thin": 3.14159})
    assert rec["ok"] is False and rec["failed"] == ["b"] and rec["host_us"] == {"forward_thin": 3.14}


def test_gpu_check_runs_the_thin_cases_and_skips_them_on_cpu(cases):
    import gpu_check

    names = [n for j in gpu_check.jobs("cuda") if j["name"].startswith("thin-") for n in j["extra"]]
    assert names == ["thin-float16", "thin-float32", "thin-bfloat16"]

    class Ctx:
        device = "cpu"

    for name in names:
        assert gpu_check.extra_case(name)(Ctx()) == {"ok": None, "skipped": "thin launch: cuda backend only"}
