"""flash_attn_func has flash-attn's face: its parameters in flash-attn's order with flash-attn's defaults, so that
positional calls written for flash-attn mean the same here; arguments for features not built yet are refused with
AttentionInputError (never TypeError); deterministic=True holds (bitwise equal backward runs)."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends import backend_registry  # noqa: E402
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, flash_attn_func  # noqa: E402

BACKENDS = ["rocm", "cpu"]

# flash_attn/flash_attn_interface.py (flash-attn 2.6 and later), written out by hand from its documented signature:
# flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
#                 alibi_slopes=None, deterministic=False, return_attn_probs=False)
FLASH_ATTN_PARAMETERS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
    ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
]
OUR_KEYWORD_ONLY = [("layout", "bshd"), ("return_lse", False), ("backend", None), ("attn_bias", None),
                    ("bias_mod", None), ("mask_mod", None), ("score_mod", None), ("score_mod_grad", None),
                    ("block_mask", None), ("dropout_seed", None), ("precision", "ieee")]


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)


def _qkv(rng, b, sq, sk, hq, hkv, d, dtype=torch.float32, requires_grad=False):
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
    return [torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_(requires_grad) for s in shapes]


def test_signature_is_flash_attns_then_keyword_only_extras():
    params = list(inspect.signature(flash_attn_func).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    keyword_only = [p for p in params if p.kind == p.KEYWORD_ONLY]
    assert len(positional) + len(keyword_only) == len(params)     # no *args / **kwargs swallowing typos
    assert [(p.name, p.default) for p in positional] == FLASH_ATTN_PARAMETERS
    assert [(p.name, p.default) for p in keyword_only] == OUR_KEYWORD_ONLY


def test_positional_call_means_what_it_means_in_flash_attn(rng):
    q, k, v = _qkv(rng, 2, 13, 19, 4, 2, 8)
    out = flash_attn_func(q, k, v, 0.0, None, True)
    assert torch.equal(out, flash_attn_func(q, k, v, dropout_p=0.0, causal=True))
    want, _ = attention_ref(q, k, v, causal=True)
    assert np.abs(out.numpy() - want).max() <= 1e-5
    # so does a causal=False default: the sixth argument really is causal
    assert np.abs(out.numpy() - attention_ref(q, k, v)[0]).max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_positional_argument_lands_where_flash_attn_puts_it(rng, backend):
    kw = dict(softmax_scale=0.3, causal=True, window_size=(5, -1), softcap=2.0)
    q, k, v = _qkv(rng, 1, 11, 14, 6, 3, 7, requires_grad=True)
    out = flash_attn_func(q, k, v, 0.0, 0.3, True, (5, -1), 2.0, None, True, False, backend=backend)
    want, _ = attention_ref(q, k, v, **kw)
    assert np.abs(out.detach().numpy() - want).max() <= 1e-5
    assert torch.equal(out, flash_attn_func(q, k, v, backend=backend, **kw))
    dout = torch.from_numpy(rng.standard_normal(q.shape)).float()
    out.backward(dout)
    for name, x, g in zip("qkv", (q, k, v), attention_ref_backward(dout, q, k, v, **kw)):
        assert np.linalg.norm(x.grad.double().numpy() - g) <= 1e-5 * np.linalg.norm(g), name


NOT_YET = {
    "attn_probs": (dict(return_attn_probs=True),
                   r"return_attn_probs: expected False \(returning the attention probabilities is not implemented"),
}


@pytest.mark.parametrize("case", NOT_YET.values(), ids=NOT_YET.keys())
def test_features_not_built_yet_raise_attention_input_error(rng, case):
    kw, match = case
    q, k, v = _qkv(rng, 1, 5, 6, 4, 2, 4, requires_grad=True)
    with pytest.raises(AttentionInputError, match=match):
        flash_attn_func(q, k, v, **kw)


def test_not_built_yet_positionally_too(rng):
    q, k, v = _qkv(rng, 1, 5, 6, 4, 2, 4)
    with pytest.raises(AttentionInputError, match="return_attn_probs: expected False"):
        flash_attn_func(q, k, v, 0.0, None, False, (-1, -1), 0.0, None, False, True)


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, float("nan"), float("inf"), "0", None, True])
def test_dropout_p_is_validated(rng, value):
    q, k, v = _qkv(rng, 1, 5, 6, 2, 2, 4)
    with pytest.raises(AttentionInputError, match=r"dropout_p: expected a real number in \[0, 1\)"):
        flash_attn_func(q, k, v, dropout_p=value)


def test_deterministic_must_be_a_bool(rng):
    q, k, v = _qkv(rng, 1, 5, 6, 2, 2, 4)
    with pytest.raises(AttentionInputError, match="deterministic: expected a bool, got 'yes'"):
        flash_attn_func(q, k, v, deterministic="yes")


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_backward_is_bitwise_reproducible(rng, backend):
    """Sizes past one tile and several kv heads, so the CPU backend's threads split the work."""
    base = _qkv(rng, 2, 150, 203, 8, 2, 32)
    dout = torch.from_numpy(rng.standard_normal(base[0].shape)).float()
    grads = []
    for deterministic in (True, True, False):
        q, k, v = (x.clone().requires_grad_() for x in base)
        flash_attn_func(q, k, v, causal=True, deterministic=deterministic, backend=backend).backward(dout)
        grads.append([x.grad for x in (q, k, v)])
    for other in grads[1:]:
        for g0, g in zip(grads[0], other):
            assert torch.equal(g0, g)
    q, k, v = base
    for g, want in zip(grads[0], attention_ref_backward(dout, q, k, v, causal=True)):
        assert np.linalg.norm(g.double().numpy() - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_registry_faces_take_deterministic_too(rng, backend):
    """design.md: ``deterministic`` is an extra argument of forward and backward as of flash_attn_func, accepted
    everywhere; op.forward / op.backward / op.explain refused it as an unknown keyword."""
    q, k, v = (x.numpy() for x in _qkv(rng, 2, 37, 45, 4, 2, 16))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, causal=True, return_lse=True, deterministic=True)
    runs = [op.backward(dout, q, k, v, out, lse, causal=True, deterministic=flag) for flag in (True, True, False)]
    for other in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], other))
    np.testing.assert_allclose(out, attention_ref(q, k, v, causal=True)[0], atol=2e-5, rtol=0)
    assert "chosen: " + backend in op.explain(q, k, v, deterministic=True)
    with pytest.raises(AttentionInputError, match="^deterministic: expected a bool, got 'yes'"):
        op.forward(q, k, v, deterministic="yes")
    with pytest.raises(AttentionInputError, match="^deterministic: expected a bool, got 1"):
        op.backward(dout, q, k, v, out, lse, causal=True, deterministic=1)
