"""Every exception a mod raises becomes AttentionInputError naming the mod, its exception and where (issue 47,
finding 3): not only IndexError, ValueError and ArithmeticError, which were the only ones caught, so that a
RuntimeError, AssertionError or KeyError came out raw (with the kernel's SystemError as its context)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import AttentionInputError, backend_registry
from numba_flash.mods import block_mask

torch = pytest.importorskip("torch")


def _raises_runtime(b, h, q_idx, kv_idx):
    if q_idx == 3 and kv_idx == 2:
        raise RuntimeError("no such document")
    return kv_idx <= q_idx


def _fails_assertion(b, h, q_idx, kv_idx):
    if kv_idx >= 4:   # what `assert kv_idx < 4` raises (pytest rewrites asserts here into what numba cannot compile)
        raise AssertionError("kv_idx < 4")
    return True


MODS = {"RuntimeError": _raises_runtime, "AssertionError": _fails_assertion}


@pytest.mark.parametrize("error", MODS)
@pytest.mark.parametrize("backend", ["cpu", "rocm"])
def test_a_mask_mod_that_raises_is_named(backend, error, rng):
    q, k, v = (rng.standard_normal((1, 7, 2, 8)).astype(np.float32) for _ in range(3))
    with pytest.raises(AttentionInputError, match=f"mask_mod: .*{MODS[error].__name__} raised {error}"):
        backend_registry.get("flash").forward(q, k, v, mask_mod=MODS[error], backend=backend)


@pytest.mark.parametrize("error", MODS)
def test_block_mask_names_a_mask_mod_that_raises(error):
    with pytest.raises(AttentionInputError, match=f"^mask_mod: .*{MODS[error].__name__} raised {error}"):
        block_mask(MODS[error], 1, 1, 7, 7)


def test_the_torch_path_names_the_block_and_the_element(rng):
    """backend="rocm" evaluates the mods per block on the host: the message says which block and which element."""
    q, k, v = (rng.standard_normal((2, 7, 3, 8)).astype(np.float32) for _ in range(3))
    with pytest.raises(AttentionInputError, match=r"_raises_runtime raised RuntimeError: no such document \(at b=0, "
                                                  r"h=0, q_idx=3, kv_idx=2, in the block of queries 0\.\.6 x keys "
                                                  r"0\.\.6, b 0\.\.1, h 0\.\.2\)"):
        backend_registry.get("flash").forward(q, k, v, mask_mod=_raises_runtime, backend="rocm")


def test_block_mask_names_the_tile():
    with pytest.raises(AttentionInputError, match=r"_fails_assertion raised AssertionError: kv_idx < 4 \(in the "
                                                  r"tile of queries 0\.\.2 x keys 3\.\.5 of b=0, h=0\)"):
        block_mask(_fails_assertion, 1, 2, 7, 9, block_m=3, block_n=3)
