"""Launch plans (numba_flash/cuda/host/launch_plan.py) built from the real host path: each call's dispatcher path
recorded under the simulator without running its kernels, on torch CPU tensors the simulator's arrays wrap in
place, replayed into the recording stub (driver_launch.RecordingDriver).

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_thin_plan_sim.py"""

import ctypes

import pytest

pytestmark = pytest.mark.cudasim

torch = pytest.importorskip("torch")

KINDS = ("forward", "backward", "decode")


def _plans(dtype="float16", **kw):
    from numba_flash.bench.host_overhead_cuda import sim_plans
    from numba_flash.cuda.host.driver_launch import RecordingDriver

    driver = RecordingDriver(snapshot=_snapshot)
    plans = sim_plans(driver, dtype=dtype, **kw)
    for plan, _ in plans.values():
        for launch in plan.launches:
            _BUFFERS[launch.buffer.params_address] = launch.buffer
    return driver, plans


def _snapshot(params_address):
    """The bytes a launch's parameters hold now; the stub calls it as the driver would copy them."""
    return _BUFFERS[params_address].tobytes()


_BUFFERS: dict = {}


def _fresh(arrays):
    """New tensors like ``arrays`` (same shapes, strides, dtypes), other addresses and contents."""
    return {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t + 1 if t.is_floating_point() else t)
            for n, t in arrays.items()}


def _expected_kernels(kind, dtype, d):
    from numba_flash.cuda.host.plan import backward_kernels, forward_kernel

    if kind == "forward":
        return [forward_kernel(dtype, d, None, head_dim_v=d)]
    if kind == "backward":
        return ["backward_delta", *backward_kernels(dtype, d, None, head_dim_v=d)]
    return ["decode", "decode_merge"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_recorded_launches_pack_the_signature_the_ptx_was_checked_against(dtype):
    # test_thin_abi_ptx holds kernel_signature's parameters to the PTX; this holds what the host path really
    # passes (as the thin path types it) to kernel_signature, kernel by kernel.
    from numba_flash.cuda.compile_check import kernel_signature
    from numba_flash.cuda.host.abi import slots_of

    _, plans = _plans(dtype)
    for kind, (plan, _) in plans.items():
        names = _expected_kernels(kind, dtype, 64)
        assert len(plan.launches) == len(names), kind
        for launch, name in zip(plan.launches, names):
            want = [s.code for s in slots_of(kernel_signature(name, dtype).args)]
            assert [s.code for s in launch.buffer.slots] == want, (kind, name)


def _masked(launch, data):
    """``data`` (a launch's packed bytes) with the data pointers of arrays bound to no call array (placeholders
    and the plan's own workspace, which two plans do not share) zeroed."""
    bound = {offset for _, offset, _ in launch.bindings}
    out = bytearray(data)
    for slot, offset in zip(launch.buffer.slots, launch.buffer.offsets):
        if slot.what.endswith(".data") and offset not in bound:
            out[offset:offset + 8] = bytes(8)
    return bytes(out)


@pytest.mark.parametrize("kind", KINDS)
def test_a_reused_plan_packs_what_a_fresh_plan_packs(kind):
    driver, plans = _plans()
    reused, _ = plans[kind]
    _, fresh_plans = _plans()               # the same calls planned afresh, on new tensors
    fresh, arrays = fresh_plans[kind]
    planned_bytes = [l.buffer.tobytes() for l in reused.launches]
    reused.run(*arrays.values())            # the reused plan, on the fresh plan's inputs
    replayed = [launch[-1] for launch in driver.launches]
    assert len(replayed) == len(fresh.launches)
    for launch, got, new, old in zip(fresh.launches, replayed, fresh.launches, planned_bytes):
        assert _masked(launch, got) == _masked(launch, new.buffer.tobytes())
        assert _masked(launch, old) != _masked(launch, got)    # other pointers: the comparison is not vacuous


def _changed(arrays, name, how):
    t = arrays[name]
    if how == "shape":
        return torch.empty(t.shape[0], t.shape[1] + 1, *t.shape[2:], dtype=t.dtype)
    if how == "strides":   # same shape, another memory order
        return torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).permute(*reversed(range(t.dim())))
    if how == "dtype":
        return torch.empty_like(t, dtype=torch.float64)
    return t[..., :0]


