"""ring_attention when one rank's own input is bad (issue 47, finding 2): every rank raises the same
AttentionInputError at once, instead of the bad rank raising alone and the others waiting in a collective until the
process group's timeout.

Two spawned processes on gloo over a file store, with a short collective timeout so that a regression fails in
seconds (as a timeout error on the good rank) rather than hanging.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

COLLECTIVE_TIMEOUT_S = 20
LAUNCH_TIMEOUT_S = 180


def _bad_on_rank_1(rank, case):
    """(q, k, v, options): valid on rank 0; on rank 1 the case's defect."""
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 6, 4, 8, generator=g)
    k, v = torch.randn(2, 1, 6, 2, 8, generator=g)
    if rank == 1:
        if case == "heads":          # Hkv = 3 does not divide Hq = 4
            k, v = torch.randn(2, 1, 6, 3, 8, generator=g)
        elif case == "not a tensor":
            k = k.numpy()
        elif case == "odd causal":   # an odd local length with causal: refused before any communication
            q, k, v = (x[:, :5] for x in (q, k, v))
    return q, k, v, dict(causal=case == "odd causal")


CASES = ("heads", "not a tensor", "odd causal")


def _rank_main(rank, world, store, outdir):
    os.environ.setdefault("NUMBA_FLASH_QUIET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    from numba_flash import AttentionInputError
    from numba_flash.distributed import ring_attention

    results = {}
    try:
        for case in CASES:
            q, k, v, opts = _bad_on_rank_1(rank, case)
            try:
                ring_attention(q, k, v, **opts)
                results[case] = "returned"
            except AttentionInputError as exc:
                results[case] = f"AttentionInputError: {exc}"
            except Exception as exc:  # noqa: BLE001  a timeout of the good rank, recorded for the test to show
                results[case] = f"{type(exc).__name__}: {exc}"
                break
    finally:
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
        dist.destroy_process_group()


def test_every_rank_raises_the_bad_ranks_error_at_once(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    start = time.monotonic()
    ctx = mp.start_processes(_rank_main, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = start + LAUNCH_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the ranks did not finish in {LAUNCH_TIMEOUT_S} s")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for case in CASES:
        mine, theirs = got[0].get(case), got[1].get(case)
        assert theirs is not None and theirs.startswith("AttentionInputError: "), (case, got)
        assert mine == theirs, (case, got)    # the same error, the bad rank named, on the good rank too
        assert "rank 1" in mine, (case, mine)
    expected = {"heads": "k_cache|k: expected a number of heads", "not a tensor": "k: expected a torch.Tensor",
                "odd causal": "q: expected an even local sequence length"}
    for case, start_of_message in expected.items():
        assert any(got[0][case][len("AttentionInputError: "):].startswith(s)
                   for s in start_of_message.split("|")), got[0][case]
