"""The simulator checker (numba_flash.cuda.simcheck): small user kernels with one planted bug each must raise
SimulatorCheckError naming the bug, and correct kernels must pass with the right answer.

Every launch runs on a helper thread with a deadline, so that a barrier bug that hangs the simulator fails the
test instead of blocking CI. Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

import numpy as np
import pytest
from numba import cuda, float32, int32

from numba_flash.cuda import SimulatorCheckError
from numba_flash.cuda import simcheck
from hopper_sim_cases import run_in_time

pytestmark = pytest.mark.cudasim

N = 32
DEADLINE = 60.0


@pytest.fixture(autouse=True)
def checker():
    with simcheck.checking():
        yield


def _launch(kernel, blocks, threads, *args):
    """Run ``kernel[blocks, threads](*args)`` (``kernel(*args)`` when blocks is None: a configured launch); re-raise
    what it raised; fail if it does not return in time."""
    run_in_time(lambda: (kernel if blocks is None else kernel[blocks, threads])(*args), DEADLINE,
                f"launch of {kernel} (the simulator hangs)")


# ---- kernels: each bug next to its fix ----

@cuda.jit
def neighbour_no_barrier(x, out):
    tile = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    tile[t] = x[t]
    out[t] = tile[(t + 1) % N]        # thread t + 1 may not have written it yet


@cuda.jit
def neighbour(x, out):
    tile = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    tile[t] = x[t]
    cuda.syncthreads()
    out[t] = tile[(t + 1) % N]


@cuda.jit
def same_slot_writes(out):
    slot = cuda.shared.array(1, float32)
    t = cuda.threadIdx.x
    slot[0] = t                         # every thread writes one element: the last writer wins, unpredictably
    cuda.syncthreads()
    out[t] = slot[0]


@cuda.jit
def rows_no_barrier(x, out):
    tile = cuda.shared.array((N, 2), float32)
    t = cuda.threadIdx.x
    row = tile[t]                       # a view: its elements are still the tile's
    row[0] = x[t]
    row[1] = x[t]
    out[t] = tile[(t + 1) % N, 1]


@cuda.jit
def sum_and_broadcast(x, out, total):
    """Tree reduction (reads and writes of one element by different threads in different epochs), then every
    thread reads the one total (a broadcast read), and each thread rewrites its own element twice."""
    part = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    part[t] = float32(0.0)
    part[t] = x[cuda.blockIdx.x * N + t]
    cuda.syncthreads()
    stride = N // 2
    while stride > 0:
        if t < stride:
            part[t] += part[t + stride]
        cuda.syncthreads()
        stride //= 2
    out[cuda.blockIdx.x * N + t] = x[cuda.blockIdx.x * N + t] / part[0]
    if t == 0:
        total[cuda.blockIdx.x] = part[0]


@cuda.jit
def dynamic_no_barrier(x, out):
    tile = cuda.shared.array(0, float32)   # dynamic shared memory, sized at launch
    t = cuda.threadIdx.x
    tile[t] = x[t]
    out[t] = tile[(t + 1) % N]


@cuda.jit
def count_with_atomics_and_votes(x, out):
    """Every thread adds to one shared counter atomically (no race), then votes; both must still work."""
    counter = cuda.shared.array(1, int32)
    t = cuda.threadIdx.x
    if t == 0:
        counter[0] = 0
    cuda.syncthreads()
    cuda.atomic.add(counter, 0, 1 if x[t] > 0 else 0)
    positive = cuda.syncthreads_count(x[t] > 0)
    out[t] = counter[0] * 1000 + positive


@cuda.jit
def shared_minus_one(x, out):
    tile = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    tile[t] = x[t]
    cuda.syncthreads()
    out[t] = tile[t - 1]                # thread 0 reads tile[-1]: numpy would quietly give tile[N - 1]


@cuda.jit
def global_minus_one(x, out):
    t = cuda.threadIdx.x
    out[t] = x[t - 1]


@cuda.jit
def global_past_end(x, out):
    t = cuda.threadIdx.x
    out[t] = x[t + 1]


@cuda.jit
def local_past_end(x, out):
    acc = cuda.local.array(4, float32)
    t = cuda.threadIdx.x
    for i in range(5):
        acc[i] = x[t]
    out[t] = acc[0]


@cuda.jit
def barrier_in_branch(x, out):
    t = cuda.threadIdx.x
    if t < 4:
        cuda.syncthreads()
    out[t] = x[t]


@cuda.jit
def barrier_in_both_branches(x, out):
    t = cuda.threadIdx.x
    if t < 4:
        cuda.syncthreads()
    else:
        cuda.syncthreads()
    out[t] = x[t]


@cuda.jit
def early_exit_then_barrier(x, out):
    t = cuda.threadIdx.x
    if t >= 8:
        return
    cuda.syncthreads()
    out[t] = x[t]


@cuda.jit
def divide(x, out):
    t = cuda.threadIdx.x
    out[t] = 1 // int(x[t])


def _x(rng, n=N):
    return rng.standard_normal(n).astype(np.float32)


# ---- races ----

def test_missing_barrier_between_write_and_neighbour_read_is_a_race(rng):
    x, out = _x(rng), np.zeros(N, np.float32)
    with pytest.raises(SimulatorCheckError, match="race") as err:
        _launch(neighbour_no_barrier, 1, N, x, out)
    msg = str(err.value)
    assert "'neighbour_no_barrier'" in msg and "'tile'[" in msg and "epoch 0" in msg
    assert "wrote it" in msg or "read it" in msg
    assert msg.count("thread (") == 2


def test_with_the_barrier_the_same_kernel_passes(rng):
    x, out = _x(rng), np.zeros(N, np.float32)
    _launch(neighbour, 1, N, x, out)
    assert np.array_equal(out, np.roll(x, -1))


def test_two_threads_writing_one_element_is_a_race():
    with pytest.raises(SimulatorCheckError, match=r"race on 'slot'\[0\].*wrote it.*writes it"):
        _launch(same_slot_writes, 1, N, np.zeros(N, np.float32))


def test_race_through_a_row_view_is_seen(rng):
    with pytest.raises(SimulatorCheckError, match=r"race on 'tile'\[\d+, 1\]"):
        _launch(rows_no_barrier, 1, N, _x(rng), np.zeros(N, np.float32))


def test_correct_kernel_with_barriers_and_broadcast_reads_passes(rng):
    blocks = 3
    x = np.abs(_x(rng, blocks * N)) + np.float32(0.5)
    out, total = np.zeros_like(x), np.zeros(blocks, np.float32)
    _launch(sum_and_broadcast, blocks, N, x, out, total)
    sums = x.reshape(blocks, N).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(total, sums, rtol=1e-5)
    np.testing.assert_allclose(out, (x.reshape(blocks, N) / sums[:, None]).ravel(), rtol=1e-5)


def test_race_in_dynamic_shared_memory_is_seen(rng):
    with pytest.raises(SimulatorCheckError, match=r"race on 'tile'\["):
        _launch(dynamic_no_barrier[1, N, 0, N * 4], None, None, _x(rng), np.zeros(N, np.float32))


def test_atomics_on_one_shared_element_and_votes_pass(rng):
    x = _x(rng)
    out = np.zeros(N, np.int32)
    _launch(count_with_atomics_and_votes, 1, N, x, out)
    positive = int(np.sum(x > 0))
    assert np.all(out == positive * 1000 + positive)


# ---- indices ----

def test_negative_shared_index_is_an_error(rng):
    with pytest.raises(SimulatorCheckError, match=r"shared array 'tile'.*negative.*index \(-1,\)") as err:
        _launch(shared_minus_one, 1, N, _x(rng), np.zeros(N, np.float32))
    assert "thread (0, 0, 0)" in str(err.value) and "'shared_minus_one'" in str(err.value)


def test_negative_global_index_is_an_error(rng):
    with pytest.raises(SimulatorCheckError, match=r"global array 'x'.*index \(-1,\) for shape \(32,\)"):
        _launch(global_minus_one, 1, N, _x(rng), np.zeros(N, np.float32))


def test_global_index_past_the_end_is_an_error(rng):
    with pytest.raises(SimulatorCheckError, match=r"global array 'x'.*index \(32,\).*thread \(31, 0, 0\)"):
        _launch(global_past_end, 1, N, _x(rng), np.zeros(N, np.float32))


def test_local_index_past_the_end_is_an_error(rng):
    with pytest.raises(SimulatorCheckError, match=r"local array 'acc'.*index \(4,\) for shape \(4,\)"):
        _launch(local_past_end, 1, N, _x(rng), np.zeros(N, np.float32))


def test_device_array_arguments_are_checked_too(rng):
    x = cuda.to_device(_x(rng))
    with pytest.raises(SimulatorCheckError, match="global array 'x'"):
        _launch(global_past_end, 1, N, x, cuda.device_array(N, np.float32))


# ---- global memory across blocks ----

@cuda.jit
def every_block_adds_into_one_row(x, out):
    t = cuda.threadIdx.x
    out[0, t] += x[cuda.blockIdx.x, t]          # a sum over blocks with plain stores: blocks race


@cuda.jit
def each_block_its_own_row(x, out):
    t = cuda.threadIdx.x
    out[cuda.blockIdx.x, t] += x[cuda.blockIdx.x, t]


@cuda.jit
def every_block_adds_atomically(x, out):
    t = cuda.threadIdx.x
    cuda.atomic.add(out, (0, t), x[cuda.blockIdx.x, t])


def test_two_blocks_storing_to_one_global_element_is_a_race(rng):
    x = rng.standard_normal((3, N)).astype(np.float32)
    with pytest.raises(SimulatorCheckError, match=r"global-memory race on 'out'\[\(0, 0\)\] in kernel "
                                                  r"'every_block_adds_into_one_row': blocks \(0, 0, 0\) and "
                                                  r"\(1, 0, 0\) both store"):
        _launch(every_block_adds_into_one_row, 3, N, x, np.zeros((3, N), np.float32))


def test_a_store_through_a_sliced_device_array_is_seen(rng):
    # Elements are told apart by address (views of one buffer name one element alike), here through a slice.
    x = rng.standard_normal((2, N)).astype(np.float32)
    out = cuda.to_device(np.zeros((2, N), np.float32))
    with pytest.raises(SimulatorCheckError, match="global-memory race on 'out'"):
        _launch(every_block_adds_into_one_row, 2, N, x, out[1:])


def test_blocks_owning_their_elements_and_atomics_pass(rng):
    x = rng.standard_normal((3, N)).astype(np.float32)
    out = np.zeros((3, N), np.float32)
    _launch(each_block_its_own_row, 3, N, x, out)
    assert np.array_equal(out, x)
    summed = np.zeros((1, N), np.float32)
    _launch(every_block_adds_atomically, 3, N, x, summed)
    np.testing.assert_allclose(summed[0], x.sum(axis=0), rtol=1e-6)
    # Launches are apart: the second launch may store where the first did.
    _launch(each_block_its_own_row, 3, N, x, out)
    assert np.array_equal(out, 2 * x)


# ---- barriers ----

def test_barrier_inside_a_divergent_branch_is_an_error_not_a_hang(rng):
    with pytest.raises(SimulatorCheckError, match="barrier not reached by every thread") as err:
        _launch(barrier_in_branch, 1, N, _x(rng), np.zeros(N, np.float32))
    assert "test_simcheck.py" in str(err.value) and "'barrier_in_branch'" in str(err.value)


def test_threads_waiting_at_different_barriers_is_an_error(rng):
    with pytest.raises(SimulatorCheckError, match="barrier not reached by every thread.*waits at"):
        _launch(barrier_in_both_branches, 1, N, _x(rng), np.zeros(N, np.float32))


def test_barrier_after_some_threads_returned_is_an_error(rng):
    with pytest.raises(SimulatorCheckError, match="barrier not reached by every thread"):
        _launch(early_exit_then_barrier, 1, N, _x(rng), np.zeros(N, np.float32))


# ---- the checker itself ----

def test_other_kernel_exceptions_still_propagate():
    with pytest.raises(ZeroDivisionError, match=r"tid=\[\d+, 0, 0\] ctaid=\[0, 0, 0\]"):
        _launch(divide, 1, N, np.zeros(N, np.float32), np.zeros(N, np.float32))


def test_uninstalled_checker_does_not_see_the_race(rng):
    # The simulator alone runs the racy kernel without complaint: what catches it is the checker, and it comes
    # off and back on cleanly.
    simcheck.uninstall()
    try:
        assert not simcheck.is_installed()
        _launch(barrier_in_branch, 1, N, _x(rng), np.zeros(N, np.float32))
        _launch(global_minus_one, 1, N, _x(rng), np.zeros(N, np.float32))
    finally:
        simcheck.install()
    with pytest.raises(SimulatorCheckError):
        _launch(global_minus_one, 1, N, _x(rng), np.zeros(N, np.float32))


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)])
def test_environment_variable(monkeypatch, value, on):
    monkeypatch.setenv("NUMBA_FLASH_SIMCHECK", value)
    assert simcheck.env_requested() is on


def test_first_launch_installs_the_checker_when_the_environment_asks(rng, monkeypatch):
    from backends import backend_registry
    from numba_flash.cuda import tile_config_override

    simcheck.uninstall()
    monkeypatch.setenv("NUMBA_FLASH_SIMCHECK", "1")
    monkeypatch.setattr(simcheck, "_env_checked", False)
    q = rng.standard_normal((1, 5, 1, 4)).astype(np.float32)
    with tile_config_override(block_m=8, block_n=8, threads=16):
        backend_registry.get("flash", backend="cuda").forward(q, q, q)
    assert simcheck.is_installed()


# ---- the shared-memory records on their own ----

@pytest.mark.parametrize("seed", range(4))
def test_records_flag_the_first_access_that_makes_a_race(seed, monkeypatch):
    """Sequences of reads and writes by three threads on a few elements of one epoch, against a brute-force rule:
    the first access after which some element was written by one thread and touched by another is the one that
    raises, naming the other thread (the records keep only the first reader and the first other reader)."""
    from numba_flash.cuda.simcheck import arrays as simcheck_arrays

    class Raced(Exception):
        pass

    def race(self, key, first, did, second, does):
        raise Raced(key, first, second)

    monkeypatch.setattr(simcheck_arrays.SharedArray, "_race", race)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        tile = simcheck_arrays.SharedArray(np.zeros(3, np.float32), "tile")
        accesses = [(int(rng.integers(3)), int(rng.integers(3)), bool(rng.random() < 0.3))
                    for _ in range(int(rng.integers(1, 9)))]
        expected, seen = None, {}
        for n, (key, tid, write) in enumerate(accesses):
            writers, touched = seen.setdefault(key, (set(), set()))
            (writers if write else touched).add(tid)
            touched.add(tid)
            if any(touched - {w} for w in writers):
                expected = n
                break
        got = None
        for n, (key, tid, write) in enumerate(accesses):
            th = type("T", (), {"tid": tid})
            try:
                (tile._record_write if write else tile._record_read)(key, th)
            except Raced as exc:
                _, first, second = exc.args
                assert second == tid and first != tid
                got = n
                break
        assert got == expected, accesses


# ---- the short paths: same answers as the general ones ----

@pytest.mark.parametrize("shape", [(5,), (3, 4)])
def test_local_arrays_check_every_index_on_their_short_path_too(shape, rng):
    """Plain ints inside the bounds go straight to numpy; any other index (negative, past the end, a numpy integer,
    a slice, the wrong number of axes) must still be checked: an element is read or written exactly where numpy
    would without wrapping, and everything else raises."""
    from numba_flash.cuda.simcheck.arrays import LocalArray

    data = rng.standard_normal(shape).astype(np.float32)
    arr = LocalArray(data.copy(), "acc")
    axes = [list(range(-2, n + 2)) for n in shape]
    indices = [i for i in axes[0]] if len(shape) == 1 else [(i, j) for i in axes[0] for j in axes[1]]
    indices += [np.int64(1), np.uint32(shape[0])] if len(shape) == 1 else [(np.int32(1), 2), (1, np.uint64(9))]
    for idx in indices:
        items = idx if isinstance(idx, tuple) else (idx,)
        inside = all(0 <= int(i) < n for i, n in zip(items, shape))
        if inside:
            assert arr[idx] == data[idx]
            arr[idx] = 7.0
            assert arr[idx] == 7.0
            arr[idx] = data[idx]
        else:
            with pytest.raises(SimulatorCheckError, match=r"out-of-bounds index .*into local array 'acc'"):
                arr[idx]
            with pytest.raises(SimulatorCheckError, match=r"out-of-bounds index .*into local array 'acc'"):
                arr[idx] = 1.0
    np.testing.assert_array_equal(arr._a, data)   # no failed write landed anywhere
    if len(shape) == 2:   # a row: a checked view of its own
        row = arr[1]
        assert isinstance(row, LocalArray) and row[shape[1] - 1] == data[1, -1]
        with pytest.raises(SimulatorCheckError, match=r"local array 'acc\[1\]'"):
            row[shape[1]]


def test_numba_scalar_casts_under_the_checker_equal_numba_s_own():
    """The checker takes numba's integer and float casts (``uint32(x)`` in a kernel) on a short path: the same
    numpy type and value as numba's ``cast_python_value``, the same error for a value numpy refuses, signatures
    still built from types, and numba's own ``__call__`` back once the checker is off."""
    import numba
    from numba.core import types

    values = [0, 5, -3, 2**31 - 1, 1.5, -0.0, np.float32(2.5), np.int64(-7), np.uint32(9), np.float16(3.0)]
    for t in (numba.uint32, numba.uint64, numba.int32, numba.int64, numba.int8, types.float16, numba.float32,
              numba.float64):
        for x in values:
            try:
                with np.errstate(over="ignore"):
                    want = t.cast_python_value(x)
            except (OverflowError, ValueError) as exc:
                with pytest.raises(type(exc)):
                    t(x)
                continue
            with np.errstate(over="ignore"):   # float16(2**31 - 1): inf, as numba's
                got = t(x)
            assert type(got) is type(want) and (got == want or (got != got and want != want)), (t, x)
    assert numba.float32(numba.int32) == types.float32(types.int32) and str(numba.float32(numba.int32)) == \
        "(int32,) -> float32"
    assert numba.boolean(2) is True
    simcheck.uninstall()
    try:
        assert types.Type.__call__.__module__.startswith("numba.")
    finally:
        simcheck.install()
    assert not types.Type.__call__.__module__.startswith("numba.")
