"""The thin launch path's pieces that need neither a GPU nor the simulator: the argument buffer, the PTX reader,
a plan's checks, the backend's plan key and opt-in, and the host-overhead records (which run the simulator in a
child process)."""

import types

import pytest

from numba_flash import AttentionInputError


def test_arg_buffer_aligns_each_parameter_and_points_at_it():
    import ctypes

    from numba_flash.cuda.host.abi import ArgBuffer, Slot

    buf = ArgBuffer([Slot("B", "flag"), Slot("q", "n"), Slot("f", "x"), Slot("Q", "ptr")])
    assert buf.offsets == (0, 8, 16, 24)
    buf.pack([1, -2, 0.5, 2**63 + 5])
    pointers = (ctypes.c_void_p * 4).from_address(buf.params_address)
    assert [p - pointers[0] for p in pointers] == [0, 8, 16, 24]
    assert ctypes.c_int64.from_address(pointers[1]).value == -2
    assert ctypes.c_float.from_address(pointers[2]).value == 0.5
    buf.words[24 >> 3] = 12345
    assert ctypes.c_uint64.from_address(pointers[3]).value == 12345


def test_ptx_reader_and_mismatches():
    from numba_flash.cuda.host.abi import Slot, ptx_entry_params, ptx_mismatches

    ptx = """.visible .entry k(
        .param .u64 k_param_0,
        .param .f32 k_param_1,
        .param .u8 k_param_2,
        .param .align 8 .b8 k_param_3[16]
    )
    {"""
    params = ptx_entry_params(ptx)
    assert params == [("u64", 8), ("f32", 4), ("u8", 1), ("b8[16]", 16)]
    slots = [Slot("Q", "a"), Slot("f", "b"), Slot("B", "c"), Slot("d", "e")]
    problems = ptx_mismatches(slots, params)
    assert len(problems) == 1 and "param 3" in problems[0]
    assert "2 packed parameters, 4 in the PTX entry" in ptx_mismatches(slots[:2], params)[0]
    assert ptx_mismatches([Slot("i", "n")], [("f32", 4)])   # an int where the kernel takes a float


def test_slots_of_flattens_arrays_and_scalars_as_numba_does():
    from numba.core import types

    from numba_flash.cuda.host.abi import slots_of

    codes = [s.code for s in slots_of((types.Array(types.float32, 2, "A"), types.int64, types.float32,
                                       types.uint64, types.boolean, types.UniTuple(types.int32, 2)))]
    assert codes == ["Q", "Q", "q", "q", "Q", "q", "q", "q", "q", "q", "f", "Q", "B", "i", "i"]
    with pytest.raises(NotImplementedError):
        slots_of((types.none,))


def test_a_tensor_on_another_device_than_planned_is_refused_naming_it():
    torch = pytest.importorskip("torch")
    from numba_flash.cuda.host.driver_launch import RecordingDriver
    from numba_flash.cuda.host.launch_plan import ArraySig, CallPlan

    q = torch.zeros(2, 3)
    sig = ArraySig((2, 3), (3, 1), torch.float32, torch.device("cuda", 1), 4, True)
    plan = CallPlan(("q",), (sig,), (), RecordingDriver(), torch=True)
    with pytest.raises(AttentionInputError, match=r"^q: expected .* on cuda:1.* as planned, got .* on cpu"):
        plan.run(q)
    with pytest.raises(AttentionInputError, match=r"^q: expected"):
        plan.run(q.numpy())                 # not a tensor at all
    with pytest.raises(AttentionInputError, match=r"^arrays: expected 1"):
        plan.run(q, q)


def _call(**kw):
    base = dict(layout="bshd", causal=True, softmax_scale=0.125, window_left=-1, window_right=0, softcap=0.0,
                precision="ieee")
    return types.SimpleNamespace(**{**base, **kw})


def test_plan_key_changes_with_shape_strides_dtype_alignment_and_switches(monkeypatch):
    torch = pytest.importorskip("torch")
    from backends import cuda_thin

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q = torch.zeros(1, 64, 8, 64, dtype=torch.float16)
    key = cuda_thin.plan_key("forward", _call(), (q, q, q), None, 0)
    assert key == cuda_thin.plan_key("forward", _call(), (q.clone(), q, q), None, 0)
    others = [
        (torch.zeros(1, 65, 8, 64, dtype=torch.float16), q, q),                        # shape
        (torch.zeros(1, 8, 64, 64, dtype=torch.float16).transpose(1, 2), q, q),        # strides
        (q.float(), q, q),                                                             # dtype
        (torch.zeros(64 * 8 * 64 + 1, dtype=torch.float16)[1:].view(1, 64, 8, 64), q, q),   # alignment
    ]
    for tensors in others:
        assert cuda_thin.plan_key("forward", _call(), tensors, None, 0) != key
    for change in (dict(causal=False), dict(softmax_scale=0.1), dict(window_left=3), dict(softcap=5.0),
                   dict(precision="tf32"), dict(layout="bhsd")):
        assert cuda_thin.plan_key("forward", _call(**change), (q, q, q), None, 0) != key
    assert cuda_thin.plan_key("forward", _call(), (q, q, q), None, 7) != key          # another stream


