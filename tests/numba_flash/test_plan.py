"""Plans for loops (``op.plan`` / ``plan.run``, ``numba_flash.plan``): a plan reused over steps of fresh random
inputs gives the bits a fresh ``op.forward`` (and ``op.backward``) gives on the same inputs and matches the float64
reference; a step whose array has another signature is refused by name with the planned facts and those that came,
and never runs; a bad call reads the same at plan time as through ``op.forward``; inputs are never modified; a run
does not check the call again.

Sizes are odd on purpose (B = 2, Sq = 7, Sk = 13, Hq = 4, Hkv = 2, D = 24); packed sequences have an empty one.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash.plan as plan_module
import numba_flash.validation as validation
from backends import backend_registry
from backends.base import Backend
from numba_flash import AttentionInputError, attention_ref, attention_ref_varlen
from numba_flash.errors import BackendDeclined

B, SQ, SK, HQ, HKV, D = 2, 7, 13, 4, 2, 24
LENS_Q, LENS_K = [5, 0, 9], [8, 3, 11]
CU_Q = np.concatenate([[0], np.cumsum(LENS_Q)]).astype(np.int32)
CU_K = np.concatenate([[0], np.cumsum(LENS_K)]).astype(np.int32)
PAGE_SIZE, NUM_BLOCKS = 5, 9       # the sequences use 2 + 1 + 3 pages; 3 are spare
STEPS = 3


def _block_table() -> np.ndarray:
    """Each sequence's pages in shuffled block order, padded with -1 (never read)."""
    order = np.random.default_rng(1).permutation(NUM_BLOCKS)
    table = np.full((len(LENS_K), 4), -1, np.int32)
    used = 0
    for b, n in enumerate(-(-np.array(LENS_K) // PAGE_SIZE)):
        table[b, :n] = order[used:used + n]
        used += n
    return table


SLOPES = np.array([0.3, 0.1, 0.05, 0.5], np.float32)
# name -> (the fixed arguments of the plan, the shapes of one step's q, k, v)
CASES = {
    "causal": (dict(causal=True), [(B, SQ, HQ, D), (B, SK, HKV, D), (B, SK, HKV, D)]),
    "window": (dict(window_size=(4, 2), softmax_scale=0.3), [(B, SQ, HQ, D), (B, SK, HKV, D), (B, SK, HKV, D)]),
    "gqa_bhsd": (dict(layout="bhsd", softcap=2.0), [(B, HQ, SQ, D), (B, 1, SK, D), (B, 1, SK, 16)]),
    "alibi": (dict(causal=True, alibi_slopes=SLOPES), [(B, SQ, HQ, D), (B, SK, HKV, D), (B, SK, HKV, D)]),
    "packed": (dict(causal=True, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=9, max_seqlen_k=11),
               [(CU_Q[-1], HQ, D), (CU_K[-1], HKV, D), (CU_K[-1], HKV, D)]),
    "paged": (dict(causal=True, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, block_table=_block_table()),
              [(CU_Q[-1], HQ, D), (NUM_BLOCKS, PAGE_SIZE, HKV, D), (NUM_BLOCKS, PAGE_SIZE, HKV, D)]),
}


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)


@pytest.fixture
def op():
    return backend_registry.get("flash", backend="cpu")


def _step(rng, case, dtype=np.float32):
    return [rng.standard_normal(shape).astype(dtype) for shape in CASES[case][1]]


def _reference(case, q, k, v):
    options = dict(CASES[case][0])
    if "cu_seqlens_q" in options:
        for name in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"):
            options.pop(name, None)
        return attention_ref_varlen(q, k, v, CU_Q, CU_K, **options)
    return attention_ref(q, k, v, **options)


@pytest.mark.parametrize("case", CASES)
def test_each_step_gives_the_bits_of_a_fresh_forward_and_matches_the_reference(rng, op, case):
    options = CASES[case][0]
    plan = op.plan(*_step(rng, case), return_lse=True, **options)
    for _ in range(STEPS):
        q, k, v = _step(rng, case)
        out, lse = plan.run(q, k, v)
        fresh_out, fresh_lse = op.forward(q, k, v, return_lse=True, **options)
        np.testing.assert_array_equal(out, fresh_out)
        np.testing.assert_array_equal(lse, fresh_lse)
        ref_out, ref_lse = _reference(case, q, k, v)
        assert out.dtype == np.float32 and out.shape == ref_out.shape
        assert np.abs(out - ref_out).max() <= 1e-5
        seen = np.isfinite(ref_lse)   # rows of the empty sequence see no key: +inf on both sides
        np.testing.assert_array_equal(np.isposinf(lse), ~seen)
        assert np.abs(lse[seen] - ref_lse[seen]).max() <= 1e-5 * (1 + np.abs(ref_lse[seen]).max())


def test_a_plan_without_return_lse_returns_out_alone(rng, op):
    plan = op.plan(*_step(rng, "causal"), causal=True)
    q, k, v = _step(rng, "causal")
    np.testing.assert_array_equal(plan.run(q, k, v), op.forward(q, k, v, causal=True))


@pytest.mark.parametrize("case", ["causal", "paged"])
def test_backward_gives_the_bits_of_a_fresh_backward(rng, op, case):
    options = CASES[case][0]
    plan = op.plan(*_step(rng, case), return_lse=True, **options)
    for _ in range(2):
        q, k, v = _step(rng, case)
        out, lse = plan.run(q, k, v)
        dout = rng.standard_normal(out.shape).astype(np.float32)
        got = plan.backward(dout, q, k, v, out, lse)
        want = op.backward(dout, q, k, v, out, lse, **options)
        assert len(got) == 3
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
    with pytest.raises(AttentionInputError, match=r"^dout: expected the planned array") as info:
        plan.backward(dout[:-1], q, k, v, out, lse)
    assert str(tuple(dout.shape)) in str(info.value) and str(tuple(dout[:-1].shape)) in str(info.value)


def test_torch_tensors_give_the_bits_of_a_fresh_forward(rng):
    torch = pytest.importorskip("torch")
    op = backend_registry.get("flash")
    plan = op.plan(*(torch.from_numpy(x) for x in _step(rng, "causal")), causal=True, return_lse=True)
    for _ in range(2):
        q, k, v = (torch.from_numpy(x) for x in _step(rng, "causal"))
        out, lse = plan.run(q, k, v)
        fresh_out, fresh_lse = op.forward(q, k, v, causal=True, return_lse=True)
        assert type(out) is type(fresh_out) and torch.equal(out, fresh_out) and torch.equal(lse, fresh_lse)
    with pytest.raises(AttentionInputError, match=r"^k: expected the planned array, a torch\.Tensor") as info:
        plan.run(q, k.numpy(), v)
    assert "got a numpy.ndarray" in str(info.value) and "differs in type" in str(info.value)


def _cpu_backend():
    return next(be for be in backend_registry.backends("flash") if be.name == "cpu")


def _changes(q, k, v):
    """(argument, what to pass instead, the fact that differs) for each way a step can break its plan."""
    transposed = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)   # v's values, other strides
    return [
        ("q", np.concatenate([q, q[:, :1]], axis=1), "shape"),
        ("k", k.astype(np.float64), "dtype"),
        ("v", transposed, "strides"),
        ("q", np.ma.masked_array(q), None),
        ("k", k.tolist(), None),
    ]


