"""The torch faces' eager path (``torch_api``): flash_attn_func validates once per call, skips the custom ops'
dispatcher only where nothing needs it (a torch dispatch mode still sees the ops), and gives the float64
reference's forward and gradients on fresh odd-size inputs without modifying them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from numba_flash import AttentionInputError, backend_registry, call_signature, torch_api  # noqa: E402
from numba_flash import validation  # noqa: E402


def _reference(q, k, v, causal):
    """float64 attention through torch autograd ("bshd", GQA by repetition)."""
    qh, kh, vh = (x.detach().double().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    s = qh @ kh.repeat_interleave(group, 1).transpose(-1, -2) / qh.shape[-1] ** 0.5
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, float("-inf"))
    out = (s.softmax(-1) @ vh.repeat_interleave(group, 1)).transpose(1, 2)
    return out, (qh, kh, vh)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sizes", [(1, 13, 6, 2, 9), (3, 5, 4, 4, 17)])
def test_forward_and_gradients_match_the_float64_reference(sizes, causal):
    sq, sk, hq, hkv, d = sizes
    q = torch.randn(2, sq, hq, d, requires_grad=True)
    k = torch.randn(2, sk, hkv, d, requires_grad=True)
    v = torch.randn(2, sk, hkv, d, requires_grad=True)
    dout = torch.randn(2, sq, hq, d)
    before = [x.detach().clone() for x in (q, k, v, dout)]
    out = numba_flash.flash_attn_func(q, k, v, causal=causal)
    out.backward(dout)
    ref, leaves = _reference(q, k, v, causal)
    ref.backward(dout.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        rel = (got.double() - want.grad.transpose(1, 2)).norm() / want.grad.norm()
        assert rel < 1e-5, rel
    for x, was in zip((q, k, v, dout), before):
        assert torch.equal(x.detach(), was)


def test_validation_runs_once_per_call(monkeypatch):
    calls = []
    real = validation.validate_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in (torch_api, backend_registry):
        monkeypatch.setattr(module, "validate_forward", counting)
    q = torch.randn(1, 1, 8, 16)
    kv = torch.randn(1, 7, 8, 16)
    numba_flash.flash_attn_func(q, kv, kv)
    assert len(calls) == 1


def test_a_dispatch_mode_still_sees_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 3, 2, 8)
    plain = numba_flash.flash_attn_func(q, q, q)
    with Record():
        recorded = numba_flash.flash_attn_func(q, q, q)
    assert any("numba_flash.flash_fwd" in name for name in seen), seen
    assert torch.equal(plain, recorded)


def test_bad_input_after_a_remembered_call_still_names_the_argument():
    call_signature.forget_all()
    q = torch.randn(1, 2, 4, 8)
    numba_flash.flash_attn_func(q, q, q)
    with pytest.raises(AttentionInputError, match=r"^k: .*head dim"):
        numba_flash.flash_attn_func(q, q[..., :4], q)
    with pytest.raises(AttentionInputError, match=r"^k: .*dtype"):
        numba_flash.flash_attn_func(q, q.to(torch.int32), q)   # int32: float32's strides
    with pytest.raises(AttentionInputError, match=r"^v: .*torch.Tensor"):
        numba_flash.flash_attn_func(q, q, q.numpy())
    # a lazily negated view is never remembered as the plain tensor it shares memory with
    assert torch.equal(numba_flash.flash_attn_func(q, q, torch._neg_view(q)), numba_flash.flash_attn_func(q, q, -q))
