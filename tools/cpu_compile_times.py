"""How long numba takes to compile each CPU kernel from a cold cache, for the working tree and optionally a git
revision: what a new user waits for at first use, what each new mod costs, and most of the test suite's time.

    python tools/cpu_compile_times.py --rev 05876ae --dtype float32 --repeats 2

Each (tree, kernel, repeat) runs in a fresh process with an empty ``NUMBA_CACHE_DIR``, compiling that one kernel
for the dtype (``workspace.kernel_entry``) and nothing else first, so the time includes the helpers it inlines. The
revision's ``numba_flash`` and ``backends`` are extracted with ``git archive`` and put first on ``sys.path``. Runs
alternate between the trees, so that the machine's load hits both alike. Prints min / median seconds per kernel.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"forward": "forward.forward_kernel", "backward_kv": "backward.backward_kv_kernel",
           "backward_dq": "backward.backward_dq_kernel"}
_CHILD = """
import sys, time
import numpy as np
from numba_flash.cpu import forward, backward, workspace
kernel = eval(sys.argv[1])
t0 = time.perf_counter()
workspace.kernel_entry(kernel, np.dtype(sys.argv[2]))
print(time.perf_counter() - t0)
"""


def _extract(rev: str) -> Path:
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "numba_flash", "backends"], check=True,
                         capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix=f"numba_flash_{rev}_"))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(root, filter="data")
    return root


def compile_seconds(tree: Path, kernel: str, dtype: str) -> float:
    """Seconds to compile ``kernel`` (a key of KERNELS) for ``dtype`` from the sources under ``tree``, in a fresh
    process with an empty numba cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, NUMBA_FLASH_QUIET="1", PYTHONPATH=str(tree))
        proc = subprocess.run([sys.executable, "-c", _CHILD, KERNELS[kernel], dtype], env=env, cwd=cache,
                              capture_output=True, text=True, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision to time beside the working tree")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    trees = {"working tree": ROOT}
    if args.rev:
        trees[args.rev] = _extract(args.rev)
    times: dict[tuple[str, str], list[float]] = {}
    for kernel in args.kernels:
        for _ in range(args.repeats):
            for name, tree in trees.items():
                seconds = compile_seconds(tree, kernel, args.dtype)
                times.setdefault((name, kernel), []).append(seconds)
                print(f"  {name}: {kernel} {seconds:.1f} s", file=sys.stderr, flush=True)
    print(f"| kernel ({args.dtype}) | " + " | ".join(f"{n}: min / median s" for n in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for kernel in args.kernels:
        cells = [f"{min(times[(n, kernel)]):.1f} / {statistics.median(times[(n, kernel)]):.1f}" for n in trees]
        print(f"| {kernel} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
