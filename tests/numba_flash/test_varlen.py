"""Packed sequences (layout "thd"): the reference against hand-derived values and against the dense reference run
on each sequence, the validation of cu_seqlens / max_seqlen, the CPU and ROCm (torch) backends against the
reference, and ``flash_attn_varlen_func`` with autograd. The CUDA kernels run the same cases under the simulator in
``tests/numba_flash/cuda/test_varlen_sim.py``.

Every case packs sequences of different, odd lengths, among them empty ones (no rows, no keys) and single ones;
inputs are fresh N(0, 1) draws.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from varlen_cases import (check_empty_sequences, check_float32, f64, packed_inputs, reference, rel_l2,
                          sequences)

from backends import backend_registry
from numba_flash import (AttentionInputError, attention_ref, attention_ref_backward, attention_ref_varlen,
                         attention_ref_varlen_backward, validate_backward, validate_forward)

# (lengths of the query sequences, lengths of the key sequences): a sequence with rows but no keys, one with keys
# but no rows, one with neither, a 1 x 1 one, Sq > Sk (causal rows that see nothing) and Sq < Sk.
LENGTHS = {
    "mixed": ([5, 0, 1, 9, 4, 0, 3], [8, 3, 1, 6, 0, 0, 11]),
    "tiles": ([70, 1, 0, 131], [65, 2, 5, 140]),   # sequences longer than a CPU tile (64)
}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "causal_window_softcap": dict(causal=True, window_size=(2, -1), softcap=1.5, softmax_scale=0.4),
}
HEADS = {"gqa": (4, 2), "mqa": (3, 1), "mha": (2, 2)}


# ---------------------------------------------------------------------------------------------------------------
# The reference


def test_reference_hand_derived():
    """D = 1, scale 1. Sequence 0: one row, q = 1, keys 0 and ln 3, so weights 1/4 and 3/4 of v = (10, 20).
    Sequence 1: two rows, one key; causal (bottom-right) hides it from row 0 only, so row 1 reads v = -7 alone.
    Had sequence 1 seen sequence 0's keys, its row 1 would not be exactly -7."""
    q = np.array([[[1.0]], [[5.0]], [[2.0]]])
    k = np.array([[[0.0]], [[math.log(3.0)]], [[0.5]]])
    v = np.array([[[10.0]], [[20.0]], [[-7.0]]])
    cu_q, cu_k = np.array([0, 1, 3], np.int32), np.array([0, 2, 3], np.int32)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, softmax_scale=1.0)
    np.testing.assert_allclose(out[:, 0, 0], [17.5, 0.0, -7.0], rtol=1e-14)
    np.testing.assert_allclose(lse[0], [math.log(4.0), np.inf, 1.0], rtol=1e-14)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, softmax_scale=1.0)   # not causal: row 0 sees the key
    np.testing.assert_allclose(out[:, 0, 0], [17.5, -7.0, -7.0], rtol=1e-14)
    np.testing.assert_allclose(lse[0], [math.log(4.0), 2.5, 1.0], rtol=1e-14)
    # d out_0 / d v = the weights; the key of sequence 1 gets row 1's whole dout, and nothing from sequence 0
    dout = np.ones_like(q)
    _, _, dv = attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True, softmax_scale=1.0)
    np.testing.assert_allclose(dv[:, 0, 0], [0.25, 0.75, 1.0], rtol=1e-14)


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_reference_matches_dense_reference_per_sequence(rng, opts, heads):
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k, *heads, dtype=np.float64)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, **opts)
    dq, dk, dv = attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, **opts)
    assert out.shape == q.shape and lse.shape == (heads[0], q.shape[0])
    for rows, keys in sequences(cu_q, cu_k):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        want_o, want_l = attention_ref(q[None, rows], k[None, keys], v[None, keys], **opts)
        want_g = attention_ref_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], **opts)
        np.testing.assert_allclose(out[rows], want_o[0], atol=1e-13)
        np.testing.assert_array_equal(np.isinf(lse[:, rows]), np.isinf(want_l[0]))
        fin = np.isfinite(want_l[0])
        np.testing.assert_allclose(lse[:, rows][fin], want_l[0][fin], atol=1e-13)
        for got, want in zip((dq[rows], dk[keys], dv[keys]), want_g):
            np.testing.assert_allclose(got, want[0], atol=1e-12)
    check_empty_sequences(out, lse, (dq, dk, dv), cu_q, cu_k)


# ---------------------------------------------------------------------------------------------------------------
# Validation


