"""One test per rule of the contract's "Bad input" section: the error is AttentionInputError (a ValueError), it
names the argument, the expectation and what came, it is raised before any backend runs, and nothing is modified."""

import re

import numpy as np
import pytest

from backends import backend_registry
from backends.base import Backend
from numba_flash import AttentionInputError, validate_backward, validate_forward


def _qkv(rng, sq=5, sk=7, hq=4, hkv=2, d=8, dtype=np.float32, layout="bshd"):
    shapes = [(2, sq, hq, d), (2, sk, hkv, d), (2, sk, hkv, d)]
    if layout == "bhsd":
        shapes = [(b, h, s, dd) for b, s, h, dd in shapes]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


class _Recorder(Backend):
    """A backend that accepts everything and records that it ran: no call may reach it with bad input."""

    name = "recorder"
    PRIORITY = 1000
    calls = 0

    def forward(self, call):
        type(self).calls += 1
        return call.q, None

    def backward(self, call):
        type(self).calls += 1
        return call.q, call.k, call.v


@pytest.fixture
def recorder():
    backend_registry.register("flash", "recorder", _Recorder, replace=True)
    _Recorder.calls = 0
    yield _Recorder
    backend_registry.unregister("flash", "recorder")


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(AttentionInputError, match=match) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_message_of_the_contract(rng):
    q, k, v = _qkv(rng)
    msg = _raises("k", validate_forward, q, rng.standard_normal((2, 3, 4)), v)
    assert msg == "k: expected 4 dimensions (B, Sk, Hkv, D) for layout 'bshd', got shape (2, 3, 4)"


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_an_array(rng, name):
    args = dict(zip("qkv", _qkv(rng)))
    args[name] = [[1.0, 2.0]]
    msg = _raises(f"^{name}: expected an array", validate_forward, **args)
    assert "list" in msg


@pytest.mark.parametrize("name", ["q", "k", "v", "attn_bias"])
def test_a_masked_array_with_masked_elements_is_refused(rng, name):
    """numpy's mask would be ignored by every kernel (they read the data): refused, naming the argument; a masked
    array with nothing masked is its data."""
    args = dict(zip("qkv", _qkv(rng)), attn_bias=rng.standard_normal((5, 7)).astype(np.float32))
    plain = {n: x.copy() for n, x in args.items()}
    mask = np.zeros(args[name].shape, bool)
    mask.flat[int(rng.integers(mask.size))] = True
    args[name] = np.ma.masked_array(args[name], mask=mask)
    msg = _raises(f"^{name}: expected an array without masked elements", validate_forward, **args)
    assert "1 masked element" in msg
    assert np.array_equal(args[name].data, plain[name]) and args[name].mask.sum() == 1   # untouched
    args[name] = np.ma.masked_array(plain[name], mask=np.zeros(mask.shape, bool))
    op = backend_registry.get("flash", backend="rocm")
    np.testing.assert_array_equal(op.forward(**args), op.forward(**plain))


@pytest.mark.parametrize("layout,dims", [("bshd", "(B, Sq, Hq, D)"), ("bhsd", "(B, Hq, Sq, D)")])
def test_wrong_rank(rng, layout, dims):
    q, k, v = _qkv(rng, layout=layout)
    msg = _raises("^q: expected 4 dimensions", validate_forward, q[0], k, v, layout=layout)
    assert dims in msg and str(q[0].shape) in msg


def test_integer_dtype(rng):
    q, k, v = _qkv(rng)
    _raises(r"^q: expected a floating dtype .* got dtype int32", validate_forward, q.astype(np.int32), k, v)


def test_swapped_byte_order_is_named(rng):
    q, k, v = _qkv(rng)
    swapped = k.astype(k.dtype.newbyteorder(">" if k.dtype.byteorder in "=<" else "<"))
    msg = _raises(r"^k: expected a floating dtype .* in this machine's byte order, got dtype", validate_forward, q,
                  swapped, v)
    assert "float32 with its bytes swapped" in msg and "newbyteorder('=')" in msg


def test_mixed_dtypes(rng):
    q, k, v = _qkv(rng)
    _raises(r"^v: expected the same dtype as q \(float32\), got dtype float64", validate_forward,
            q, k, v.astype(np.float64))


def test_mixed_array_kinds(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng)
    _raises(r"^k: expected the same array kind as q \(numpy\), got torch", validate_forward, q, torch.from_numpy(k), v)


def test_empty_dimension(rng):
    q, k, v = _qkv(rng)
    _raises(r"^k: expected every size >= 1", validate_forward, q, k[:, :0], v[:, :0])


def test_v_shape_differs_from_k(rng):
    q, k, v = _qkv(rng)
    _raises(r"^v: expected the shape of k \(2, 7, 2, 8\) but for the head dim, got shape \(2, 6, 2, 8\)",
            validate_forward, q, k, v[:, :6])
    # only the head dim may differ (MLA); out and dout then take v's
    call = validate_forward(q, k, v[..., :3])
    assert (call.head_dim, call.head_dim_v) == (8, 3)
    out = np.zeros(q.shape[:-1] + (3,), np.float32)
    lse = np.zeros((2, 4, 5), np.float32)
    _raises(r"^dout: expected q's shape with v's head dim, \(2, 5, 4, 3\), got shape \(2, 5, 4, 8\)",
            validate_backward, q, q, k, v[..., :3], out, lse)


def test_batch_mismatch(rng):
    q, k, v = _qkv(rng)
    _raises(r"^k: expected batch size 2 like q", validate_forward, q, k[:1], v[:1])


