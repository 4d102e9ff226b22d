"""flash_attn_func: autograd through the registry (gradcheck in float64), the custom ops under torch.compile,
and the handling of requires_grad, non-contiguous and bad inputs, on the CPU and ROCm (torch) backends."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends import backend_registry  # noqa: E402
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, flash_attn_func  # noqa: E402
from numba_flash.torch_api import flash_bwd, flash_fwd  # noqa: E402

BACKENDS = ["rocm", "cpu"]


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)


def _shape(b, s, h, d, layout):
    return (b, s, h, d) if layout == "bshd" else (b, h, s, d)


def _qkv(rng, b, sq, sk, hq, hkv, d, layout="bshd", dtype=torch.float32, requires_grad=False):
    shapes = (_shape(b, sq, hq, d, layout), _shape(b, sk, hkv, d, layout), _shape(b, sk, hkv, d, layout))
    return [torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_(requires_grad) for s in shapes]


def _rel_l2(got, want):
    return float(np.linalg.norm(got.detach().double().numpy() - want) / np.linalg.norm(want))


GRADCHECK_CASES = {
    "gqa_causal_sq_lt_sk": dict(shape=(1, 5, 8, 4, 2, 3), kw=dict(causal=True)),
    "mqa_causal_sq_gt_sk_bhsd": dict(shape=(1, 7, 4, 2, 1, 4), kw=dict(causal=True, layout="bhsd")),
    "window_softcap_scale": dict(shape=(2, 6, 6, 2, 2, 3),
                                 kw=dict(window_size=(2, 1), softcap=1.5, softmax_scale=0.7)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", GRADCHECK_CASES.values(), ids=GRADCHECK_CASES.keys())
def test_gradcheck_float64(rng, backend, case):
    b, sq, sk, hq, hkv, d = case["shape"]
    kw = case["kw"]
    q, k, v = _qkv(rng, b, sq, sk, hq, hkv, d, kw.get("layout", "bshd"), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, backend=backend, **kw), (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_float32_forward_backward_match_reference(rng, backend, layout):
    kw = dict(causal=True, window_size=(9, -1), softcap=4.0, layout=layout)
    q, k, v = _qkv(rng, 2, 29, 37, 6, 2, 20, layout, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, return_lse=True, backend=backend, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    assert out.dtype == torch.float32 and out.shape == q.shape and out.requires_grad
    assert lse.dtype == torch.float32 and lse.shape == (2, 6, 29) and not lse.requires_grad
    assert np.abs(out.detach().numpy() - ref_out).max() <= 1e-5
    assert np.abs(lse.numpy() - ref_lse).max() <= 1e-5
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    out.backward(dout)
    for name, x, want in zip("qkv", (q, k, v), attention_ref_backward(dout, q, k, v, **kw)):
        assert x.grad.shape == x.shape, name
        assert _rel_l2(x.grad, want) <= 1e-5, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_and_sum_loss(rng, backend):
    """Strided views as inputs, and out.sum() as the loss, whose gradient arrives as a stride-0 broadcast."""
    base_q = torch.from_numpy(rng.standard_normal((2, 4, 19, 8))).float()
    base_kv = torch.from_numpy(rng.standard_normal((2, 30, 4, 8))).float()
    q = base_q.transpose(1, 2).requires_grad_()                # (2, 19, 4, 8) view
    k = base_kv[:, 2:25, 1::2].clone().requires_grad_()
    v = base_kv.flip(1)[:, :23, ::2]                           # non-leaf view: no grad wanted
    assert not (q.is_contiguous() or v.is_contiguous())
    out = flash_attn_func(q, k, v, causal=True, backend=backend)
    out.sum().backward()
    dout = np.ones(q.shape)
    ref_out, _ = attention_ref(q, k, v, causal=True)
    ref_dq, ref_dk, _ = attention_ref_backward(dout, q, k, v, causal=True)
    assert np.abs(out.detach().numpy() - ref_out).max() <= 1e-5
    assert _rel_l2(q.grad, ref_dq) <= 1e-5 and _rel_l2(k.grad, ref_dk) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_never_modified(rng, backend):
    q, k, v = _qkv(rng, 1, 11, 13, 4, 2, 6, requires_grad=True)
    before = [x.detach().clone() for x in (q, k, v)]
    flash_attn_func(q, k, v, causal=True, backend=backend).square().sum().backward()
    for x, x0 in zip((q, k, v), before):
        assert torch.equal(x.detach(), x0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_aot_eager(rng, backend):
    q, k, v = _qkv(rng, 1, 17, 23, 4, 2, 8, requires_grad=True)

    def loss(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, softcap=3.0, backend=backend)
        return (out * out).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v)
    got.backward()
    got_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = loss(q, k, v)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    for g, x in zip(got_grads, (q, k, v)):
        assert torch.allclose(g, x.grad, rtol=1e-6, atol=1e-7)
    # and both match the reference: d loss / d out = 2 out
    ref_out, _ = attention_ref(q, k, v, causal=True, softcap=3.0)
    want_ref = float((ref_out ** 2).sum())
    assert abs(got.detach().item() - want_ref) <= 1e-5 * want_ref
    ref_grads = attention_ref_backward(2 * ref_out, q, k, v, causal=True, softcap=3.0)
    for name, g, want_g in zip("qkv", got_grads, ref_grads):
        assert _rel_l2(g, want_g) <= 1e-5, name


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_custom_ops_pass_opcheck(rng, layout):
    """Schema, fake implementations (shapes, dtypes, strides) and AOT dispatch agree with the real ops, for
    contiguous inputs and for permuted ones whose empty_like would not be contiguous."""
    q, k, v = _qkv(rng, 2, 9, 12, 4, 2, 5, layout)
    permuted = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    for qq, kk, vv in ((q, k, v), permuted):
        args = (qq, kk, vv, True, None, -1, 0, 0.0, layout, "rocm")
        torch.library.opcheck(flash_fwd, args)
        out, lse = flash_fwd(*args)
        dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
        torch.library.opcheck(flash_bwd, (dout, qq, kk, vv, out, lse, True, None, -1, 0, 0.0, layout, "rocm"))


def test_float64_lse_dtype_and_half_output(rng):
    q, k, v = _qkv(rng, 1, 6, 6, 2, 2, 4, dtype=torch.float64)
    _, lse = flash_attn_func(q, k, v, return_lse=True, backend="rocm")
    assert lse.dtype == torch.float64
    q, k, v = _qkv(rng, 1, 33, 40, 2, 1, 16, dtype=torch.float16, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, backend="rocm")
    assert out.dtype == torch.float16
    assert _rel_l2(out, attention_ref(q, k, v, causal=True)[0]) <= 2e-3
    dout = torch.from_numpy(rng.standard_normal(q.shape)).half()
    out.backward(dout)
    for name, x, want in zip("qkv", (q, k, v), attention_ref_backward(dout, q, k, v, causal=True)):
        assert x.grad.dtype == torch.float16, name
        assert _rel_l2(x.grad, want) <= 2e-3, name


def test_rows_that_see_no_key_have_zero_gradient(rng):
    q, k, v = _qkv(rng, 1, 12, 5, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, backend="rocm")
    dout = torch.from_numpy(rng.standard_normal(q.shape))
    out.backward(dout)
    assert torch.all(out[:, :7] == 0) and torch.all(torch.isposinf(lse[:, :, :7]))
    assert torch.all(q.grad[:, :7] == 0)
    assert not any(torch.isnan(t).any() for t in (out, q.grad, k.grad, v.grad))
    for name, x, want in zip("qkv", (q, k, v), attention_ref_backward(dout, q, k, v, causal=True)):
        assert _rel_l2(x.grad, want) <= 1e-12, name


def test_bad_input_raises_attention_input_error(rng):
    q, k, v = _qkv(rng, 1, 5, 5, 2, 2, 4, requires_grad=True)
    with pytest.raises(AttentionInputError, match="k: expected 4 dimensions"):
        flash_attn_func(q, k[0], v, backend="rocm")
    with pytest.raises(AttentionInputError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(-2, 0), backend="rocm")
    with pytest.raises(AttentionInputError, match="layout"):
        flash_attn_func(q, k, v, layout="sbhd", backend="rocm")
    with pytest.raises(AttentionInputError, match="q: expected a torch.Tensor"):
        flash_attn_func(q.detach().numpy(), k, v, backend="rocm")


def test_backend_choice_goes_through_the_registry(rng, monkeypatch):
    """Without backend=, the registry picks; backend_registry.use() forces forward and backward alike."""
    seen = []
    real_select = backend_registry.Dispatcher.select

    def spy(self, call, backend=None):
        be = real_select(self, call, backend)
        seen.append((be.name, call.is_backward))
        return be

    monkeypatch.setattr(backend_registry.Dispatcher, "select", spy)
    q, k, v = _qkv(rng, 1, 7, 9, 2, 1, 4, requires_grad=True)
    with backend_registry.use("rocm"):
        flash_attn_func(q, k, v, causal=True).sum().backward()
    assert seen == [("rocm", False), ("rocm", True)]
    seen.clear()
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert [name for name, _ in seen] == ["cpu", "cpu"]      # no GPU here: CPU tensors go to the CPU backend


@pytest.mark.parametrize("varlen", [False, True])
def test_a_second_derivative_says_why_it_is_refused(rng, varlen):
    """create_graph=True gives the usual gradients; differentiating those again raises numba-flash's reason (torch's
    own error named only a missing formula)."""
    from numba_flash import flash_attn_varlen_func

    q, k, v = (torch.from_numpy(rng.standard_normal((1, 13, 2, 8))).requires_grad_() for _ in range(3))
    if varlen:
        cu = torch.tensor([0, 6, 13], dtype=torch.int32)
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 7, 7, causal=True)
    else:
        out = flash_attn_func(q, k, v, causal=True)
    plain, = torch.autograd.grad(out.square().sum(), q, retain_graph=True)
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    np.testing.assert_allclose(dq.detach().numpy(), plain.numpy(), rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="numba_flash: the backward of flash_attn_.*func is not differentiable"):
        dq.sum().backward()