def _valid(rng):
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, [3, 0, 5], [4, 2, 6])
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _raises(match, **kwargs):
    with pytest.raises(AttentionInputError, match=match):
        validate_forward(**kwargs)


def test_valid_packed_call(rng):
    args = _valid(rng)
    call = validate_forward(**args, causal=True, max_seqlen_q=5, max_seqlen_k=100)   # a bound, not exact
    assert call.layout == "thd" and call.is_varlen     # layout inferred from the cu_seqlens
    assert (call.batch, call.seqlen_q, call.seqlen_k, call.nheads_q, call.nheads_kv, call.head_dim) == (3, 5, 6, 4, 2, 7)
    assert call.lse_shape == (4, 8)
    assert "thd B=3 total_q=8 total_k=12 max_Sq=5 max_Sk=6" in call.describe()
    assert [tuple(s)[1:] for s in call.packing.sequences()] == [(0, 3, 0, 4), (3, 3, 4, 6), (3, 8, 6, 12)]
    # int64 prefix sums (np.cumsum's default) are accepted too, and so is an explicit layout
    call = validate_forward(**{**args, "cu_seqlens_q": args["cu_seqlens_q"].astype(np.int64)}, layout="thd")
    assert call.packing.total_q == 8


@pytest.mark.parametrize("value,pattern", [
    ([0, 3, 3, 8], r"^cu_seqlens_q: expected a 1-D int32 array .* got an object of type list"),
    (np.array([0, 3, 3, 8], np.float32), r"^cu_seqlens_q: expected dtype int32 \(or int64\), got dtype float32"),
    (np.array([0, 3, 3, 8], np.int16), r"^cu_seqlens_q: expected dtype int32 \(or int64\), got dtype int16"),
    (np.array([[0, 3, 3, 8]], np.int32), r"^cu_seqlens_q: expected a 1-D int32 array .* got shape \(1, 4\)"),
    (np.array([0], np.int32), r"^cu_seqlens_q: expected at least 2 entries .* got shape \(1,\)"),
    (np.array([1, 3, 3, 8], np.int32), r"^cu_seqlens_q: expected cu_seqlens_q\[0\] == 0, got cu_seqlens_q\[0\] = 1"),
    (np.array([0, 4, 3, 8], np.int32), r"^cu_seqlens_q: expected non-decreasing values .* got cu_seqlens_q\[2\] = 3 < "
                                       r"cu_seqlens_q\[1\] = 4"),
    (np.array([0, 3, 3, 7], np.int32), r"^cu_seqlens_q: expected cu_seqlens_q\[-1\] == total_q = 8, got "
                                       r"cu_seqlens_q\[-1\] = 7"),
    (np.array([0, 3, 8], np.int32), r"^cu_seqlens_k: expected B \+ 1 = 3 entries like cu_seqlens_q .* got 4 entries"),
])
def test_bad_cu_seqlens(rng, value, pattern):
    _raises(pattern, **{**_valid(rng), "cu_seqlens_q": value})


@pytest.mark.parametrize("change,pattern", [
    (dict(cu_seqlens_k=None), r"^cu_seqlens_k: expected an int32 array .* needs both cu_seqlens_k and cu_seqlens_q"),
    (dict(cu_seqlens_q=None, layout="thd"), r"^cu_seqlens_q: expected an int32 array"),
    (dict(layout="bshd"), r"^cu_seqlens_q: expected None for layout 'bshd' \(packed sequences take layout 'thd'\)"),
    (dict(max_seqlen_q=4), r"^max_seqlen_q: expected an int >= the longest query sequence \(5\), got 4"),
    (dict(max_seqlen_k=5), r"^max_seqlen_k: expected an int >= the longest key sequence \(6\), got 5"),
    (dict(max_seqlen_k=-1), r"^max_seqlen_k: expected an int >= the longest key sequence \(6\), got -1"),
    (dict(max_seqlen_q=5.0), r"^max_seqlen_q: expected None or an int, got 5.0"),
    (dict(max_seqlen_q=True), r"^max_seqlen_q: expected None or an int, got True"),
])
def test_bad_packing_arguments(rng, change, pattern):
    _raises(pattern, **{**_valid(rng), **change})