def test_head_dim_mismatch(rng):
    q, k, v = _qkv(rng)
    _raises(r"^k: expected head dim 8 like q, got head dim 6", validate_forward, q, k[..., :6], v[..., :6])


def test_head_dim_too_large(rng):
    q, k, v = _qkv(rng, sq=1, sk=1, d=577)
    _raises(r"^q: expected head dim D between 1 and 576, got D=577", validate_forward, q, k, v)
    _raises(r"^v: expected head dim Dv between 1 and 512, got Dv=513", validate_forward, q[..., :576], k[..., :576],
            np.concatenate([v, v], axis=-1)[..., :513])


def test_heads_not_divisible(rng):
    q, k, v = _qkv(rng, hq=4, hkv=3)
    _raises(r"^k: expected a number of heads that divides q's 4 .* got Hkv=3", validate_forward, q, k, v)


# None is the default: "bshd", or "thd" when cu_seqlens are given (tests/numba_flash/test_varlen.py)
@pytest.mark.parametrize("layout", ["BSHD", "sbhd", "", 3])
def test_bad_layout(rng, layout):
    _raises(r"^layout: expected 'bshd' or 'bhsd'", validate_forward, *_qkv(rng), layout=layout)


@pytest.mark.parametrize("name,value,pattern", [
    ("causal", 1, r"^causal: expected a bool, got 1"),
    ("causal", "yes", r"^causal: expected a bool"),
    ("return_lse", None, r"^return_lse: expected a bool, got None"),
    ("softmax_scale", -0.5, r"^softmax_scale: expected None or a finite number > 0, got -0.5"),
    ("softmax_scale", float("nan"), r"^softmax_scale: expected None or a finite number > 0, got nan"),
    ("softmax_scale", "0.1", r"^softmax_scale: expected"),
    ("window_size", (1, 2, 3), r"^window_size: expected a pair of ints"),
    ("window_size", (1.5, 2), r"^window_size: expected a pair of ints"),
    ("window_size", 4, r"^window_size: expected a pair of ints"),
    ("window_size", (-2, 0), r"^window_size: expected each bound >= 0, or -1 for unbounded, got \(-2, 0\)"),
    ("softcap", -1.0, r"^softcap: expected a finite number >= 0"),
    ("softcap", float("inf"), r"^softcap: expected a finite number >= 0"),
])
def test_bad_options(rng, name, value, pattern):
    _raises(pattern, validate_forward, *_qkv(rng), **{name: value})


def test_device_mismatch(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in _qkv(rng))
    _raises(r"^v: expected the same device as q \(cpu\), got device meta", validate_forward, q, k,
            torch.empty(v.shape, device="meta"))


def test_backward_rules(rng):
    q, k, v = _qkv(rng)
    out, dout = rng.standard_normal(q.shape).astype(np.float32), rng.standard_normal(q.shape).astype(np.float32)
    lse = rng.standard_normal((2, 4, 5)).astype(np.float32)
    validate_backward(dout, q, k, v, out, lse)  # the valid call passes
    _raises(r"^dout: expected the shape of q \(2, 5, 4, 8\), got shape \(2, 4, 4, 8\)", validate_backward,
            dout[:, :4], q, k, v, out, lse)
    _raises(r"^out: expected the dtype of q \(float32\), got dtype float64", validate_backward,
            dout, q, k, v, out.astype(np.float64), lse)
    _raises(r"^lse: expected shape \(B, Hq, Sq\) = \(2, 4, 5\), got shape \(2, 5, 4\)", validate_backward,
            dout, q, k, v, out, lse.transpose(0, 2, 1))
    _raises(r"^lse: expected dtype float32", validate_backward, dout, q, k, v, out, lse.astype(np.float16))
    _raises(r"^lse: expected an array", validate_backward, dout, q, k, v, out, None)


def test_errors_raised_before_any_work_and_inputs_untouched(rng, recorder):
    q, k, v = _qkv(rng)
    copies = [x.copy() for x in (q, k, v)]
    op = backend_registry.get("flash", backend="recorder")
    with pytest.raises(AttentionInputError):
        op.forward(q, k[..., :3], v[..., :3])
    with pytest.raises(AttentionInputError):
        op.forward(q, k, v, window_size=(-3, 0))
    with pytest.raises(AttentionInputError):
        op.backward(q, q, k, v, q, np.zeros((2, 4, 4), np.float32))
    with pytest.raises(AttentionInputError):
        op.explain(q, k, v, layout="nope")
    assert recorder.calls == 0
    op.forward(q, k, v)  # the recorder itself works, so the zero above means validation stopped the calls
    assert recorder.calls == 1
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


def test_valid_call_description(rng):
    q, k, v = _qkv(rng, layout="bhsd")
    call = validate_forward(q, k, v, layout="bhsd", causal=True, window_size=(3, 5), softcap=2.0)
    assert (call.batch, call.seqlen_q, call.seqlen_k, call.nheads_q, call.nheads_kv, call.head_dim) == (2, 5, 7, 4, 2, 8)
    assert (call.window_left, call.window_right) == (3, 0)  # causal wins over the right bound
    assert call.softmax_scale == pytest.approx(1 / np.sqrt(8))
    assert re.search(r"numpy/cpu float32 bhsd B=2 Sq=5 Sk=7 Hq=4 Hkv=2 D=8 causal window=\(3, 0\) softcap=2", call.describe())
