"""Ring (context-parallel) attention, ``numba_flash.distributed``: 2 and 4 local processes on gloo, started with
``torch.multiprocessing`` (spawn), forward and backward against the float64 reference on the full sequence (and,
in float16, against the single-process result); the example of docs/guide/ring-attention.md as written; the
sharding helpers; bad input.

Each world size is launched once and runs every case inside (a launch costs seconds: imports, numba's cache). The
parent draws the full inputs (fresh N(0, 1), seed printed), the ranks shard them, run ``ring_attention`` with
autograd and write their parts; the parent puts the parts back together and compares.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from numba_flash import AttentionInputError, attention_ref, attention_ref_backward  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

# name -> (B, (S_q, S_k) of the full sequence, Hq, Hkv, D, options, dtype). Local lengths are odd where the layout
# allows it (causal needs two equal chunks per rank: the chunks are odd); "long" crosses the CPU tile (64 rows).
CASES = {
    2: {
        "plain_gqa": (2, (10, 10), 4, 2, 24, dict(), "float32"),
        "cross_lengths": (1, (6, 14), 4, 2, 24, dict(), "float32"),
        "causal_gqa": (2, (12, 12), 4, 2, 24, dict(causal=True), "float32"),
        "causal_softcap_mqa": (1, (20, 20), 3, 1, 40, dict(causal=True, softcap=1.5, softmax_scale=0.3), "float32"),
        "causal_long": (1, (148, 148), 2, 2, 16, dict(causal=True), "float32"),
        "causal_fp16": (2, (12, 12), 4, 2, 24, dict(causal=True), "float16"),
        "causal_nan_key": (1, (12, 12), 4, 2, 24, dict(causal=True), "float32"),
    },
    4: {
        "plain_gqa": (2, (20, 20), 4, 2, 24, dict(), "float32"),
        "causal_gqa": (2, (24, 24), 4, 2, 24, dict(causal=True), "float32"),
        "causal_long": (1, (168, 168), 2, 1, 16, dict(causal=True), "float32"),
        # ranks 1 and 3 of the 4 form a group of their own: peers are addressed by global rank
        "subgroup_causal": (1, (12, 12), 4, 2, 24, dict(causal=True), "float32"),
    },
}
SUBGROUP = (1, 3)
# A NaN in key 7 (chunk 2, rank 1's): the contract's rule, across the ring, makes NaN exactly what it makes NaN in
# one process (query rows 7 to 11 and the gradients they reach) and leaves rows 0 to 6 untouched.
NAN_AT = {"causal_nan_key": (0, 7, 1, 5)}
LAUNCH_TIMEOUT_S = 240


def _inputs(rng, b, lengths, hq, hkv, d, dtype):
    sq, sk = lengths
    q = rng.standard_normal((b, sq, hq, d))
    k, v = rng.standard_normal((2, b, sk, hkv, d))
    dout = rng.standard_normal((b, sq, hq, d))
    return {name: x.astype(dtype) for name, x in dict(q=q, k=k, v=v, dout=dout).items()}


# ---------------------------------------------------------------------------------------------------------------
# What each spawned rank runs (module level, so that spawn can pickle it by name)


def _rank_main(rank, world, store, outdir, cases, example_port=None):
    import numba

    os.environ.setdefault("NUMBA_FLASH_QUIET", "1")
    # Several ranks share the machine's cores: one thread each, as torchrun sets OMP_NUM_THREADS=1, rather than
    # every rank's kernels fighting for all of them.
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from numba_flash.distributed import gather_sequence, ring_attention, shard_sequence

        sub = dist.new_group(list(SUBGROUP)) if world == 4 else None
        results = {}
        for name, (arrays, opts) in cases.items():
            group, g_rank, g_world = None, rank, world
            if name.startswith("subgroup"):
                if rank not in SUBGROUP:
                    continue
                group, g_rank, g_world = sub, SUBGROUP.index(rank), len(SUBGROUP)
            causal = opts.get("causal", False)
            full = {n: torch.from_numpy(a) for n, a in arrays.items()}
            local = {n: shard_sequence(x, g_rank, g_world, causal) for n, x in full.items()}
            before = {n: x.clone() for n, x in local.items()}
            q, k, v = (local[n].requires_grad_(True) for n in ("q", "k", "v"))
            out, lse = ring_attention(q, k, v, group=group, return_lse=True, **opts)
            (out.float() * local["dout"].float()).sum().backward()
            results[name] = dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad,
                                 untouched=all(_same(local[n].detach(), before[n]) for n in before),
                                 gathered=gather_sequence(out.detach(), group=group, causal=causal))
        # Ranks disagreeing on shapes: every rank raises the same error instead of hanging in the ring.
        rng = torch.Generator().manual_seed(rank)
        length = 4 if rank == 0 else 6
        q = torch.randn(1, length, 2, 8, generator=rng)
        try:
            ring_attention(q, q, q, causal=True)
            results["mismatch"] = None
        except AttentionInputError as exc:
            results["mismatch"] = str(exc)
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    if example_port is not None:
        _run_docs_example(rank, world, example_port, Path(outdir) / f"example{rank}.txt")


def _same(a, b):
    """Equal, NaN included (torch.equal says a NaN differs from itself)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _docs_example() -> str:
    """The ring example of the user guide's ring-attention page, as a reader would save it."""
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "ring-attention.md").read_text()
    return re.search(r"ring_example\.py`:\n\n```python\n(.*?)```", page, flags=re.S).group(1)


