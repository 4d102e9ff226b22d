"""Paged keys on packed calls (``block_table``, flash-attn's paged prefill): the reference's reading of the pages,
the CPU and ROCm (torch) backends through ``op.forward`` / ``op.backward`` and through ``flash_attn_varlen_func``
with autograd, against the float64 reference and against the same call with the keys already packed, and every
rule of the bad-input checks. The CUDA backend runs one case under the simulator in
``tests/numba_flash/cuda/test_varlen_sim.py``.

Inputs are fresh N(0, 1) draws packed into sequences of odd lengths (empty ones included), their keys placed on
pages of odd sizes in shuffled block order, shared by no two sequences, among spare pages; every cache row no
sequence reads holds NaN (or large garbage), so any read of one shows.
"""

from __future__ import annotations

import numpy as np
import pytest

from varlen_cases import NAMES, check_empty_sequences, check_float32, f64, packed_inputs, page_keys, unread_rows

from backends import backend_registry
from numba_flash import AttentionInputError, attention_ref_varlen, attention_ref_varlen_backward

# (query lengths, key lengths): a sequence with rows but no keys, one with keys but no rows, a 1 x 1 one, Sq > Sk.
LENS_Q, LENS_K = [5, 0, 1, 9, 4, 3], [8, 3, 1, 6, 0, 21]
BACKENDS = ["cpu", "rocm"]
OPTIONS = {
    "causal": dict(causal=True),
    "window_softcap": dict(causal=True, window_size=(2, -1), softcap=1.5, softmax_scale=0.4),
}


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)


def _inputs(rng, page_size, fill=np.nan, hq=4, hkv=2, d=7, lens=(LENS_Q, LENS_K), extra_columns=1):
    """q, packed k and v, dout, cu_q, cu_k, and the paged k_cache, v_cache and block_table of the same keys."""
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, *lens, hq, hkv, d)
    k_cache, v_cache, table = page_keys(rng, k, v, cu_k, page_size, fill=fill, extra_columns=extra_columns)
    return q, k, v, dout, cu_q, cu_k, k_cache, v_cache, table


def _run(backend, q, k, v, dout, cu_q, cu_k, **kw):
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    return dict(zip(NAMES, (out, lse, *grads)))


def _check_paged_grads(got, packed_grads, table, cu_k):
    """dk, dv of the paged call: each read row holds its packed key's gradient exactly, every other row 0."""
    for name, packed in zip(("dk", "dv"), packed_grads):
        paged = f64(got[name])
        unread = unread_rows(table, cu_k, *paged.shape[:2])
        assert np.all(paged[unread] == 0), name
        rows = [paged[table[b, j // paged.shape[1]], j % paged.shape[1]]
                for b in range(len(cu_k) - 1) for j in range(cu_k[b + 1] - cu_k[b])]
        np.testing.assert_array_equal(np.array(rows), f64(packed), err_msg=name)


# ---------------------------------------------------------------------------------------------------------------
# The reference


@pytest.mark.parametrize("page_size", [5, 16])
def test_reference_reads_the_pages_as_the_packed_keys(rng, page_size):
    """The paged reference equals the packed one on the same keys, bit for bit, and its dk, dv land on the rows
    the keys came from (0 elsewhere, NaN in those rows or not)."""
    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, page_size)
    packed = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True)
    paged = attention_ref_varlen(q, kc, vc, cu_q, cu_k, causal=True, block_table=table)
    for a, b in zip(packed, paged):
        np.testing.assert_array_equal(a, b)
    dq, dk, dv = attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True)
    got = dict(zip(("dq", "dk", "dv"), attention_ref_varlen_backward(dout, q, kc, vc, cu_q, cu_k, causal=True,
                                                                      block_table=table)))
    np.testing.assert_array_equal(got["dq"], dq)
    assert got["dk"].shape == kc.shape and got["dv"].shape == vc.shape
    _check_paged_grads(got, (dk, dv), table, cu_k)