def test_bad_shapes_and_lse(rng):
    args = _valid(rng)
    q, k, v = args["q"], args["k"], args["v"]
    _raises(r"^q: expected 3 dimensions \(total_q, Hq, D\) for layout 'thd', got shape \(1, 8, 4, 7\)",
            **{**args, "q": q[None]})
    _raises(r"^k: expected an array", **{**args, "k": list(k)})
    _raises(r"^max_seqlen_q: expected None for layout 'bshd'", q=q[None], k=k[None], v=v[None], max_seqlen_q=3)
    out, lse = np.zeros_like(q), np.zeros((4, 8), np.float32)
    validate_backward(q, q, k, v, out, lse, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=args["cu_seqlens_k"])
    with pytest.raises(AttentionInputError, match=r"^lse: expected shape \(Hq, total_q\) = \(4, 8\), got shape "
                                                  r"\(3, 4, 5\)"):
        validate_backward(q, q, k, v, out, np.zeros((3, 4, 5), np.float32), cu_seqlens_q=args["cu_seqlens_q"],
                          cu_seqlens_k=args["cu_seqlens_k"])


# ---------------------------------------------------------------------------------------------------------------
# The backends

BACKENDS = ["cpu", "rocm"]


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)


def run(backend, q, k, v, dout, cu_q, cu_k, **kw):
    """{out, lse, dq, dk, dv} of ``backend`` as float64; the backward gets the backend's own out and lse."""
    op = backend_registry.get("flash", backend=backend)
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = op.forward(q, k, v, return_lse=True, **packing, **kw)
    grads = op.backward(dout, q, k, v, out, lse, **packing, **kw)
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (f64(x) for x in (out, lse, *grads))))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_float32_matches_reference(rng, backend, opts, lengths):
    q, k, v, dout, cu_q, cu_k = inputs = packed_inputs(rng, *lengths)
    copies = [x.copy() for x in inputs]
    got = run(backend, *inputs, **opts)
    for x, c in zip(inputs, copies):
        np.testing.assert_array_equal(x, c)    # inputs, cu_seqlens included, are never modified
    ref = reference(*inputs, **opts)
    check_float32(got, ref)
    assert not any(np.isnan(g).any() for g in got.values())
    check_empty_sequences(got["out"], got["lse"], (got["dq"], got["dk"], got["dv"]), cu_q, cu_k)


def _naive_torch(q, k, v, cu_q, cu_k, dtype, **kw):
    """Textbook attention in ``dtype`` (scores, softmax and products all in it) over the packed block-diagonal
    mask, with torch autograd: the peer of the contract's float16 rule. Returns out and a function of dout that
    gives dq, dk, dv in that dtype."""
    import torch

    from numba_flash.semantics import effective_window, packed_visible_mask

    qt, kt, vt = (torch.from_numpy(np.asarray(x)).to(dtype).requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scale = kw.get("softmax_scale") or 1 / math.sqrt(q.shape[2])
    mask = torch.from_numpy(packed_visible_mask(cu_q, cu_k, *effective_window(kw.get("causal", False),
                                                                                 kw.get("window_size", (-1, -1)))))
    s = torch.einsum("qhd,khd->hqk", qt * scale, kt.repeat_interleave(group, 1))
    if kw.get("softcap"):
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0)   # rows that see nothing: 0
    out = torch.einsum("hqk,khd->qhd", p, vt.repeat_interleave(group, 1))

    def grads(dout):
        return torch.autograd.grad(out, (qt, kt, vt), torch.from_numpy(dout).to(dtype))

    return out, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", [OPTIONS["causal"], OPTIONS["causal_window_softcap"]], ids=["causal", "window"])