def _run_docs_example(rank, world, port, out_file):
    """The docs' example as written, with the environment torchrun would give it (init_method env://), in
    this rank's process (cheaper than starting torchrun and its ranks)."""
    import contextlib
    import io

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_docs_example(), "docs/guide/ring-attention.md (ring example)", "exec"), {"__name__": "__main__"})
    out_file.write_text(printed.getvalue())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world, cases, tmp_path, example_port=None):
    """Run ``_rank_main`` on ``world`` spawned processes; return each rank's results. A rank that raises fails the
    test with its traceback; one that hangs (a ring that deadlocks) is killed after LAUNCH_TIMEOUT_S."""
    import torch.multiprocessing as mp

    outdir = tmp_path / f"world{world}"
    outdir.mkdir()
    args = (world, str(tmp_path / f"store{world}"), str(outdir), cases, example_port)
    ctx = mp.start_processes(_rank_main, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ring attention with {world} processes did not finish in {LAUNCH_TIMEOUT_S} s")
    return [torch.load(outdir / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def warm_kernels():
    """Compile (or load) the CPU kernels once here, so that the ranks find them in numba's disk cache instead of
    each compiling them at once on the same cores."""
    from numba_flash import backend_registry

    op = backend_registry.get("flash")
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, 3, 1, 8, dtype=dtype)
        for causal in (False, True):
            o, lse = op.forward(x, x, x, causal=causal, return_lse=True)
            op.backward(o, x, x, x, o, lse, causal=causal)


def _rel_l2(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _unshard(results, name, field, members, causal):
    from numba_flash.distributed import unshard_sequence

    parts = [results[r][name][field] for r in members]
    return unshard_sequence(parts, causal=causal, dim=2 if field == "lse" else 1).double().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_the_reference(rng, tmp_path, warm_kernels, world):
    cases, arrays = {}, {}
    for name, (b, lengths, hq, hkv, d, opts, dtype) in CASES[world].items():
        arrays[name] = _inputs(rng, b, lengths, hq, hkv, d, dtype)
        if name in NAN_AT:
            arrays[name]["k"][NAN_AT[name]] = np.nan
        cases[name] = (arrays[name], opts)
    # The docs' example runs after the cases in the 2-rank launch (see _check_docs_example).
    results = _launch(world, cases, tmp_path, example_port=_free_port() if world == 2 else None)

    for name, (b, lengths, hq, hkv, d, opts, dtype) in CASES[world].items():
        causal = opts.get("causal", False)
        members = SUBGROUP if name.startswith("subgroup") else range(world)
        a = arrays[name]
        ref_out, ref_lse = attention_ref(a["q"], a["k"], a["v"], **opts)
        ref_grads = attention_ref_backward(a["dout"], a["q"], a["k"], a["v"], **opts)
        got = {f: _unshard(results, name, f, members, causal) for f in ("out", "lse", "dq", "dk", "dv")}
        assert all(results[r][name]["untouched"] for r in members), f"{name}: an input was modified"
        for r in members:   # gather_sequence on every rank gives the whole output
            np.testing.assert_array_equal(results[r][name]["gathered"].double().numpy(), got["out"])
        assert results[members[0]][name]["lse"].dtype == torch.float32
        if dtype == "float32":
            wants = dict(zip(("out", "lse", "dq", "dk", "dv"), (ref_out, ref_lse, *ref_grads)))
            for field, want in wants.items():   # NaN exactly where the reference has it; the rest compared
                np.testing.assert_array_equal(np.isnan(got[field]), np.isnan(want), err_msg=f"{name} {field}")
                assert np.isnan(want).any() == (name in NAN_AT), (name, field)
                wants[field] = np.where(np.isnan(want), 0.0, want)
                got[field] = np.where(np.isnan(got[field]), 0.0, got[field])
            err = float(np.abs(got["out"] - wants["out"]).max())
            assert err <= 1e-5, (name, "out", err)
            err = float(np.abs(got["lse"] - wants["lse"]).max())
            assert err <= 1e-5 * (1 + np.abs(wants["lse"]).max()), (name, "lse", err)
            for field in ("dq", "dk", "dv"):
                err = _rel_l2(got[field], wants[field])
                assert err <= 1e-5, (name, field, err)
        else:
            # the contract's float16 rule: relative L2 <= 2e-3, and at most 2x the single-process error (+ slack)
            from numba_flash import flash_attn_func

            q, k, v = (torch.from_numpy(a[n]).requires_grad_(True) for n in ("q", "k", "v"))
            single = flash_attn_func(q, k, v, **opts)
            (single.float() * torch.from_numpy(a["dout"]).float()).sum().backward()
            singles = [x.detach().double().numpy() for x in (single, q.grad, k.grad, v.grad)]
            for field, want, one in zip(("out", "dq", "dk", "dv"), (ref_out, *ref_grads), singles):
                err = _rel_l2(got[field], want)
                assert err <= 2e-3 and err <= 2 * _rel_l2(one, want) + 1e-4, (name, field, err)
    for r in range(world):
        message = results[r]["mismatch"]
        assert message is not None and message.startswith("q, k, v: expected the same shapes"), message
        # rank 0 passed length 4, the others 6: each names the first rank that differs from it
        assert f"on rank {1 if r == 0 else 0}: q (1, {6 if r == 0 else 4}, 2, 8)" in message, message
    if world == 2:
        _check_docs_example(tmp_path / "world2")


def _check_docs_example(outdir):
    """The docs' example, run as written by both ranks of the 2-rank launch: rank 0 prints a gathered output
    equal to the single-process one."""
    import re

    printed = [(outdir / f"example{r}.txt").read_text() for r in range(2)]
    assert printed[1] == "", printed
    diff = float(re.fullmatch(r"max difference from one process: (\S+)\n", printed[0]).group(1))
    assert diff <= 1e-5, printed[0]


# ---------------------------------------------------------------------------------------------------------------
# Sharding helpers (one process)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_then_unshard_gives_the_sequence_back(rng, world, causal):
    from numba_flash.distributed import shard_sequence, unshard_sequence

    x = torch.from_numpy(rng.standard_normal((2, 12 * world, 3, 5)))
    parts = [shard_sequence(x, r, world, causal) for r in range(world)]
    assert all(p.shape == (2, 12, 3, 5) for p in parts)
    assert torch.equal(unshard_sequence(parts, causal=causal), x)
    lse = x[:, :, :, 0].transpose(1, 2)   # (B, H, S): the sequence on dim 2, a non-contiguous view
    assert torch.equal(unshard_sequence([shard_sequence(lse, r, world, causal, dim=2) for r in range(world)],
                                        causal=causal, dim=2), lse)


def test_zigzag_layout_puts_chunks_r_and_2w_minus_1_minus_r_on_rank_r():
    from numba_flash.distributed import shard_sequence

    x = torch.arange(16).reshape(1, 16)
    assert shard_sequence(x, 0, 4, causal=True).tolist() == [[0, 1, 14, 15]]
    assert shard_sequence(x, 2, 4, causal=True).tolist() == [[4, 5, 10, 11]]
    assert shard_sequence(x, 1, 4, causal=False).tolist() == [[4, 5, 6, 7]]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_causal_plan_covers_each_visible_pair_once_with_equal_work_per_rank(world):
    """The blocks each rank computes, step by step, mapped back to global positions: together they hold every
    pair (i, j) with j <= i exactly once and no other, and at every step every rank computes as many pairs."""
    from types import SimpleNamespace

    from numba_flash.distributed import _block_plan, shard_sequence

    c = 3
    positions = torch.arange(2 * world * c).reshape(1, -1)
    held = [shard_sequence(positions, r, world, causal=True)[0].tolist() for r in range(world)]
    seen = np.zeros((2 * world * c,) * 2, dtype=int)
    for step in range(world):
        work = set()
        for r in range(world):
            ring = SimpleNamespace(rank=r, size=world, source=lambda s, r=r: (r - s) % world)
            rows, keys, mask = _block_plan(ring, step, True, c)
            qpos, kpos = held[r][rows], held[(r - step) % world][keys]
            pairs = [(i, j) for a, i in enumerate(qpos) for b, j in enumerate(kpos) if not mask or b <= a]
            for i, j in pairs:
                seen[i, j] += 1
            work.add(len(qpos) * len(kpos))
        assert len(work) == 1, (step, work)
    np.testing.assert_array_equal(seen, np.tril(np.ones_like(seen)))


# ---------------------------------------------------------------------------------------------------------------
# Bad input (one process, no process group: every check comes before any communication)


def _qkv(rng, s=6):
    return [torch.from_numpy(rng.standard_normal((1, s, 2, 8)).astype(np.float32)) for _ in range(3)]


def test_bad_input_names_the_argument(rng):
    from numba_flash.distributed import ring_attention, shard_sequence

    q, k, v = _qkv(rng)
    with pytest.raises(AttentionInputError, match=r"^k: expected a torch.Tensor .* got ndarray"):
        ring_attention(q, k.numpy(), v)
    with pytest.raises(AttentionInputError, match=r"^window_size: expected \(-1, -1\) \(a sliding window is not "
                                                  r"supported by ring_attention\), got \(4, 0\)"):
        ring_attention(q, k, v, window_size=(4, 0))
    with pytest.raises(AttentionInputError, match=r"^q: expected 4 dimensions"):
        ring_attention(q[0], k, v)
    q5, k5, v5 = _qkv(rng, s=5)
    with pytest.raises(AttentionInputError, match=r"^q: expected an even local sequence length .* got length 5"):
        ring_attention(q5, k5, v5, causal=True)
    with pytest.raises(AttentionInputError, match=r"^k: expected the local sequence length of q \(6\)"):
        ring_attention(q, k5, v5, causal=True)
    assert not dist.is_initialized()
    with pytest.raises(AttentionInputError, match=r"^group: expected an initialised process group .* got no "
                                                  r"process group initialised"):
        ring_attention(q, k, v)
    with pytest.raises(AttentionInputError, match=r"^x: expected a length along dim 1 divisible into "
                                                  r"2 \* world_size = 4 zigzag chunks \(causal\), got length 6"):
        shard_sequence(q, 0, 2, causal=True)
    with pytest.raises(AttentionInputError, match=r"^rank: expected an int in \[0, 2\), got 2"):
        shard_sequence(q, 2, 2)



# ---------------------------------------------------------------------------------------------------------------
# A ring of one (in this process: no transfers, the whole sequence local)


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store1'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal", [False, True])
def test_a_ring_of_one_is_flash_attn_func(rng, group_of_one, causal):
    from numba_flash import flash_attn_func
    from numba_flash.distributed import ring_attention

    q, k, v = (torch.from_numpy(rng.standard_normal((2, 10, h, 24)).astype(np.float32)).requires_grad_(True)
               for h in (4, 2, 2))
    dout = torch.from_numpy(rng.standard_normal((2, 10, 4, 24)).astype(np.float32))
    got = ring_attention(q, k, v, causal=causal, return_lse=True)
    (got[0] * dout).sum().backward()
    got_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    (want[0] * dout).sum().backward()
    for g, w in zip((*got, *got_grads), (*want, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)   # one block, one call of the same kernel: bitwise
    with pytest.raises(AttentionInputError, match=r"^group: expected a torch.distributed ProcessGroup or None"):
        ring_attention(q, k, v, group="world")
