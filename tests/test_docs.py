"""The documentation: the site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, so a broken link or anchor,
a page missing from the nav or a docstring the API reference cannot read fails here; and every Python example in
README.md and on the pages runs as written, each on its own (a reader copies one block, not the page), and does
what its comments say. The ring-attention example needs processes of its own: tests/numba_flash/
test_distributed.py runs it as written; the bench ones time several sizes, which tests/numba_flash/
test_bench_api.py covers through the same API. An example on a GPU's tensors runs only where torch sees a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The pages mkdocs builds (docs/gpu-runs/ is raw output, excluded in mkdocs.yml), and the README.
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if "gpu-runs" not in p.parts)
NOT_RUN_HERE = {
    "ring_attention": "needs a process group: tests/numba_flash/test_distributed.py runs it as written",
    "bench.run": "times several sizes: tests/numba_flash/test_bench_api.py covers bench.run",
}
# How many Python blocks each page holds: an example dropped or moved by an edit shows here rather than by a
# test that quietly stopped running it.
EXPECTED = {
    "README.md": 2,
    "docs/AMD.md": 1,
    "docs/BENCHMARKING.md": 1,
    "docs/guide/basics.md": 3,
    "docs/guide/bench.md": 2,
    "docs/guide/bias-and-mods.md": 3,
    "docs/guide/cuda.md": 1,
    "docs/guide/kvcache.md": 2,
    "docs/guide/packed-sequences.md": 2,
    "docs/guide/ring-attention.md": 2,
}


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        blocks = re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)
        found += [(f"{name} example {i}", code) for i, code in enumerate(blocks)]
    return found


BLOCKS = _blocks()


def test_the_pages_hold_the_examples_this_file_runs():
    counts: dict[str, int] = {}
    for label, _ in BLOCKS:
        page = label.rsplit(" example ", 1)[0]
        counts[page] = counts.get(page, 0) + 1
    assert counts == EXPECTED
    # Each check below is keyed on what its example says; each must still find its example.
    for key in ("merge_attention_states", "attn_bias=bias", "with_kvcache", 'precision="tf32"', "block_mask(",
                "cu_seqlens_q", 'device="cuda"', "check_mods_on_host", "host_overhead.measure", "block_table=",
                "plan.run(", "plan_kvcache("):
        assert any(key in code for _, code in BLOCKS), key


@pytest.mark.parametrize("label, code", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_example_runs_on_its_own(label, code):
    for word, why in NOT_RUN_HERE.items():
        if word in code:
            pytest.skip(why)
    torch = pytest.importorskip("torch") if "torch" in code else None
    if 'device="cuda"' in code and not torch.cuda.is_available():
        pytest.skip("needs a GPU torch can see")
    scope: dict = {}
    exec(compile(code, label, "exec"), scope)   # noqa: S102
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
    if "check_mods_on_host" in code:   # the table read past its end is named, as the comment says
        assert "same_doc raised IndexError" in str(scope["problem"]) and "kv_idx=250" in str(scope["problem"])
    if "plan.run(" in code:   # the last step's bits are forward's; the other shape was refused by name
        q, k, v = scope["q"], scope["k"], scope["v"]
        np.testing.assert_array_equal(scope["out"], scope["op"].forward(q, k, v, causal=True))
        assert scope["refused"].startswith("q: expected the planned array, a numpy.ndarray of shape (1, 96, 8, 64)")
    if "plan_kvcache(" in code:   # each step appended at its lens; the overflowing one was refused by name
        for b in range(len(scope["lens"])):
            np.testing.assert_array_equal(scope["k_cache"][b, scope["lens"][b] - 1], scope["k_new"][b, 0])
        assert scope["out"].shape == (2, 1, 8, 64) and scope["refused"].startswith("cache_seqlens: expected room")
    if "block_table=" in code:   # paged keys: the gradients are paged like the caches
        assert scope["dk"].shape == scope["k_cache"].shape and scope["dv"].shape == scope["v_cache"].shape
    elif "cu_seqlens_q" in code:   # the comment's shapes
        assert scope["out"].shape == (1217, 8, 64) and scope["lse"].shape == (8, 1217)
        assert scope["dq"].shape == scope["q"].shape


def test_the_site_builds_with_no_warning(tmp_path):
    """mkdocs --strict into a temporary folder; the API reference reads the docstrings without importing the
    package, and nothing is fetched from the network."""
    pytest.importorskip("mkdocs", reason="the 'docs' extra (make install installs it)")
    pytest.importorskip("mkdocstrings", reason="the 'docs' extra (make install installs it)")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    # mkdocstrings leaves out, without a warning, a member the page names but the module no longer has (renamed,
    # moved): every object an API page names must have its entry on the built page.
    for source in sorted((ROOT / "docs" / "api").glob("*.md")):
        html = (site / "api" / ("" if source.stem == "index" else source.stem) / "index.html").read_text()
        for name in _documented(source.read_text()):
            assert f'id="{name}"' in html, (source.name, name)
    # The API reference holds the functions' documented arguments, not just their headings.
    torch_page = (site / "api" / "torch" / "index.html").read_text()
    for text in ("cu_seqlens_q", "dropout_p", "cache_seqlens"):
        assert text in torch_page, text


def _documented(page: str) -> list[str]:
    """The objects an API page names: each `::: module.object` line, and the members listed under it."""
    names = []
    for block in re.split(r"^(?=::: )", page, flags=re.M)[1:]:
        target = block.split()[1]
        names.append(target)
        names += [f"{target}.{m}" for m in re.findall(r"^ {8}- (\w+)$", block, flags=re.M)]
    return names