def test_thin_launch_is_opt_in(monkeypatch):
    from backends import cuda_thin

    monkeypatch.delenv(cuda_thin.ENV_VAR, raising=False)
    assert not cuda_thin.enabled()
    assert cuda_thin.note(_call()) is None
    monkeypatch.setenv(cuda_thin.ENV_VAR, "1")
    assert cuda_thin.enabled()


def test_calls_with_per_call_host_arguments_are_not_planned(monkeypatch):
    from backends import cuda_thin

    plain = dict(kind="torch", device="cuda", q=None, k=None, v=None, alibi=None, bias=None, return_dbias=False,
                 dropout_p=0.0, mods=None, is_varlen=False, kvcache=None)
    assert cuda_thin.unplannable_reason(_call(**dict(plain, kind="numpy", device="cpu"))).startswith("numpy cpu")
    reason = cuda_thin.unplannable_reason(_call(**dict(plain, dropout_p=0.1, alibi=[1.0])))
    assert reason.startswith("alibi, dropout: ")
    monkeypatch.setenv(cuda_thin.ENV_VAR, "1")
    assert cuda_thin.note(_call(**dict(plain, is_varlen=True))) == (
        "thin launch not used: varlen: their kernel arguments are made on the host per call")


@pytest.mark.slow
def test_host_overhead_records():
    pytest.importorskip("torch")
    from numba_flash.bench.host_overhead_cuda import host_overhead_records

    records = host_overhead_records(calls=300)
    assert [r["call"] for r in records] == ["forward", "backward", "decode"]
    assert [r["launches"] for r in records] == [1, 3, 2]
    for r in records:
        assert r["backend"] == "cuda" and 0 < r["p50_us"] <= r["p95_us"]


def test_numba_argument_records_time_numbas_own_argument_preparation():
    pytest.importorskip("numba.cuda")
    from numba_flash.bench.host_overhead_cuda import numba_argument_records

    records = numba_argument_records(calls=3)
    assert [(r["call"], r["launches"]) for r in records] == [("forward", 1), ("backward", 3), ("decode", 2)]
    assert all(0 < r["p50_us"] <= r["p95_us"] for r in records)


def test_a_launch_whose_kernel_was_not_found_is_not_plannable():
    from numba_flash.cuda.host.launch_plan import NotPlannable, plan_launch
    from numba_flash.cuda.host.launch_record import RecordedLaunch

    record = RecordedLaunch(types.SimpleNamespace(py_func=types.SimpleNamespace(__name__="k")), (1, 1, 1),
                            (32, 1, 1), 0, 0, (), problem="the compiled kernel numba launched was not found")
    with pytest.raises(NotPlannable, match="^k: the compiled kernel numba launched was not found"):
        plan_launch(record, (), ())


def test_a_call_that_moved_device_memory_is_not_planned_and_is_retried_a_few_times(monkeypatch):
    # the first call of a specialisation runs its self-check, which copies its own inputs: a later call may plan
    torch = pytest.importorskip("torch")
    pytest.importorskip("numba.cuda")
    from backends import cuda_thin
    from numba_flash.cuda.host import launch_plan
    from numba_flash.cuda.host.launch_record import Recording

    records = Recording()
    records.transfers = ["host_to_device"]
    with pytest.raises(launch_plan.NotPlannable, match="moved device memory .*host_to_device") as info:
        launch_plan.build_plan(records, {}, None)
    assert info.value.retry

    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)   # a CPU tensor's get_device()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(cuda_thin, "_PLANS", {})
    monkeypatch.setattr(cuda_thin, "_ATTEMPTS", {})

    def refuse(*args, **kwargs):
        raise launch_plan.NotPlannable("moved device memory", retry=True)

    monkeypatch.setattr(launch_plan, "build_plan", refuse)
    q = torch.zeros(1, 4, 2, 8)
    call = _call(q=q, k=q, v=q)
    served = []
    for attempt in range(cuda_thin.RETRIES + 2):
        assert cuda_thin.serve("forward", call, None, lambda c: served.append(c) or (q, q),
                               ("q", "k", "v", "out", "lse")) == (q, q)
        stored = cuda_thin.stats()["not_planned"]
        assert stored == ([] if attempt < cuda_thin.RETRIES - 1 else ["moved device memory"])
    assert len(served) == cuda_thin.RETRIES + 2   # the dispatcher served every call


def test_recording_notes_numbas_memory_transfers_and_restores_everything(monkeypatch):
    pytest.importorskip("numba.cuda")
    from numba.cuda.cudadrv import driver as numba_driver
    from numba.cuda.dispatcher import CUDADispatcher

    from numba_flash.cuda.host.launch_record import recording

    done = []
    monkeypatch.setattr(numba_driver, "device_memset", lambda *a, **k: done.append(a))
    fake, call = numba_driver.device_memset, CUDADispatcher.call
    with recording() as records:
        numba_driver.device_memset(1, 0, 8)
    assert records.transfers == ["device_memset"] and done == [(1, 0, 8)] and list(records) == []
    assert numba_driver.device_memset is fake and CUDADispatcher.call is call
