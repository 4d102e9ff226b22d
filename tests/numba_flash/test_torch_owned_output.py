"""``torch_common.owned_output``: an op's output never shares memory with its inputs (a backend that hands back an
input, or a view of one, gets it cloned), with the inputs' storages computed per call or handed in once
(``storage_pointers``) for several outputs of one call."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numba_flash.torch_common import owned_output, storage_pointers  # noqa: E402


@pytest.mark.parametrize("handed_in", [False, True])
def test_an_output_that_is_an_input_or_a_view_of_one_is_cloned(rng, handed_in):
    q, k = (torch.from_numpy(rng.standard_normal((3, 5, 7)).astype(np.float32)) for _ in range(2))
    inputs = (q, k)
    storages = storage_pointers(inputs) if handed_in else None
    fresh = torch.from_numpy(rng.standard_normal((3, 5, 7)).astype(np.float32))
    for given in (q, k[1:], k.transpose(0, 1)):
        got = owned_output(given, q, torch.float32, inputs, storages)
        assert torch.equal(got, given)
        assert got.is_contiguous()
        assert all(got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for x in inputs)
    assert owned_output(fresh, q, torch.float32, inputs, storages) is fresh   # nothing to copy
    widened = owned_output(fresh, q, torch.float64, inputs, storages)
    assert widened.dtype == torch.float64 and torch.equal(widened, fresh.double())
