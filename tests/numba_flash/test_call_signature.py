"""Checks remembered per call signature (``numba_flash.call_signature``): a remembered check is never reused for a
call of another shape, dtype, stride, option or array type; bad input still raises ``AttentionInputError`` naming
the argument; a remembered call carries the new call's own arrays; and the torch face validates once per call."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import AttentionInputError, backend_registry
from numba_flash import call_signature
from numba_flash.reference import attention_ref
from numba_flash.validation import validate_forward

OP = backend_registry.get("flash", backend="cpu")


@pytest.fixture(autouse=True)
def fresh_memo():
    call_signature.forget_all()
    yield
    call_signature.forget_all()


def _qkv(rng, sq=3, sk=17, hq=4, hkv=2, d=9, dtype=np.float32):
    return (rng.standard_normal((1, sq, hq, d)).astype(dtype), rng.standard_normal((1, sk, hkv, d)).astype(dtype),
            rng.standard_normal((1, sk, hkv, d)).astype(dtype))


def test_a_remembered_call_holds_this_call_s_arrays():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    first = validate_forward(q, k, v)
    q2, k2, v2 = _qkv(rng)
    second = validate_forward(q2, k2, v2)
    assert second.q is q2 and second.k is k2 and second.v is v2 and second.extra == {} \
        and second.extra is not first.extra
    own = {"q", "k", "v", "extra"}
    assert {n: x for n, x in second.__dict__.items() if n not in own} == \
        {n: x for n, x in first.__dict__.items() if n not in own}


def test_another_shape_dtype_or_option_is_checked_again():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    validate_forward(q, k, v)
    with pytest.raises(AttentionInputError, match=r"^k: .*head dim 9"):
        validate_forward(q, k[..., :5], v)                        # k's head dim differs: refused, not remembered
    with pytest.raises(AttentionInputError, match=r"^k: .*dtype"):
        validate_forward(q, k.astype(np.float64), v)
    with pytest.raises(AttentionInputError, match=r"^k: .*divides"):
        validate_forward(q, np.concatenate([k, k, k], axis=2), np.concatenate([v, v, v], axis=2))
    with pytest.raises(AttentionInputError, match=r"^k: .*floating dtype"):
        validate_forward(q, k.astype(np.int32), v)                # the same strides as float32 k
    validate_forward(q, k, v, causal=True, window_size=(1, -1))
    with pytest.raises(AttentionInputError, match=r"^causal: "):
        validate_forward(q, k, v, causal=1, window_size=(1, -1))  # 1 == True and hashes alike, but not a bool
    with pytest.raises(AttentionInputError, match=r"^window_size: "):
        validate_forward(q, k, v, causal=True, window_size=(True, -1))
    masked = np.ma.masked_array(q, mask=np.zeros(q.shape, bool))
    masked.mask[0, 0, 0, 0] = True
    with pytest.raises(AttentionInputError, match=r"^q: .*masked"):
        validate_forward(masked, k, v)
    # the same shapes with the options changed get their own derived values
    assert validate_forward(q, k, v, causal=True).window_right == 0
    assert validate_forward(q, k, v).window_right == -1
    assert validate_forward(q, k, v, softmax_scale=0.5).softmax_scale == 0.5


@pytest.mark.parametrize("change", ["shape", "dtype", "strides"])
def test_results_stay_right_when_the_signature_changes(change):
    """A call remembered for one signature, then fresh odd-size inputs of another: the answer is the reference's."""
    rng = np.random.default_rng()
    OP.forward(*_qkv(rng))
    if change == "shape":
        q, k, v = _qkv(rng, sq=5, sk=11, hq=6, hkv=3, d=13)
    elif change == "dtype":
        q, k, v = _qkv(rng, dtype=np.float64)
    else:
        q, k, v = (np.repeat(x, 2, axis=1)[:, ::2] for x in _qkv(rng))
    out = OP.forward(q, k, v)
    ref, _ = attention_ref(*(x.astype(np.float64) for x in (q, k, v)))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.abs(out - ref).max() <= 1e-5


def test_only_plain_calls_are_remembered():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    assert call_signature.forward_signature(dict(_arguments(q, k, v))) is not None
    for extra in (dict(alibi_slopes=np.ones(4, np.float32)), dict(attn_bias=np.zeros((3, 17), np.float32)),
                  dict(dropout_p=0.1, dropout_seed=1), dict(softmax_scale=np.float32(0.5)),
                  dict(window_size=[2, 1])):
        assert call_signature.forward_signature(_arguments(q, k, v, **extra)) is None, extra
    assert call_signature.forward_signature(_arguments(np.ma.masked_array(q), k, v)) is None


def _arguments(q, k, v, **options):
    args = dict(q=q, k=k, v=v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, layout=None,
                return_lse=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                alibi_slopes=None, attn_bias=None, bias_mod=None, mask_mod=None, score_mod=None, block_mask=None,
                dropout_p=0.0, dropout_seed=None, precision="ieee")
    args.update(options)
    return args


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(call_signature, "MAX_SIGNATURES", 3)
    rng = np.random.default_rng()
    for d in range(1, 8):
        validate_forward(*_qkv(rng, d=d))
    assert call_signature.remembered_count() <= 3


def test_a_call_whose_checks_replaced_an_array_is_not_remembered(monkeypatch):
    """Were a check to hand on a converted copy of q, a recalled call would run on the caller's unconverted q."""
    import numba_flash.validation as validation

    real = validation.check_array

    def copying(name, x, layout):
        info = real(name, x, layout)
        return (info[0].copy(),) + tuple(info[1:]) if name == "q" else info

    monkeypatch.setattr(validation, "check_array", copying)
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    validate_forward(q, k, v)
    assert call_signature.remembered_count() == 0
    q2, k2, v2 = _qkv(rng)
    assert validate_forward(q2, k2, v2).q is not q2   # checked again, through the copying check
