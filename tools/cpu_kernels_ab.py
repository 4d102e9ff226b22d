"""Time the CPU kernels of a git revision against the working tree's, and both against torch SDPA, in one process.

    python tools/cpu_kernels_ab.py e5cd89c --repeats 9

The revision's CPU kernels (``numba_flash/cpu/``: the one ``kernels.py`` before the split by concern, or its
``forward.py`` / ``backward.py`` and their siblings after) are loaded beside the current ones (numba compiles them
once into its cache); every repeat calls base, current and torch in turn, forward then backward, so that the
machine's load hits all three alike. Prints min / median ms and the ratios per (B, H, S, D) = (1, 32, 512, 128),
(1, 8, 2048, 64), causal and not, float32, layout "bshd". Kernel calls only: no backend dispatch, for either revision.
``--softcap`` and ``--alibi`` time both revisions' kernels with those variants on (torch SDPA stays plain: it has
neither); ``--mods bias|mask|score`` with a user's mod (revisions from 2026-11-25 on), and prints each side's first
calls, where a new mod is compiled.
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _load_revision(rev: str) -> types.SimpleNamespace:
    """``flash_forward`` and ``flash_backward`` of revision ``rev``, from its ``numba_flash`` files extracted into
    a temporary package under another name. Its top ``__init__`` is not run (it would import the current tree's
    backends); the kernels' relative imports (``..dropout``, ``..mods``) find that revision's modules."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "numba_flash"], check=True,
                         capture_output=True).stdout
    root = Path(tempfile.gettempdir()) / f"numba_flash_cpu_{rev}"
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(root, filter="data")
    name = "numba_flash_cpu_" + "".join(c if c.isalnum() else "_" for c in rev)
    package = types.ModuleType(name)
    sys.modules[name] = package
    if (root / "numba_flash" / "cpu" / "kernels.py").exists():  # before the split by concern: no parent imports
        package.__path__ = [str(root / "numba_flash" / "cpu")]
        kernels = importlib.import_module(name + ".kernels")
        return types.SimpleNamespace(flash_forward=kernels.flash_forward, flash_backward=kernels.flash_backward)
    package.__path__ = [str(root / "numba_flash")]
    return types.SimpleNamespace(flash_forward=importlib.import_module(name + ".cpu.forward").flash_forward,
                                 flash_backward=importlib.import_module(name + ".cpu.backward").flash_backward)


_SLOPES = np.linspace(0.01, 0.1, 32)


def _distance_bias(b, h, q_idx, kv_idx):
    return -_SLOPES[h] * abs(q_idx - kv_idx)


def _documents(seqlen: int):
    """A mask_mod of 8 equal documents over ``seqlen`` keys."""
    def documents(b, h, q_idx, kv_idx):
        return q_idx * 8 // seqlen == kv_idx * 8 // seqlen
    return documents


def _clip(score, b, h, q_idx, kv_idx):
    return 30.0 * math.tanh(score / 30.0)


def _clip_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / 30.0)
    return 1.0 - t * t


MODS = ("bias", "mask", "score")


def _mods(name: str | None, seqlen: int) -> dict:
    """The keyword arguments that give both revisions' kernels the mod ``name`` (none for None)."""
    if name is None:
        return {}
    from numba_flash.mods import Mods, compile_mod

    fns = {"bias": {"bias_mod": _distance_bias}, "mask": {"mask_mod": _documents(seqlen)},
           "score": {"score_mod": _clip, "score_mod_grad": _clip_grad}}[name]
    return {"mods": Mods(**{role: compile_mod(fn, role) for role, fn in fns.items()})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="git revision whose kernels are the base")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with this thread's CPU clock (time.thread_time), which leaves out the time the OS gave "
                         "other processes: only meaningful with NUMBA_NUM_THREADS=1 (the kernels then run on this "
                         "thread) and torch on one thread, on a machine shared with other work")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap of both revisions' calls (0: off)")
    ap.add_argument("--alibi", action="store_true", help="ALiBi slopes 2**-(1 + h / 2) on both revisions' calls")
    ap.add_argument("--mods", choices=MODS,
                    help="both revisions' calls with a bias_mod (per-head distance from a table), a mask_mod (8 equal "
                         "documents) or a score_mod (30 tanh(s / 30), and its derivative); torch SDPA stays plain")
    args = ap.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    import numba
    import torch
    import torch.nn.functional as F

    import numba_flash.cpu as new

    base = _load_revision(args.rev)
    torch.set_num_threads(numba.get_num_threads())
    for batch, heads, seqlen, dim in [(1, 32, 512, 128), (1, 8, 2048, 64)]:
        for causal in (False, True):
            rng = np.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((batch, seqlen, heads, dim)).astype(np.float32) for _ in range(4))
            scale, right = 1 / math.sqrt(dim), (0 if causal else -1)
            cap = args.softcap
            slopes = 2.0 ** -(1.0 + np.arange(heads)[None, :] / 2.0) if args.alibi else None
            mods = _mods(args.mods, seqlen)
            out, lse = np.empty_like(q), np.empty((batch, heads, seqlen), np.float32)
            dq, dk, dv = (np.empty_like(q) for _ in range(3))
            tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
            tdo = torch.from_numpy(do).transpose(1, 2)
            tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            def torch_fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            calls = {
                "base fwd": lambda: base.flash_forward(q, k, v, out, lse, scale, -1, right, cap, slopes,
                                                       **mods),
                "new fwd": lambda: new.flash_forward(q, k, v, out, lse, scale, -1, right, cap, slopes, **mods),
                "torch fwd": torch_fwd,
                "base bwd": lambda: base.flash_backward(do, q, k, v, out, lse, dq, dk, dv, scale, -1, right, cap,
                                                        slopes, **mods),
                "new bwd": lambda: new.flash_backward(do, q, k, v, out, lse, dq, dk, dv, scale, -1, right, cap,
                                                      slopes, **mods),
                "torch bwd": lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True),
            }
            first = {}
            for name, fn in calls.items():  # compile / warm up
                t0 = time.perf_counter()
                fn()
                first[name] = time.perf_counter() - t0
            if args.mods:
                print("  first calls (a new mod compiles here): " +
                      ", ".join(f"{n} {first[n]:.1f} s" for n in calls if not n.startswith("torch")))
            times = {name: [] for name in calls}
            for _ in range(args.repeats):
                for name, fn in calls.items():
                    t0 = clock()
                    fn()
                    times[name].append((clock() - t0) * 1e3)
            print(f"(B,H,S,D)=({batch},{heads},{seqlen},{dim}) causal={causal}")
            for p in ("fwd", "bwd"):
                b, n, t = times[f"base {p}"], times[f"new {p}"], times[f"torch {p}"]
                med = statistics.median
                print(f"  {p}: base {min(b):.1f}/{med(b):.1f}  new {min(n):.1f}/{med(n):.1f}  torch {min(t):.1f}/"
                      f"{med(t):.1f} ms (min/median) | torch/new {min(t) / min(n):.2f} (min) {med(t) / med(n):.2f} "
                      f"(median) | torch/base {min(t) / min(b):.2f} {med(t) / med(b):.2f} | new/base "
                      f"{min(n) / min(b):.2f} {med(n) / med(b):.2f}", flush=True)


if __name__ == "__main__":
    main()