# ---------------------------------------------------------------------------------------------------------------
# op.forward / op.backward (numpy arrays)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("page_size", [5, 16])
def test_float32_matches_reference(rng, backend, opts, page_size):
    q, k, v, dout, cu_q, cu_k, kc, vc, table = inputs = _inputs(rng, page_size)
    copies = [x.copy() for x in inputs]
    got = _run(backend, q, kc, vc, dout, cu_q, cu_k, block_table=table, **opts)
    for x, c in zip(inputs, copies):
        np.testing.assert_array_equal(x, c)    # inputs, block_table and the NaN rows included, never modified
    assert got["dk"].shape == kc.shape and got["dv"].shape == vc.shape
    ref = dict(zip(NAMES, attention_ref_varlen(q, kc, vc, cu_q, cu_k, block_table=table, **opts)
                   + attention_ref_varlen_backward(dout, q, kc, vc, cu_q, cu_k, block_table=table, **opts)))
    got = {name: f64(x) for name, x in got.items()}
    check_float32(got, ref)
    assert not any(np.isnan(g).any() for g in got.values())
    unread = unread_rows(table, cu_k, *kc.shape[:2])
    assert np.all(got["dk"][unread] == 0) and np.all(got["dv"][unread] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_as_the_packed_call(rng, backend):
    """The paged call gives what the call with the keys already packed gives, bit for bit (garbage, not NaN, in the
    rows nobody reads; a page size of 1, a table row with exactly the pages its sequence needs, and an unbalanced
    mix of heads)."""
    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, 1, fill="garbage", hq=3, hkv=1, d=5, extra_columns=0)
    packed = _run(backend, q, k, v, dout, cu_q, cu_k, causal=True)
    paged = _run(backend, q, kc, vc, dout, cu_q, cu_k, causal=True, block_table=table)
    for name in ("out", "lse", "dq"):
        np.testing.assert_array_equal(f64(paged[name]), f64(packed[name]), err_msg=name)
    _check_paged_grads(paged, (packed["dk"], packed["dv"]), table, cu_k)
    check_empty_sequences(f64(paged["out"]), f64(paged["lse"]), (f64(paged["dq"]), f64(packed["dk"]),
                                                                 f64(packed["dv"])), cu_q, cu_k)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: each rule once


def _bad(rng):
    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, 5)
    return dict(q=q, k=kc, v=vc, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=table)


def _set(x, index, value):
    x = x.copy()
    x[index] = value
    return x


