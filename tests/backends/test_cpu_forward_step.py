"""The cpu backend's prepared forward (``CpuBackend.forward_step``), which an ``AttentionPlan`` runs its calls on:
served exactly where its plan-time decisions cannot change between calls (a tiny forward on float32 / float64
numpy arrays or plain CPU tensors), and on those a plan's loop gives the bits of ``op.forward`` on the same arrays
and the float64 reference's values, in every layout, with ALiBi, leaving the inputs as they were.

Sizes are odd on purpose: B = 2, Sq = 3, Sk = 11, Hq = 6, Hkv = 2 (grouped-query), D = 20, Dv = 12.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry
from backends.cpu import CpuBackend
from numba_flash import attention_ref
from numba_flash.validation import validate_forward

B, SQ, SK, HQ, HKV, D, DV, CALLS = 2, 3, 11, 6, 2, 20, 12, 3


def _arrays(rng, dtype=np.float32, sk=SK):
    return (rng.standard_normal((B, SQ, HQ, D)).astype(dtype), rng.standard_normal((B, sk, HKV, D)).astype(dtype),
            rng.standard_normal((B, sk, HKV, DV)).astype(dtype))


def _served(q, k, v, **options) -> bool:
    return CpuBackend().forward_step(validate_forward(q, k, v, **options)) is not None


def test_it_serves_tiny_host_forwards_and_leaves_the_rest_to_forward(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _arrays(rng)
    assert _served(q, k, v)
    assert _served(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    assert _served(*(torch.from_numpy(x) for x in (q, k, v)), window_size=(3, 1))
    assert not _served(*(x.astype(np.float16) for x in (q, k, v)))   # widened every call
    assert not _served(*(torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)))
    assert not _served(*(torch.nn.Parameter(torch.from_numpy(x)) for x in (q, k, v)))   # a subclass
    assert not _served(q, k, v, attn_bias=rng.standard_normal((SQ, SK)).astype(np.float32))
    assert not _served(q, k, v, dropout_p=0.1, dropout_seed=3)
    assert not _served(*_arrays(rng, sk=4096))   # past the tiny bound: the tiled kernels


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "strided"])
def test_a_plans_loop_gives_forwards_bits_and_the_reference(rng, monkeypatch, kind, dtype, layout):
    served = []
    prepare = CpuBackend.forward_step

    def counting(self, call):
        step = prepare(self, call)
        return None if step is None else (lambda **arrays: served.append(1) or step(**arrays))
    monkeypatch.setattr(CpuBackend, "forward_step", counting)
    wrap = pytest.importorskip("torch").from_numpy if kind == "torch" else np.asarray
    op = backend_registry.get("flash", backend="cpu")
    slopes = rng.uniform(0.1, 1.0, HQ).astype(np.float32)
    options = dict(causal=True, softcap=3.0, alibi_slopes=wrap(slopes), return_lse=True,
                   layout="bhsd" if layout == "bhsd" else "bshd")
    plan = None
    for call in range(CALLS):
        arrays = _arrays(rng, dtype)
        if layout == "bhsd":
            arrays = tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in arrays)
        elif layout == "strided":   # every other element of the head dim: no array is contiguous
            arrays = tuple(np.repeat(x, 2, axis=-1)[..., ::2] for x in arrays)
        q, k, v = (wrap(x) for x in arrays)
        given = [np.array(x, copy=True) for x in arrays]
        if plan is None:
            plan = op.plan(q, k, v, **options)
        got = plan.run(q, k, v)
        assert len(served) == call + 1   # the prepared forward served it
        want = op.forward(q, k, v, **options)
        for g, w in zip(got, want, strict=True):
            assert type(g) is type(w) and g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        for x, was in zip(arrays, given):
            np.testing.assert_array_equal(x, was)
        ref = [x.transpose(0, 2, 1, 3) if layout == "bhsd" else x for x in arrays]
        ref_out, ref_lse = attention_ref(*(x.astype(np.float64) for x in ref), causal=True, softcap=3.0,
                                         alibi_slopes=slopes)
        out = np.asarray(got[0])
        out = out.transpose(0, 2, 1, 3) if layout == "bhsd" else out
        tol = 2e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(out, ref_out, atol=tol, rtol=0)
        seen = np.isfinite(ref_lse)
        np.testing.assert_allclose(np.asarray(got[1])[seen], ref_lse[seen], atol=tol, rtol=tol)


def test_a_subclass_that_overrides_forward_gets_no_prepared_step(rng):
    class Own(CpuBackend):
        def forward(self, call):
            return super().forward(call)

    call = validate_forward(*_arrays(rng))
    assert CpuBackend().forward_step(call) is not None and Own().forward_step(call) is None