def test_float16_within_the_contracts_rule(rng, backend, opts):
    """float16: relative L2 <= 2e-3, or at most 2x the error of textbook attention computed in float16."""
    pytest.importorskip("torch")
    import torch

    q, k, v, dout, cu_q, cu_k = inputs = packed_inputs(rng, *LENGTHS["mixed"], dtype=np.float16)
    got = run(backend, *inputs, **opts)
    ref = reference(*inputs, **opts)
    naive_out, naive_grads = _naive_torch(q, k, v, cu_q, cu_k, torch.float16, **opts)
    naive = dict(out=naive_out, **dict(zip(("dq", "dk", "dv"), naive_grads(dout))))
    for name in ("out", "dq", "dk", "dv"):
        err = rel_l2(got[name], ref[name])
        assert err <= max(2e-3, 2 * rel_l2(naive[name], ref[name])), (name, err)
    assert np.array_equal(np.isposinf(got["lse"]), np.isposinf(ref["lse"]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_in_one_sequence_stays_there(rng, backend, where):
    """A NaN in sequence 3 (rows 6..14, keys 12..17 of "mixed") leaves every other sequence bitwise as in a clean
    run, forward and backward."""
    clean_inputs = packed_inputs(rng, *LENGTHS["mixed"])
    q, k, v, dout, cu_q, cu_k = bad_inputs = [x.copy() for x in clean_inputs]
    {"q": q, "k": k, "v": v}[where][cu_q[3] + 4 if where == "q" else cu_k[3] + 2, 1, 3] = np.nan
    kw = dict(causal=True)
    clean, bad = run(backend, *clean_inputs, **kw), run(backend, *bad_inputs, **kw)
    rows, keys = slice(cu_q[3], cu_q[4]), slice(cu_k[3], cu_k[4])
    other_rows = np.ones(q.shape[0], bool)
    other_rows[rows] = False
    other_keys = np.ones(k.shape[0], bool)
    other_keys[keys] = False
    for name in ("out", "dq"):
        np.testing.assert_array_equal(bad[name][other_rows], clean[name][other_rows])
        assert np.isnan(bad[name][rows]).any(), name
    np.testing.assert_array_equal(bad["lse"][:, other_rows], clean["lse"][:, other_rows])
    for name in ("dk", "dv"):
        np.testing.assert_array_equal(bad[name][other_keys], clean[name][other_keys])


def test_cpu_serves_every_sequence_in_one_call(rng, monkeypatch):
    """No padding to the longest sequence and no call per sequence: the CPU kernels get the packed arrays
    themselves, once, with the prefix sums (``numba_flash.cpu.schedule``)."""
    import numba_flash.cpu as cpu

    calls = []
    real = cpu.flash_forward

    def spy(q, k, v, out, lse, *args, **kwargs):
        calls.append((q.shape, k.shape, out.shape, lse.shape, kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"]))
        real(q, k, v, out, lse, *args, **kwargs)

    monkeypatch.setattr(cpu, "flash_forward", spy)
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, _, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k)
    backend_registry.get("flash", backend="cpu").forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert len(calls) == 1
    assert calls[0][:4] == (q.shape, k.shape, q.shape, (4, q.shape[0]))
    np.testing.assert_array_equal(calls[0][4], cu_q)
    np.testing.assert_array_equal(calls[0][5], cu_k)


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, *LENGTHS["mixed"])
    t = [torch.from_numpy(x) for x in (q, k, v, dout)]
    for backend in BACKENDS:
        op = backend_registry.get("flash", backend=backend)
        kw = dict(cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=torch.from_numpy(cu_k), causal=True)
        out, lse = op.forward(*t[:3], return_lse=True, **kw)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == q.shape
        assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (4, q.shape[0])
        grads = op.backward(t[3], *t[:3], out, lse, **kw)
        assert all(isinstance(g, torch.Tensor) for g in grads)
        check_float32(dict(zip(("out", "lse", "dq", "dk", "dv"), (f64(x) for x in (out, lse, *grads)))),
                      reference(q, k, v, dout, cu_q, cu_k, causal=True))


def test_explain_and_backends_without_packed_sequences(rng):
    """explain() describes a packed call; a backend that does not list "thd" in SUPPORTED_LAYOUTS (a third-party
    one written before packed sequences) is passed over, and says why when forced."""
    from backends.base import Backend
    from numba_flash import NoBackendError

    class DenseOnly(Backend):
        name = "dense_only"
        PRIORITY = 1000

        def forward(self, call):
            raise AssertionError("a packed call must not reach a dense-only backend")

    backend_registry.register("flash", "dense_only", DenseOnly, replace=True)
    try:
        args = _valid(rng)
        q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
        text = backend_registry.get("flash").explain(q, k, v, **args)
        assert "thd B=3 total_q=8" in text and "chosen: cpu" in text
        assert "dense_only [priority 1000]: layout 'thd' not supported" in text
        with pytest.raises(NoBackendError, match="dense_only: layout 'thd' not supported"):
            backend_registry.get("flash", backend="dense_only").forward(q, k, v, **args)
    finally:
        backend_registry.unregister("flash", "dense_only")


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_varlen_func: torch tensors, autograd

# flash_attn_varlen_func's parameters in flash-attn (2.6 and later, without its paged-KV block_table), by hand from
# its documented signature, then this library's keyword-only ones.
FLASH_ATTN_VARLEN_PARAMETERS = [
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", ("dropout_p", 0.0),
    ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
    ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
]


def _torch_inputs(rng, lengths=LENGTHS["mixed"], hq=4, hkv=2, d=7, dtype="float32"):
    torch = pytest.importorskip("torch")
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, *lengths, hq, hkv, d, dtype=np.float64)
    qkv = [torch.from_numpy(x).to(getattr(torch, dtype)).requires_grad_() for x in (q, k, v)]
    return qkv, torch.from_numpy(dout).to(getattr(torch, dtype)), torch.from_numpy(cu_q), torch.from_numpy(cu_k)


def test_varlen_func_signature():
    import inspect

    pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    params = list(inspect.signature(flash_attn_varlen_func).parameters.values())
    positional = [p.name if p.default is p.empty else (p.name, p.default) for p in params
                  if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FLASH_ATTN_VARLEN_PARAMETERS
    assert [(p.name, p.default) for p in params if p.kind == p.KEYWORD_ONLY] == [("return_lse", False),
                                                                                ("backend", None),
                                                                                ("dropout_seed", None),
                                                                                ("precision", "ieee")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_func_gradcheck_float64(rng, backend):
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    (q, k, v), _, cu_q, cu_k = _torch_inputs(rng, ([3, 0, 1, 4], [2, 3, 1, 5]), 2, 1, 3, "float64")

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True, softcap=2.0, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_varlen_func_float32_autograd_matches_reference(rng, backend, opts):
    from numba_flash import flash_attn_varlen_func

    (q, k, v), dout, cu_q, cu_k = _torch_inputs(rng)
    kw = {name: opts[name] for name in ("causal", "window_size", "softcap", "softmax_scale") if name in opts}
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 11, return_lse=True, backend=backend, **kw)
    out.backward(dout)
    ref = reference(q.detach(), k.detach(), v.detach(), dout, cu_q.numpy(), cu_k.numpy(), **opts)
    check_float32(dict(out=f64(out), lse=f64(lse), dq=f64(q.grad), dk=f64(k.grad), dv=f64(v.grad)), ref)
    assert lse.shape == (4, q.shape[0]) and not lse.requires_grad


def test_varlen_func_extras_numpy_cu_seqlens_and_bad_input(rng):
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    (q, k, v), _, cu_q, cu_k = _torch_inputs(rng)
    # positional flash-attn call: dropout_p, softmax_scale, causal
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 11, 0.0, None, True, backend="cpu")
    want = attention_ref_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal=True)[0]
    assert np.abs(f64(out) - want).max() <= 1e-5
    # numpy prefix sums (int64, as np.cumsum makes them) and no max_seqlen
    same = flash_attn_varlen_func(q, k, v, cu_q.numpy().astype(np.int64), cu_k.numpy(), None, None, causal=True,
                                  backend="cpu")
    assert torch.equal(out, same)
    with pytest.raises(AttentionInputError, match=r"^dropout_p: expected a real number in \[0, 1\), got 1.5"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 11, 1.5)
    with pytest.raises(AttentionInputError, match=r"^max_seqlen_k: expected an int >= the longest key sequence"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 10)
    with pytest.raises(AttentionInputError, match=r"^cu_seqlens_q: expected non-decreasing"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 6, 5, 22], dtype=torch.int32), cu_k[:4], 9, 11)
    with pytest.raises(AttentionInputError, match=r"^q: expected a torch.Tensor"):
        flash_attn_varlen_func(q.detach().numpy(), k, v, cu_q, cu_k, 9, 11)


def test_varlen_ops_pass_opcheck_and_compile(rng):
    """Schema and fake implementations agree with the real ops; torch.compile runs them as opaque nodes."""
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func
    from numba_flash.torch_varlen import flash_varlen_bwd, flash_varlen_fwd

    (q, k, v), dout, cu_q, cu_k = _torch_inputs(rng, ([3, 0, 5], [4, 2, 6]))
    args = (q.detach(), k.detach(), v.detach(), cu_q, cu_k, 5, 6, True, None, -1, 0, 0.0, "cpu")
    torch.library.opcheck(flash_varlen_fwd, args)
    out, lse = flash_varlen_fwd(*args)
    torch.library.opcheck(flash_varlen_bwd, (dout, *args[:3], out, lse, *args[3:]))

    def loss(q, k, v):
        return (flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, backend="cpu") ** 2).sum()

    got = torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v)
    got.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = loss(q, k, v)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-6)
    for g, x in zip(grads, (q, k, v)):
        assert torch.allclose(g, x.grad, rtol=1e-6, atol=1e-7)
