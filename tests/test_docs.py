"""The README's Python examples run as written, each on its own (a reader copies one block, not the page), and
say what their comments say. The ring-attention example needs processes of its own: tests/numba_flash/
test_distributed.py runs it as written; the bench one times several sizes, which tests/numba_flash/test_bench_api.py
covers through the same API."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)
COVERED_ELSEWHERE = ("ring_attention", "bench.run")


def _examples() -> list[str]:
    return [b for b in BLOCKS if not any(word in b for word in COVERED_ELSEWHERE)]


def test_the_readme_has_the_examples_this_file_runs():
    assert len(BLOCKS) == 10 and len(_examples()) == 8


@pytest.mark.parametrize("index", range(8))
def test_example_runs_on_its_own(index):
    pytest.importorskip("torch")
    code = _examples()[index]
    scope: dict = {}
    exec(compile(code, f"README.md example {index}", "exec"), scope)   # noqa: S102
    if "merge_attention_states" in code:
        whole, whole_lse = scope["op"].forward(scope["q"], scope["k"], scope["v"], return_lse=True)
        np.testing.assert_allclose(scope["out"], whole, atol=2e-6, rtol=0)
        np.testing.assert_allclose(scope["lse"], whole_lse, atol=2e-6, rtol=0)
    if "attn_bias=bias" in code:
        assert tuple(scope["bias"].grad.shape) == (scope["Hq"], scope["S"], scope["S"])
    if "with_kvcache" in code:
        lens = scope["cache_seqlens"]
        for b in range(len(lens)):
            np.testing.assert_array_equal(scope["k_cache"][b, lens[b]], scope["k_new"][b, 0])
    if 'precision="tf32"' in code:   # a permission: the cpu backend computes float32 as without it
        assert np.array_equal(scope["out"], scope["op"].forward(scope["q"], scope["k"], scope["v"], causal=True))
    if "block_mask(" in code:
        assert scope["out"].shape == (1, 4096, 8, 64) and np.isfinite(scope["out"]).all()