@pytest.mark.parametrize("kind,name", [("forward", "q"), ("forward", "v"), ("backward", "dout"),
                                       ("backward", "lse"), ("decode", "k_cache"), ("decode", "seqinfo")])
@pytest.mark.parametrize("how", ["shape", "strides", "dtype"])
def test_another_shape_stride_or_dtype_than_planned_is_refused_naming_the_argument(kind, name, how):
    from numba_flash import AttentionInputError

    driver, plans = _plans()
    plan, arrays = plans[kind]
    bad = dict(arrays, **{name: _changed(arrays, name, how)})
    with pytest.raises(AttentionInputError, match=rf"^{name}: expected .* as planned, got "):
        plan.run(*bad.values())
    assert driver.launches == []   # checked before anything launches


def test_a_planned_call_makes_no_driver_call_but_its_launches(monkeypatch):
    driver, plans = _plans()

    def forbidden(*args, **kwargs):
        raise AssertionError("synchronised on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    for _ in range(3):
        for plan, arrays in plans.values():
            plan.run(*arrays.values())
    assert driver.others == []
    assert len(driver.launches) == 3 * sum(len(p.launches) for p, _ in plans.values())


def test_an_unaligned_input_is_refused_by_a_plan_made_for_aligned_ones():
    from numba_flash import AttentionInputError

    _, plans = _plans()
    plan, arrays = plans["forward"]
    assert plan.sigs[0].aligned
    base = torch.empty(arrays["q"].numel() + 1, dtype=arrays["q"].dtype)
    q = base[1:].view(arrays["q"].shape)   # 2 bytes past an aligned address
    with pytest.raises(AttentionInputError, match="^q: expected .*16-byte aligned"):
        plan.run(q, *list(arrays.values())[1:])


def test_the_backend_falls_back_to_the_dispatcher_under_the_simulator_and_explain_says_why(monkeypatch):
    import numpy as np

    import numba_flash
    from backends import cuda_thin

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 5, 2, 16)).astype(np.float32) for _ in range(3))
    op = numba_flash.backend_registry.get("flash", backend="cuda")
    monkeypatch.delenv(cuda_thin.ENV_VAR, raising=False)
    want = op.forward(q, k, v, causal=True)
    assert "thin launch" not in str(op.explain(q, k, v, causal=True, backend="cuda"))
    monkeypatch.setenv(cuda_thin.ENV_VAR, "1")
    np.testing.assert_array_equal(op.forward(q, k, v, causal=True), want)
    text = str(op.explain(q, k, v, causal=True, backend="cuda"))
    assert "thin launch not used: the CUDA simulator runs kernels through numba's dispatcher" in text


def test_a_plan_keeps_its_placeholders_and_workspace_but_not_the_arrays_it_was_recorded_from():
    # kept: what the packed buffers point at besides the call's arrays; not kept: the first call's own tensors
    # (a plan cached for the process would otherwise pin them, and their GPU memory, for good)
    from numba_flash.cuda.host.launch_plan import device_pointer

    _, plans = _plans()
    for plan, arrays in plans.values():
        call = {device_pointer(t) for t in arrays.values()}
        for launch in plan.launches:
            kept = [device_pointer(x) for x in launch.keep if hasattr(x, "shape") and hasattr(x, "dtype")]
            assert not call & set(kept), launch.name
        assert any(len(launch.keep) > 1 for launch in plan.launches)   # the placeholders are there


