"""``precision``: "ieee" (the default) or "tf32", accepted by the registry's forward, backward and explain on every
backend. "tf32" is a permission (torch's allow_tf32): the cuda backend runs float32 forwards on its TF32 kernel
(tests/numba_flash/cuda/test_tf32_forward_sim.py); backends without one compute float32 in float32, so their
results are bitwise the default's. Anything else is refused naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import AttentionInputError, attention_ref, backend_registry
from numba_flash.validation import validate_forward

BACKENDS = ["cpu", "rocm"]


def _inputs(rng, dtype=np.float32):
    q = rng.standard_normal((2, 19, 4, 24)).astype(dtype)
    k, v = (rng.standard_normal((2, 27, 2, 24)).astype(dtype) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape).astype(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tf32_is_a_permission_where_no_tf32_kernel_runs(rng, backend):
    if backend == "rocm":
        pytest.importorskip("torch")
    q, k, v, dout = _inputs(rng)
    copies = [x.copy() for x in (q, k, v, dout)]
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, causal=True, return_lse=True)
    out_tf32, lse_tf32 = op.forward(q, k, v, causal=True, return_lse=True, precision="tf32")
    assert np.array_equal(out, out_tf32) and np.array_equal(lse, lse_tf32)
    grads = op.backward(dout, q, k, v, out, lse, causal=True)
    grads_tf32 = op.backward(dout, q, k, v, out, lse, causal=True, precision="tf32")
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads_tf32))
    ref, _ = attention_ref(q.astype(np.float64), k, v, causal=True)
    assert np.linalg.norm(out_tf32 - ref) <= 1e-6 * np.linalg.norm(ref)   # float32, not TF32's 1e-3 or so
    assert all(np.array_equal(x, c) for x, c in zip((q, k, v, dout), copies))
    text = str(op.explain(q, k, v, causal=True, precision="tf32"))
    assert "precision=tf32" in text and f"chosen: {backend}" in text


@pytest.mark.parametrize("bad", ["TF32", "fp32", "", None, 32, True])
def test_a_bad_precision_is_refused_naming_it(rng, bad):
    q, k, v, dout = _inputs(rng)
    op = backend_registry.get("flash")
    with pytest.raises(AttentionInputError, match=r"^precision: expected 'ieee' or 'tf32', got "):
        op.forward(q, k, v, precision=bad)
    with pytest.raises(AttentionInputError, match=r"^precision: expected 'ieee' or 'tf32', got "):
        op.explain(q, k, v, precision=bad)
    out, lse = op.forward(q, k, v, return_lse=True)
    with pytest.raises(AttentionInputError, match=r"^precision: expected 'ieee' or 'tf32', got "):
        op.backward(dout, q, k, v, out, lse, precision=bad)


def test_the_call_carries_it_and_says_so(rng):
    q, k, v, _ = _inputs(rng)
    assert validate_forward(q, k, v).precision == "ieee"
    call = validate_forward(q, k, v, precision="tf32")
    assert call.precision == "tf32" and "precision=tf32" in call.describe()
    assert "precision" not in validate_forward(q, k, v).describe()


@pytest.mark.parametrize("with_mods", [False, True])
def test_flash_attn_func_takes_it_through_autograd(rng, with_mods):
    """flash_attn_func passes precision to the forward op (and, with mods, to the registry's forward and backward):
    on the CPU the same bits and gradients as without it; a bad value refused before anything runs."""
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_func

    q, k, v, dout = (torch.from_numpy(x) for x in _inputs(rng))
    extra = dict(score_mod=lambda score, b, h, i, j: score * 0.5,
                 score_mod_grad=lambda score, b, h, i, j: 0.5) if with_mods else {}
    runs = []
    for precision in ("ieee", "tf32"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_attn_func(*leaves, causal=True, precision=precision, **extra)
        out.backward(dout)
        runs.append([out.detach()] + [x.grad for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(AttentionInputError, match=r"^precision: expected 'ieee' or 'tf32', got 'fast'"):
        flash_attn_func(q, k, v, precision="fast", **extra)


def test_flash_attn_varlen_func_takes_it_too(rng):
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    cu = torch.tensor([0, 5, 5, 19], dtype=torch.int32)
    q, k, v = (torch.from_numpy(rng.standard_normal((19, 2, 16)).astype(np.float32)) for _ in range(3))
    runs = []
    for precision in ("ieee", "tf32"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu, cu, 14, 14, causal=True, precision=precision)
        out.sum().backward()
        runs.append([out.detach()] + [x.grad for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(AttentionInputError, match=r"^precision: expected 'ieee' or 'tf32', got 1"):
        flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, precision=1)
