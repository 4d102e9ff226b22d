"""tools/gpu_check.py's error column, tested on the CPU (the tool itself needs a GPU for its timings): in float16 and
bfloat16 the max error of any output is the rounding of the float64 result to that dtype, so the summary printed one
number for ours and torch's (docs/gpu-runs/2026-11-27-h200); it now shows that floor and the relative L2 errors,
which tell the two apart (issue 47, finding 7)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def gpu_check():
    sys.path.insert(0, str(TOOLS))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(TOOLS))
    return gpu_check


def test_summary_shows_the_rounding_floor_and_errors_that_differ(gpu_check, tmp_path):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    ours = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(torch.bfloat16)  # rounded once
    theirs = F.scaled_dot_product_attention(q, k, v)                                          # bfloat16 inside
    rec = dict(kind="perf", dtype="bfloat16", D=64, S=256, B=1, H=2, causal=False, fwd_tflop=1e-3)
    gpu_check.errors(rec, "ours", ours, ref)
    gpu_check.errors(rec, "torch", theirs, ref)
    gpu_check.errors(rec, "rounding", ref.to(torch.bfloat16), ref)
    # What made the old column useless: the max errors are the rounding floor, all three alike.
    assert rec["ours_out_max_abs"] == rec["torch_out_max_abs"] == rec["rounding_out_max_abs"]
    assert rec["torch_out_rel_l2"] > 1.2 * rec["ours_out_rel_l2"]
    assert rec["ours_out_rel_l2"] == pytest.approx(rec["rounding_out_rel_l2"], rel=1e-3)
    (tmp_path / "results.jsonl").write_text(json.dumps(rec) + "\n")
    line = next(x for x in gpu_check.summary(str(tmp_path)).splitlines() if x.startswith("bfloat16"))
    expect = (f"rel l2 {rec['ours_out_rel_l2']:.2e} vs torch {rec['torch_out_rel_l2']:.2e} "
              f"(rounding {rec['rounding_out_rel_l2']:.2e})")
    assert expect in line, line
    assert f"(rounding {rec['rounding_out_max_abs']:.2e})" in line, line