# Sequence 5 has 21 keys: 5 pages of 5; sequence 0 has 8 keys: 2 pages. 11 pages used, 3 spare; 6 columns.
BAD = {
    "dtype": (lambda a: dict(block_table=a["block_table"].astype(np.float32)),
              r"^block_table: expected dtype int32 \(or int64\), got dtype float32"),
    "not 2-D": (lambda a: dict(block_table=a["block_table"][0]),
                r"^block_table: expected an int32 array \(B, max_blocks\) with B = 6, got shape \(6,\)"),
    "rows": (lambda a: dict(block_table=a["block_table"][:5]),
             r"^block_table: expected shape \(6, 6\) \(B, max_blocks\) with B = 6 \(the sequences of cu_seqlens_k\), "
             r"got shape \(5, 6\)"),
    "not an array": (lambda a: dict(block_table=a["block_table"].tolist()),
                     r"^block_table: expected an int32 array \(B, max_blocks\) with B = 6, got an object of type "
                     r"list"),
    "too few pages": (lambda a: dict(block_table=a["block_table"][:, :4]),
                      r"^block_table: expected at least 5 pages in row 5 \(sequence 5 has 21 keys, page_size 5\), "
                      r"got max_blocks = 4"),
    "index too big": (lambda a: dict(block_table=_set(a["block_table"], (0, 1), len(a["k"]))),
                      r"^block_table: expected block indices in \[0, 14\) for the pages sequence 0 uses, got "
                      r"block_table\[0, 1\] = 14"),
    "index negative": (lambda a: dict(block_table=_set(a["block_table"], (5, 4), -1)),
                       r"^block_table: expected block indices in \[0, 14\) for the pages sequence 5 uses, got "
                       r"block_table\[5, 4\] = -1"),
    "k not paged": (lambda a: dict(k=a["k"][0]),
                    r"^k: expected 4 dimensions \(num_blocks, page_size, Hkv, D\) with block_table \(a paged cache\), "
                    r"got shape \(5, 2, 7\)"),
    "v pages unlike k's": (lambda a: dict(v=a["v"][:, :4]),
                           r"^v: expected the blocks, page size and heads of k \(14, 5, 2\)"),
    "page size 0": (lambda a: dict(k=a["k"][:, :0], v=a["v"][:, :0]),
                    r"^k: expected num_blocks >= 1 and page_size >= 1"),
    "k not an array": (lambda a: dict(k=a["k"].tolist()),
                       r"^k: expected a paged cache \(num_blocks, page_size, Hkv, D\) as a numpy array or a torch "
                       r"tensor with block_table .*got an object of type list"),
    "no packed call": (lambda a: dict(cu_seqlens_q=None, cu_seqlens_k=None),
                       r"^block_table: expected None unless the call is packed .*got cu_seqlens_k None"),
    "dense layout": (lambda a: dict(layout="bshd"), r"^block_table: expected None unless the call is packed .*got "
                                                     r"layout 'bshd'"),
    "bad cu_seqlens_k": (lambda a: dict(cu_seqlens_k=_set(a["cu_seqlens_k"], 2, 1)),
                         r"^cu_seqlens_k: expected non-decreasing values"),
    "paged k without block_table": (lambda a: dict(block_table=None),
                                    r"^k: expected 3 dimensions \(total_k, Hkv, D\) for layout 'thd'"),
    "k's dtype unlike q's": (lambda a: dict(k=a["k"].astype(np.float64), v=a["v"].astype(np.float64)),
                             r"^k: expected the same dtype as q \(float32\), got dtype float64"),
}


@pytest.mark.parametrize("change,pattern", BAD.values(), ids=BAD.keys())
def test_bad_paging_is_refused_by_name(rng, change, pattern):
    args = _bad(rng)
    args.update(change(args))
    copies = {name: np.array(x, copy=True) for name, x in args.items() if isinstance(x, np.ndarray)}
    op = backend_registry.get("flash", backend="cpu")
    with pytest.raises(AttentionInputError, match=pattern):
        op.forward(**args)
    dout = np.zeros_like(args["q"])
    lse = np.zeros((args["q"].shape[1], args["q"].shape[0]), np.float32)
    with pytest.raises(AttentionInputError, match=pattern):
        op.backward(dout, args.pop("q"), args.pop("k"), args.pop("v"), dout, lse, **args)
    for name, c in copies.items():
        if name in args:
            np.testing.assert_array_equal(args[name], c)


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_varlen_func (torch, autograd)


def _tensors(torch, arrays, dtype="float32"):
    return [torch.from_numpy(x).to(getattr(torch, dtype)).requires_grad_() for x in arrays]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [5, 16])