@pytest.mark.parametrize("change", range(5))
def test_a_step_of_another_signature_is_refused_by_name_and_never_runs(rng, op, monkeypatch, change):
    plan = op.plan(*_step(rng, "causal"), causal=True)
    q, k, v = _step(rng, "causal")
    arrays = dict(q=q, k=k, v=v)
    name, other, differs = _changes(q, k, v)[change]
    planned = arrays[name]
    runs = []
    with monkeypatch.context() as patched, \
            pytest.raises(AttentionInputError, match=rf"^{name}: expected the planned array") as info:
        patched.setattr(_cpu_backend(), "forward", lambda call: runs.append(call) or ("ran", None))
        plan.run(**{**arrays, name: other})
    message = str(info.value)
    assert str(planned.shape) in message and str(planned.strides) in message and str(planned.dtype) in message
    if differs is not None:
        assert f"differs in {differs}" in message
        assert str(getattr(other, differs)) in message
    assert "got a " in message and runs == []
    # the plan itself is intact: a step of its signature still runs
    np.testing.assert_array_equal(plan.run(q, k, v), op.forward(q, k, v, causal=True))


def test_a_paged_step_checks_the_caches(rng, op):
    plan = op.plan(*_step(rng, "paged"), **CASES["paged"][0])
    q, k, v = _step(rng, "paged")
    with pytest.raises(AttentionInputError, match=r"^v: expected the planned array") as info:
        plan.run(q, k, v[:-1])
    assert f"shape {v.shape}" in str(info.value) and f"shape {v[:-1].shape}" in str(info.value)


BAD_CALLS = {
    "k's head dim": (lambda q, k, v: (q, k[..., :-1], v), {}),
    "window": (lambda q, k, v: (q, k, v), dict(window_size=(-2, 0))),
    "heads": (lambda q, k, v: (q[:, :, :3], k, v), {}),
    "v's length": (lambda q, k, v: (q, k, v[:, :-1]), dict(causal=True)),
    "layout": (lambda q, k, v: (q, k, v), dict(layout="sbhd")),
    "cu_seqlens": (lambda q, k, v: (q[0], k[0], v[0]), dict(cu_seqlens_q=CU_Q[::-1].copy(), cu_seqlens_k=CU_K)),
    "block_table": (lambda q, k, v: (q[0], k, v), dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K,
                                                       block_table=_block_table()[:, :1])),
    "deterministic": (lambda q, k, v: (q, k, v), dict(deterministic="yes")),
}