def test_the_backend_plans_on_the_first_call_replays_on_the_next_and_replans_a_changed_signature(monkeypatch):
    # backends/cuda_thin.serve with the simulator standing in for the GPU: the dispatcher path runs (and is
    # recorded) on simulator arrays over torch CPU tensors; the driver is the recording stub.
    import math
    import types

    import numpy as np

    from backends import cuda_thin
    from numba_flash.bench.host_overhead_cuda import sim_array
    from numba_flash.cuda.host import driver_launch
    from numba_flash.cuda.host.flash import flash_forward

    stub = driver_launch.RecordingDriver()
    monkeypatch.setattr(driver_launch, "real_driver", lambda: stub)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)   # a CPU tensor's get_device()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(cuda_thin, "_PLANS", {})
    dispatched = []

    def dispatch(call):
        dispatched.append(call)
        out = torch.empty(call.q.shape)
        lse = torch.empty(call.q.shape[0], call.q.shape[2], call.q.shape[1])
        flash_forward(*map(sim_array, (call.q, call.k, call.v, out, lse)), softmax_scale=call.softmax_scale,
                      window_left=-1, window_right=0, softcap=0.0, dtype="float32")
        return out, lse

    def call_of(q, k, v):
        return types.SimpleNamespace(q=q, k=k, v=v, layout="bshd", causal=True, softmax_scale=1 / math.sqrt(16),
                                     window_left=-1, window_right=0, softcap=0.0, precision="ieee")

    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
    want = cuda_thin.serve("forward", call_of(q, k, v), None, dispatch, ("q", "k", "v", "out", "lse"))
    assert len(dispatched) == 1 and stub.launches == [] and cuda_thin.stats()["planned"] == 1
    out, lse = cuda_thin.serve("forward", call_of(q, k, v), None, dispatch, ("q", "k", "v", "out", "lse"))
    assert len(dispatched) == 1 and len(stub.launches) == 1        # replayed: one launch, no dispatch
    assert out.shape == want[0].shape and out.stride() == want[0].stride() and lse.shape == want[1].shape
    changed = [(q.transpose(1, 2).contiguous().transpose(1, 2), k, v),    # strides
               (q[:, :15], k, v),                                      # shape
               (q.double(), k, v)]                                     # dtype
    for i, tensors in enumerate(changed):
        if tensors[0].dtype == torch.float64:
            with pytest.raises(ValueError, match="expected float32"):   # the dispatcher refuses it, no plan does
                cuda_thin.serve("forward", call_of(*tensors), None, dispatch, ("q", "k", "v", "out", "lse"))
        else:
            cuda_thin.serve("forward", call_of(*tensors), None, dispatch, ("q", "k", "v", "out", "lse"))
        assert len(dispatched) == 2 + i and len(stub.launches) == 1   # a new signature: the dispatcher again
    np.testing.assert_array_equal(want[0].numpy(), dispatch(call_of(q, k, v))[0].numpy())   # deterministic ref


@pytest.mark.parametrize("kind", KINDS)
def test_run_new_outputs_allocates_them_as_planned_and_launches_like_run(kind):
    from numba_flash import AttentionInputError
    from numba_flash.bench.host_overhead_cuda import OUTPUTS

    driver, plans = _plans()
    plan, arrays = plans[kind]
    tensors = tuple(arrays.values())
    n_out = OUTPUTS[kind]
    made = plan.run_new_outputs(*tensors[:-n_out], outputs=n_out)
    assert [(t.shape, t.stride(), t.dtype) for t in made] == [(t.shape, t.stride(), t.dtype) for t in tensors[-n_out:]]
    assert len(driver.launches) == len(plan.launches)
    plan.run(*tensors[:-n_out], *made)           # the same launches, the same packed bytes
    half = len(plan.launches)
    assert [l[-1] for l in driver.launches[:half]] == [l[-1] for l in driver.launches[half:]]
    with pytest.raises(AttentionInputError, match="^arrays: expected"):
        plan.run_new_outputs(*tensors, outputs=n_out)