def test_varlen_func_autograd_matches_reference(rng, backend, page_size):
    """Gradients of q and of the paged k and v through autograd, against the reference; rows nobody reads get
    exactly 0; the same as the face's call with the keys already packed, bit for bit."""
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, page_size)
    tq, tkc, tvc = _tensors(torch, (q, kc, vc))
    tdout, t_cu_q, t_cu_k, t_table = (torch.from_numpy(x) for x in (dout, cu_q, cu_k, table))
    kw = dict(causal=True, window_size=(4, -1), softcap=2.0)
    # positional, in flash-attn's order: ..., alibi_slopes, deterministic, return_attn_probs, block_table
    out, lse = flash_attn_varlen_func(tq, tkc, tvc, t_cu_q, t_cu_k, 9, 21, 0.0, None, kw["causal"], kw["window_size"],
                                      kw["softcap"], None, False, False, t_table, return_lse=True, backend=backend)
    out.backward(tdout)
    got = dict(zip(NAMES, (f64(x) for x in (out, lse, tq.grad, tkc.grad, tvc.grad))))
    ref = dict(zip(NAMES, attention_ref_varlen(q, kc, vc, cu_q, cu_k, block_table=table, **kw)
                   + attention_ref_varlen_backward(dout, q, kc, vc, cu_q, cu_k, block_table=table, **kw)))
    check_float32(got, ref)
    unread = unread_rows(table, cu_k, *kc.shape[:2])
    assert np.all(got["dk"][unread] == 0) and np.all(got["dv"][unread] == 0)
    assert torch.equal(t_table, torch.from_numpy(table)) and torch.isnan(tkc.detach()[torch.from_numpy(unread)]).all()

    pq, pk, pv = _tensors(torch, (q, k, v))
    packed_out = flash_attn_varlen_func(pq, pk, pv, t_cu_q, t_cu_k, 9, 21, backend=backend, **kw)
    packed_out.backward(tdout)
    assert torch.equal(out, packed_out) and torch.equal(tq.grad, pq.grad)
    _check_paged_grads(dict(dk=tkc.grad, dv=tvc.grad), (pk.grad, pv.grad), table, cu_k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_func_gradcheck_float64(rng, backend):
    """Finite differences over every element of the paged caches, the rows nobody reads included (their
    gradient must be 0), with a numpy block table of int64."""
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    q, k, v, _, cu_q, cu_k = packed_inputs(rng, [3, 0, 2], [4, 2, 5], 2, 1, 3, dtype=np.float64)
    kc, vc, table = page_keys(rng, k, v, cu_k, 3, spare=1, fill="garbage")
    args = _tensors(torch, (q, kc, vc), "float64")
    t_cu_q, t_cu_k = torch.from_numpy(cu_q), torch.from_numpy(cu_k)

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, t_cu_q, t_cu_k, 3, 5, causal=True, block_table=table.astype(np.int64),
                                      backend=backend)

    assert torch.autograd.gradcheck(f, args)


def test_varlen_func_refuses_bad_paging_before_any_work(rng):
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, 5)
    tq, tkc, tvc = _tensors(torch, (q, kc, vc))
    bad = torch.from_numpy(_set(table, (3, 1), 99))
    with pytest.raises(AttentionInputError, match=r"^block_table: expected block indices in \[0, 14\) for the pages "
                                                  r"sequence 3 uses, got block_table\[3, 1\] = 99"):
        flash_attn_varlen_func(tq, tkc, tvc, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 9, 21, block_table=bad)
    with pytest.raises(AttentionInputError, match=r"^k: expected 4 dimensions \(num_blocks, page_size, Hkv, D\) "
                                                  r"with block_table"):
        flash_attn_varlen_func(tq, *_tensors(torch, (k, v)), torch.from_numpy(cu_q), torch.from_numpy(cu_k), 9, 21,
                               block_table=torch.from_numpy(table))