@pytest.mark.parametrize("bad", BAD_CALLS)
def test_a_bad_call_is_refused_at_plan_time_as_op_forward_refuses_it(rng, op, bad):
    edit, options = BAD_CALLS[bad]
    q, k, v = edit(*_step(rng, "causal"))
    with pytest.raises(AttentionInputError) as by_forward:
        op.forward(q, k, v, **options)
    with pytest.raises(AttentionInputError) as by_plan:
        op.plan(q, k, v, **options)
    assert type(by_plan.value) is type(by_forward.value)
    assert str(by_plan.value) == str(by_forward.value)


def test_what_only_a_plan_refuses_is_named(rng, op):
    q, k, v = _step(rng, "causal")
    with pytest.raises(AttentionInputError, match=r"^dropout_p: expected 0 in a plan .* got 0\.1$"):
        op.plan(q, k, v, dropout_p=0.1, dropout_seed=3)
    with pytest.raises(AttentionInputError, match=r"^q: expected a numpy array or a strided torch tensor .* got a "
                                                  r"numpy\.ma\.(core\.)?MaskedArray of shape \(2, 7, 4, 24\)$"):
        op.plan(np.ma.masked_array(q), k, v)
    with pytest.raises(AttentionInputError, match=r"^casual: not an argument of Dispatcher\.plan\(\); did you mean "
                                                  r"'causal'\?$"):
        op.plan(q, k, v, casual=True)


@pytest.mark.parametrize("case", ["alibi", "paged"])
def test_inputs_are_never_modified(rng, op, case):
    options = CASES[case][0]
    step = _step(rng, case)
    fixed = {name: x for name, x in options.items() if isinstance(x, np.ndarray)}
    before = {name: x.copy() for name, x in fixed.items()}
    plan = op.plan(*step, return_lse=True, **options)
    q, k, v = _step(rng, case)
    given = [x.copy() for x in (q, k, v)]
    out, lse = plan.run(q, k, v)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    results = [x.copy() for x in (dout, out, lse)]
    plan.backward(dout, q, k, v, out, lse)
    for x, copy in zip([q, k, v, dout, out, lse], given + results):
        np.testing.assert_array_equal(x, copy)
    for name, x in fixed.items():
        np.testing.assert_array_equal(x, before[name], err_msg=name)


@pytest.mark.parametrize("case", ["causal", "alibi", "paged"])
def test_a_run_does_not_check_the_call_again(rng, op, monkeypatch, case):
    counts = {"validate_forward": 0, "gather_paged_keys": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in counts:
        monkeypatch.setattr(plan_module, name, counted(name, getattr(plan_module, name)))
    monkeypatch.setattr(validation, "validate_forward", counted("validate_forward", validation.validate_forward))
    plan = op.plan(*_step(rng, case), **CASES[case][0])
    assert counts == {"validate_forward": 1, "gather_paged_keys": 1}
    for _ in range(STEPS):
        plan.run(*_step(rng, case))
    assert counts == {"validate_forward": 1, "gather_paged_keys": 1}


def test_repr_says_the_backend_the_shapes_and_the_dtype(rng, op):
    text = repr(op.plan(*_step(rng, "paged"), **CASES["paged"][0]))
    assert "backend='cpu'" in text and "float32" in text and "thd" in text
    assert f"q ({CU_Q[-1]}, {HQ}, {D})" in text and f"k ({NUM_BLOCKS}, {PAGE_SIZE}, {HKV}, {D})" in text


class _Declining(Backend):
    """Declines its first run and from then on says so up front, as the CUDA backend's failed self-check does."""

    SUPPORTED_KINDS = ("numpy",)
    SUPPORTED_DTYPES = ("float32",)
    OPS = ("flash_plan_test",)
    PRIORITY = 60
    runs = 0

    def not_supported_reasons(self, call, forced=False):
        return super().not_supported_reasons(call, forced) + (["self-check failed"] if self.runs else [])

    def forward(self, call):
        self.runs += 1
        raise BackendDeclined(["self-check failed"])


class _Plain(Backend):
    SUPPORTED_KINDS = ("numpy",)
    SUPPORTED_DTYPES = ("float32",)
    OPS = ("flash_plan_test",)
    PRIORITY = 10

    def forward(self, call):
        return "plain", None


def test_a_backend_that_declines_while_running_hands_the_plan_to_the_next(rng):
    declining = _Declining()
    backend_registry.register("flash_plan_test", "declining", declining, replace=True)
    backend_registry.register("flash_plan_test", "plain", _Plain(), replace=True)
    try:
        plan = backend_registry.get("flash_plan_test").plan(*_step(rng, "causal"), causal=True)
        assert plan.backend == "declining"
        assert [plan.run(*_step(rng, "causal")) for _ in range(2)] == ["plain", "plain"]
        assert declining.runs == 1 and plan.backend == "plain"
    finally:
        for name in ("declining", "plain"):
            backend_registry.unregister("flash_plan_test", name)
