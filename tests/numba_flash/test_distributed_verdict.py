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
    """(positional arguments, keyword arguments): valid on rank 0; on rank 1 the case's defect."""
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 6, 4, 8, generator=g)
    k, v = torch.randn(2, 1, 6, 2, 8, generator=g)
    opts = dict(causal=case == "odd causal")
    if rank == 1:
        if case == "heads":          # Hkv = 3 does not divide Hq = 4
            k, v = torch.randn(2, 1, 6, 3, 8, generator=g)
        elif case == "not a tensor":
            k = k.numpy()
        elif case == "odd causal":   # an odd local length with causal: refused before any communication
            q, k, v = (x[:, :5] for x in (q, k, v))
        # refused before ring_attention's body runs (checked_arguments, Python's binding) or by the group check:
        elif case == "unknown keyword":
            opts["casual"] = True
        elif case == "masked tensor":
            from torch import masked

            q = masked.masked_tensor(q, torch.rand(q.shape, generator=g) > 0.5)
        elif case == "missing v":
            return (q, k), opts
        elif case == "bad group":
            opts["group"] = "world"
        elif case == "window not a pair":   # tuple(5) raised a TypeError in the local checks
            opts["window_size"] = 5
    return (q, k, v), opts


CASES = ("heads", "not a tensor", "odd causal", "unknown keyword", "masked tensor", "missing v", "bad group",
         "window not a pair")


def _rank_main(rank, world, store, outdir):
    import warnings

    warnings.filterwarnings("ignore")   # torch.masked's prototype warning
    os.environ.setdefault("NUMBA_FLASH_QUIET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    from numba_flash import AttentionInputError
    from numba_flash.distributed import ring_attention

    results = {}
    try:
        for case in CASES:
            args, opts = _bad_on_rank_1(rank, case)
            try:
                ring_attention(*args, **opts)
                results[case] = "returned"
            except Exception as exc:  # noqa: BLE001  recorded for the test; a timeout of the good rank ends the loop
                results[case] = f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, (AttentionInputError, TypeError)):
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
    expected = {"heads": "AttentionInputError: k_cache|AttentionInputError: k: expected a number of heads",
                "not a tensor": "AttentionInputError: k: expected a torch.Tensor",
                "odd causal": "AttentionInputError: q: expected an even local sequence length",
                "unknown keyword": "UnknownKeywordError: casual: not an argument of ring_attention(); did you mean",
                "masked tensor": "AttentionInputError: q: expected a plain tensor",
                "missing v": "TypeError: ring_attention() missing 1 required",
                "bad group": "AttentionInputError: group: expected a torch.distributed ProcessGroup or None",
                "window not a pair": "AttentionInputError: window_size: expected (-1, -1)"}
    for case in CASES:
        mine, theirs = got[0].get(case), got[1].get(case)
        assert theirs is not None and mine == theirs, (case, got)   # the same error on both ranks, none hung
        assert "rank 1 of 2" in mine, (case, mine)                   # naming the bad rank
        assert any(mine.startswith(s) for s in expected[case].split("|")), (case, mine)
