"""``flash_attn_func``'s eager path without autograd (``torch_api``): a call that needs no graph runs the backend
directly, neither ``FlashAttnFunc.apply`` nor the ``flash_fwd`` op, and must give their bits; a torch dispatch mode
still sees the op. The backend chosen for a call signature is kept (``numba_flash.chosen_backends``) and never
reused for another signature, nor after the registered backends change or one declines.

Sizes are odd on purpose: B = 2, Sq = 3, Sk = 11, Hq = 6, Hkv = 2, D = 20.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from backends import backend_registry  # noqa: E402
from numba_flash import chosen_backends  # noqa: E402
from numba_flash.backends.cpu import CpuBackend  # noqa: E402
from numba_flash.errors import BackendDeclined  # noqa: E402
from torch_eager_cases import SeesOps  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    chosen_backends.clear()
    yield
    chosen_backends.clear()


def _qkv(seed: int, d: int = 20, dtype=np.float32) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(seed)
    return (torch.from_numpy(rng.standard_normal((2, 3, 6, d)).astype(dtype)),
            torch.from_numpy(rng.standard_normal((2, 11, 2, d)).astype(dtype)),
            torch.from_numpy(rng.standard_normal((2, 11, 2, d)).astype(dtype)))


def _reference(q, k, v, causal):
    qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(3, 1), vh.repeat_interleave(3, 1)
    s = qh @ kh.transpose(-1, -2) / qh.shape[-1] ** 0.5
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_a_call_without_autograd_gives_the_ops_bits_and_the_reference(causal):
    q, k, v = _qkv(int(causal) + 1)
    before = [x.clone() for x in (q, k, v)]
    fast, fast_lse = numba_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    mode = SeesOps()
    with mode:
        slow, slow_lse = numba_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert any("numba_flash.flash_fwd" in name for name in mode.seen), mode.seen
    assert torch.equal(fast, slow) and torch.equal(fast_lse, slow_lse)
    with torch.no_grad():   # inputs that require grad, grad mode off: the eager path too, same bits
        off = numba_flash.flash_attn_func(*(x.clone().requires_grad_(True) for x in (q, k, v)), causal=causal)
    assert torch.equal(off, fast) and not off.requires_grad
    assert (fast.double() - _reference(q, k, v, causal)).abs().max() < 1e-5
    assert not fast.requires_grad and fast_lse.shape == (2, 6, 3)
    for x, was in zip((q, k, v), before):
        assert torch.equal(x, was)


def test_a_call_that_needs_a_graph_still_gets_one():
    q, k, v = (x.requires_grad_(True) for x in _qkv(3))
    out = numba_flash.flash_attn_func(q, k, v)
    assert out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def _only_head_dim(d: int, calls: list) -> type:
    class OnlyHeadDim(CpuBackend):
        """The cpu backend, first by priority, for calls of head dim ``d`` only; records the calls it runs."""
        name = "only_head_dim_test"
        PRIORITY = 1000

        def not_supported_reasons(self, call, forced=False):
            return ([] if call.head_dim == d else [f"head dim {call.head_dim} is not {d}"]) + \
                super().not_supported_reasons(call, forced)

        def forward(self, call):
            calls.append(call.head_dim)
            return super().forward(call)
    return OnlyHeadDim


def test_a_kept_choice_is_not_reused_for_another_signature_nor_after_the_backends_change():
    calls: list[int] = []
    q8, k8, v8 = _qkv(4, d=8)
    q20, k20, v20 = _qkv(5, d=20)
    numba_flash.flash_attn_func(q8, k8, v8)        # the cpu backend's, kept for D = 8
    backend_registry.register("flash", "only_head_dim_test", _only_head_dim(8, calls))
    try:
        numba_flash.flash_attn_func(q8, k8, v8)    # registering dropped the kept choice: the new backend serves
        numba_flash.flash_attn_func(q20, k20, v20)  # another signature: ranked anew, the cpu backend serves
        numba_flash.flash_attn_func(q8, k8, v8)
        assert calls == [8, 8]
        assert chosen_backends.kept_count() == 2
    finally:
        backend_registry.unregister("flash", "only_head_dim_test")
    numba_flash.flash_attn_func(q8, k8, v8)        # removed: not chosen from a stale entry
    assert calls == [8, 8]


def test_a_backend_that_declines_is_not_kept_chosen():
    declined: list[int] = []

    class DeclinesOnce(CpuBackend):
        name = "declines_once_test"
        PRIORITY = 1000

        def not_supported_reasons(self, call, forced=False):
            return ["declined before"] if declined else super().not_supported_reasons(call, forced)

        def forward(self, call):
            if not declined:
                declined.append(1)
                raise BackendDeclined(["first use failed its self-check"])
            raise AssertionError("a backend that declined was chosen from a kept entry")

    q, k, v = _qkv(6)
    backend_registry.register("flash", "declines_once_test", DeclinesOnce)
    try:
        want = numba_flash.flash_attn_func(q, k, v)   # declined: the next backend serves
        assert declined == [1]
        assert torch.equal(numba_flash.flash_attn_func(q, k, v), want)
    finally:
        backend_registry.unregister("flash", "declines_once_test")


@pytest.mark.parametrize("causal", [False, True])
def test_the_eager_backward_gives_the_ops_bits_and_the_reference(causal):
    """A plain call's backward runs its backend directly (the forward's checks, dout checked against out); under a
    dispatch mode both halves go through the ops. Same gradients, bit for bit, and the float64 reference's."""
    q, k, v = _qkv(int(causal) + 7)
    dout = torch.randn(2, 3, 6, 20, dtype=torch.float32)
    grads = []
    for mode in (None, SeesOps()):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        if mode is None:
            numba_flash.flash_attn_func(*leaves, causal=causal).backward(dout)
        else:
            with mode:
                numba_flash.flash_attn_func(*leaves, causal=causal).backward(dout)
            assert any("numba_flash.flash_bwd" in name for name in mode.seen), mode.seen
        grads.append([x.grad for x in leaves])
    for fast, slow in zip(*grads, strict=True):
        assert torch.equal(fast, slow)
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    _reference(qd, kd, vd, causal).backward(dout.double())
    for got, want in zip(grads[0], (qd.grad, kd.grad, vd.grad)):
        assert ((got.double() - want).norm() / want.norm()) < 1e-5
    # a broadcast dout (from expand: stride 0) is made contiguous first, and gives the same gradients
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    numba_flash.flash_attn_func(*leaves, causal=causal).backward(torch.ones(()).expand(2, 3, 6, 20))
    leaves2 = [x.clone().requires_grad_(True) for x in (q, k, v)]
    numba_flash.flash_attn_func(*leaves2, causal=causal).backward(torch.ones(2, 3, 6, 20))
    for a, b in zip(leaves, leaves2):
        assert torch.equal(a.grad, b.grad)


def test_the_backward_ranks_the_backends_for_a_backward():
    """The backward's kept choice is its own: a backend that serves this forward but no backward is never asked
    for the gradients."""
    ran: list[str] = []

    class ForwardOnly(CpuBackend):
        name = "forward_only_test"
        PRIORITY = 1000
        SUPPORTS_BACKWARD = False

        def forward(self, call):
            ran.append("forward")
            return super().forward(call)

        def backward(self, call):
            raise AssertionError("a backend without a backward was asked for one")

    q, k, v = (x.requires_grad_(True) for x in _qkv(9))
    backend_registry.register("flash", "forward_only_test", ForwardOnly)
    try:
        for _ in range(2):
            numba_flash.flash_attn_func(q, k, v).sum().backward()
    finally:
        backend_registry.unregister("flash", "forward_only_test")
    assert ran == ["forward", "forward"] and q.grad is not None