def test_varlen_paged_ops_pass_opcheck_and_compile(rng):
    """The ops' schema and fake implementations with a block table (the fake backward's dk, dv are paged), and
    torch.compile running them as opaque nodes."""
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func
    from numba_flash.torch_varlen import flash_varlen_bwd, flash_varlen_fwd

    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, 5, fill="garbage", lens=([3, 0, 5], [4, 2, 6]))
    tq, tkc, tvc = _tensors(torch, (q, kc, vc))
    t_cu_q, t_cu_k, t_table = (torch.from_numpy(x) for x in (cu_q, cu_k, table))
    args = (tq.detach(), tkc.detach(), tvc.detach(), t_cu_q, t_cu_k, 5, 6, True, None, -1, 0, 0.0, "cpu")
    extras = (None, 0.0, 0)
    torch.library.opcheck(flash_varlen_fwd, args + extras + ("ieee", t_table))
    out, lse = flash_varlen_fwd(*args, *extras, "ieee", t_table)
    torch.library.opcheck(flash_varlen_bwd, (torch.from_numpy(dout), *args[:3], out, lse, *args[3:], *extras,
                                             t_table))

    def loss(q, k, v):
        return (flash_attn_varlen_func(q, k, v, t_cu_q, t_cu_k, 5, 6, causal=True, block_table=t_table,
                                       backend="cpu") ** 2).sum()

    got = torch.compile(loss, backend="aot_eager", fullgraph=True)(tq, tkc, tvc)
    got.backward()
    grads = [x.grad.clone() for x in (tq, tkc, tvc)]
    for x in (tq, tkc, tvc):
        x.grad = None
    want = loss(tq, tkc, tvc)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-6)
    for g, x in zip(grads, (tq, tkc, tvc)):
        assert g.shape == x.shape and torch.allclose(g, x.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_page_gets_the_sum_of_its_gradients(rng, backend):
    """Two sequences with one prompt prefix on the same page (prefix caching) read it both; its gradient is the sum
    of what each read got, through op.backward (numpy) and through autograd (torch)."""
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, [3, 4], [7, 6], 2, 1, 5)
    k[7:11], v[7:11] = k[0:4], v[0:4]                    # the same first 4 keys
    kc, vc, table = page_keys(rng, k, v, cu_k, 4, fill="garbage")
    shared, spare = table[0, 0], table[1, 0]
    table[1, 0] = shared
    packed = _run(backend, q, k, v, dout, cu_q, cu_k, causal=True)
    paged = _run(backend, q, kc, vc, dout, cu_q, cu_k, causal=True, block_table=table)
    tq, tkc, tvc = _tensors(torch, (q, kc, vc))
    out = flash_attn_varlen_func(tq, tkc, tvc, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 4, 7, causal=True,
                                 block_table=torch.from_numpy(table), backend=backend)
    out.backward(torch.from_numpy(dout))
    np.testing.assert_array_equal(f64(out), f64(packed["out"]))
    for name, grad in (("dk", tkc.grad), ("dv", tvc.grad)):
        for got in (f64(paged[name]), f64(grad)):
            np.testing.assert_allclose(got[shared], f64(packed[name][0:4]) + f64(packed[name][7:11]), rtol=1e-6,
                                       atol=1e-6)
            assert not got[spare].any()


def test_explain_takes_the_paged_call(rng):
    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, 5)
    op = backend_registry.get("flash")
    assert op.explain(q, kc, vc, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=table, backend="cpu").chosen == "cpu"


def test_float16_keeps_its_dtype_and_equals_the_packed_call(rng):
    """float16 on the torch path: the gathered keys and the paged gradients keep the dtype, and the paged call
    gives the packed call's bits."""
    torch = pytest.importorskip("torch")
    from numba_flash import flash_attn_varlen_func

    q, k, v, dout, cu_q, cu_k, kc, vc, table = _inputs(rng, 5, fill="garbage")
    t_cu_q, t_cu_k, t_table = (torch.from_numpy(x) for x in (cu_q, cu_k, table))
    paged, packed = _tensors(torch, (q, kc, vc), "float16"), _tensors(torch, (q, k, v), "float16")
    outs = [flash_attn_varlen_func(*args, t_cu_q, t_cu_k, 9, 21, causal=True, block_table=bt, backend="rocm")
            for args, bt in ((paged, t_table), (packed, None))]
    for out in outs:
        out.backward(torch.from_numpy(dout).half())
    assert torch.equal(outs[0], outs[1]) and torch.equal(paged[0].grad, packed[0].grad)
    assert paged[1].grad.dtype == torch.float16 and paged[1].grad.shape == kc.shape
    _check_paged_grads(dict(dk=paged[1].grad, dv=paged[2].grad), (packed[1].grad, packed[2].grad), table, cu_k)
