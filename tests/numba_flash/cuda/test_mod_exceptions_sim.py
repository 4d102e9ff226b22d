"""A mod that raises inside a CUDA kernel run by the simulator (issue 47, finding 3): an AttentionInputError naming
the mod, its exception, the element, the kernel and its block, as on the host paths, rather than the simulator's
raw exception (an IndexError from a table read out of range, whatever the mod raised). On a real GPU nothing comes
back from a mod (numba_flash/mods.py's docstring says how to check one on the host first).

Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import AttentionInputError, backend_registry

pytestmark = pytest.mark.cudasim

DOCS = np.array([0, 0, 1, 1, 1], np.int64)   # 5 document ids for 7 positions: a read past the end at 5 and 6


def short_table(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx]


def raises_runtime(b, h, q_idx, kv_idx):
    if q_idx == 4 and kv_idx == 2:
        raise RuntimeError("no such document")
    return kv_idx <= q_idx


@pytest.mark.parametrize("mod, raised", [(short_table, r"IndexError: index [56] is out of bounds for axis 0 with "
                                                       r"size 5"),
                                         (raises_runtime, r"RuntimeError: no such document")])
def test_a_mask_mod_that_raises_in_a_kernel_is_named(rng, mod, raised):
    q, k, v = (rng.standard_normal((2, 7, 2, 8)).astype(np.float32) for _ in range(3))
    before = [x.copy() for x in (q, k, v)]
    with pytest.raises(AttentionInputError, match=rf"^mask_mod: expected a function that runs on every \(b, h, q_idx, "
                                                  rf"kv_idx\) of the call; {mod.__name__} raised {raised} \(at b=\d, "
                                                  rf"h=\d, q_idx=\d, kv_idx=\d, in block \(\d, \d, \d\) of the \w+ "
                                                  rf"kernel: queries \d\.\.\d of b=\d, h=\d\)$") as info:
        backend_registry.get("flash").forward(q, k, v, mask_mod=mod, backend="cuda")
    assert "tid=" not in str(info.value)   # the simulator's prefix is not the mod's message
    if mod is raises_runtime:
        assert "at b=0, h=0, q_idx=4, kv_idx=2, in block (0, 0, 0) of the " in str(info.value)
    for x, y in zip((q, k, v), before):
        np.testing.assert_array_equal(x, y)
