"""The ``numba-flash`` command.

    numba-flash bench [...]      time the backends against naive attention and torch SDPA (the default: a
                                 command line without a subcommand, ``numba-flash --config tiny``, means bench)
    numba-flash warmup           compile (or load from numba's cache) every CPU kernel ahead of first use;
                                 with --cuda --cc 8.0 9.0, the common CUDA kernels into the disk cache (no GPU needed)
    numba-flash explain [...]    which backend a call of that shape would use, and why the others would not
    numba-flash --version

``python -m numba_flash`` is the same command. Exit status 2 for a bad argument everywhere; for each subcommand's
other codes see its ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

SUBCOMMANDS = ("bench", "warmup", "explain")
TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


def _versions() -> str:
    import numba
    import numpy as np

    from . import __version__

    return f"numba-flash {__version__} (numba {numba.__version__}, numpy {np.__version__})"


def build_parser() -> argparse.ArgumentParser:
    """The ``numba-flash`` parser with its three subcommands."""
    from .bench.cli import DESCRIPTION, EPILOG, add_bench_arguments, add_size_arguments

    p = argparse.ArgumentParser(prog="numba-flash", description="Exact FlashAttention as Numba kernels: "
                                "benchmark the backends, warm numba's cache up, explain the dispatcher's choice.",
                                epilog="Without a subcommand, the arguments go to 'bench'.")
    p.add_argument("--version", action="version", version=_versions())
    sub = p.add_subparsers(dest="command", metavar="{bench,warmup,explain}")

    bench = sub.add_parser("bench", help="time the backends against naive attention and torch SDPA",
                           description=DESCRIPTION, epilog=EPILOG)
    add_bench_arguments(bench)
    bench.set_defaults(handler=_bench, parser=bench)

    warm = sub.add_parser("warmup", help="compile every CPU kernel ahead of first use",
                          description="Compile (or load from numba's on-disk cache) every CPU kernel "
                                      "specialisation, and check each against the float64 reference. The first "
                                      "run on a machine takes about 2 minutes per dtype on 2 cores (twice that with "
                                      "--mods); later ones well under a second. "
                                      "Exit status 1 when a kernel disagrees with the reference.")
    warm.add_argument("--dtype", default=None,
                      help="comma-separated compute dtypes: float32 (also serves float16 and bfloat16 inputs), "
                           "float64 (default: both); with --cuda: float16, bfloat16, float32 (default: all three)")
    warm.add_argument("--cuda", action="store_true",
                      help="instead, compile the CUDA kernels common models use (forward and backward, causal and "
                           "not) into the kernel cache (NUMBA_FLASH_CACHE_DIR, else NUMBA_CACHE_DIR), for the "
                           "compute capabilities of --cc; no GPU needed")
    warm.add_argument("--cc", nargs="+", default=None, metavar="X.Y",
                      help="with --cuda: compute capabilities, e.g. 8.0 9.0 (required)")
    warm.add_argument("--head-dim", default="64,128", help="with --cuda: comma-separated head dims (default: 64,128)")
    warm.add_argument("--jobs", type=int, default=None,
                      help="with --cuda: processes compiling at once (default: one per CPU core)")
    warm.add_argument("--mods", action="store_true",
                      help="also the forward and backward kernels' variant for bias_mod, mask_mod and score_mod "
                           "(one for any mods; about as long again to compile)")
    warm.set_defaults(handler=_warmup, parser=warm)

    explain = sub.add_parser("explain", help="which backend a call would use, and why not the others",
                             description="Build random inputs of the given shape and print what the dispatcher "
                                         "would do with a forward call on them. Exit status 3 when no backend "
                                         "can serve the call.")
    add_size_arguments(explain, sweep=False)
    explain.add_argument("--window", metavar="LEFT,RIGHT", help="sliding window, -1 unbounded (e.g. 128,0)")
    explain.add_argument("--softcap", type=float, default=0.0)
    explain.add_argument("--array", choices=("numpy", "torch"), default="numpy", help="array kind of the inputs")
    explain.add_argument("--device", default="cpu", help="torch device of the inputs (with --array torch)")
    explain.add_argument("--backend", help="force this backend (as backend= on the call)")
    explain.set_defaults(handler=_explain, parser=explain)
    return p


def _bench(args: argparse.Namespace) -> int:
    from .bench.cli import EXIT_INTERRUPTED, check_args, run_command

    cases, runners = check_args(args.parser, args)
    try:
        return run_command(args, cases, runners)
    except KeyboardInterrupt:
        print("numba-flash bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _warmup(args: argparse.Namespace) -> int:
    if args.cuda:
        return _warmup_cuda(args)
    from .warmup import DTYPES, cache_location, warmup

    text = args.dtype or ",".join(DTYPES)
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        args.parser.error(f"--dtype: expected some of {', '.join(DTYPES)}, got {text!r}")
    print(f"numba-flash warmup: CPU kernels; numba's cache: {cache_location()}", flush=True)
    steps = warmup(dtypes, mods=args.mods, report=lambda line: print("  " + line, flush=True))
    return 0 if all(s.ok for s in steps) else 1


def _warmup_cuda(args: argparse.Namespace) -> int:
    """``warmup --cuda``: the CUDA kernels into the disk cache (compile_check/warm_cache.py)."""
    import os

    from numba_flash.cuda.compile_check import toolchain_ccs
    from numba_flash.cuda.compile_check.warm_cache import DTYPES, warm, warm_jobs
    from numba_flash.cuda.host.kernel_cache import cache_dir, enabled

    if not args.cc:
        args.parser.error("--cuda: expected --cc with compute capabilities, e.g. --cc 8.0 9.0")
    try:   # the compiler itself: NVVM through numba-cuda, nvJitLink through cuda-bindings
        import numba.cuda  # noqa: F401
        from cuda.bindings import nvjitlink  # noqa: F401
    except ImportError as exc:
        args.parser.error(f"--cuda: needs numba-cuda and the CUDA compiler packages (pip install "
                          f"'numba-flash[cuda]'): {exc}")
    try:
        ccs = tuple(tuple(int(x) for x in c.split(".")) for c in args.cc)
        head_dims = tuple(int(x) for x in args.head_dim.split(",") if x.strip())
    except ValueError:
        args.parser.error(f"--cc / --head-dim: expected versions like 8.0 and integers, got {args.cc} "
                          f"{args.head_dim!r}")
    missing = [f"{a}.{b}" for a, b in ccs if (a, b) not in toolchain_ccs()]
    if missing:
        args.parser.error(f"--cc: the installed CUDA toolchain cannot build for {', '.join(missing)}")
    if not head_dims or any(not 1 <= d <= 256 for d in head_dims):
        args.parser.error(f"--head-dim: expected head dims from 1 to 256 (wider heads compile on first use), "
                          f"got {args.head_dim!r}")
    dtypes = tuple(d.strip() for d in (args.dtype or ",".join(DTYPES)).split(",") if d.strip())
    if not dtypes or any(d not in DTYPES for d in dtypes):
        args.parser.error(f"--dtype: with --cuda expected some of {', '.join(DTYPES)}, got {args.dtype!r}")
    if not enabled():
        args.parser.error("--cuda: the kernel cache is off (the CUDA simulator, or NUMBA_FLASH_KERNEL_CACHE=0)")
    jobs = warm_jobs(ccs, dtypes, head_dims)
    print(f"numba-flash warmup: {len(jobs)} CUDA kernels into {cache_dir()}", flush=True)
    results = warm(jobs, report=lambda line: print("  " + line, flush=True), workers=args.jobs or os.cpu_count() or 1)
    compiled = sum(1 for _, c, _ in results if c)
    print(f"done: {compiled} compiled, {len(results) - compiled} cached already", flush=True)
    return 0


def _window(parser: argparse.ArgumentParser, text: str | None) -> tuple[int, int]:
    if text is None:
        return (-1, -1)
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        parser.error(f"--window: expected LEFT,RIGHT (two integers, -1 unbounded), got {text!r}")
    return left, right


def _explain(args: argparse.Namespace) -> int:
    import numpy as np

    from . import backend_registry
    from .bench.cases import BenchArgumentError
    from .errors import AttentionInputError, NoBackendError
    from .validation import MAX_HEAD_DIM

    try:
        from .bench.cli import cases_from_args

        (case,) = cases_from_args(args, max_headdim=MAX_HEAD_DIM)
    except BenchArgumentError as exc:
        args.parser.error(str(exc))
    window = _window(args.parser, args.window)
    rng = np.random.default_rng()
    arrays: list[Any] = [rng.standard_normal(case.shape(h), dtype=np.float32)
                         for h in (case.nheads, case.nheads_kv, case.nheads_kv)]
    if args.array == "torch":
        try:
            import torch
        except ImportError:
            args.parser.error("--array torch: torch is not installed")
        try:
            arrays = [torch.from_numpy(a).to(device=args.device, dtype=getattr(torch, case.dtype)) for a in arrays]
        except (RuntimeError, AssertionError) as exc:   # torch's words for a device it lacks or does not know
            args.parser.error(f"--device {args.device}: {str(exc).splitlines()[0]}")
    elif case.dtype == "bfloat16":
        args.parser.error("--dtype bf16 needs --array torch (numpy has no bfloat16)")
    else:
        arrays = [a.astype(case.dtype) for a in arrays]
    op = backend_registry.get("flash")
    try:
        explanation = op.explain(*arrays, causal=case.causal, window_size=window, softcap=args.softcap,
                                 layout=case.layout, backend=args.backend, precision=case.precision)
    except (AttentionInputError, NoBackendError) as exc:   # the call's own error, as the library words it
        args.parser.error(str(exc))
    print(explanation)
    return 0 if explanation.chosen is not None else 3


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``numba-flash`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        # a word where a subcommand goes is a misspelt one ('bench' takes no positional argument)
        from numba_flash.arguments import closest

        near = closest(argv[0], SUBCOMMANDS)
        hint = f"did you mean {' or '.join(map(repr, near))}?" if near else f"the commands are {', '.join(SUBCOMMANDS)}"
        parser.error(f"unknown command {argv[0]!r}; {hint}")
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in TOP_LEVEL_FLAGS):
        argv = ["bench"] + argv
    args, extras = parser.parse_known_args(argv)
    if extras:   # argparse's own error names no flag one may have meant (Python 3.11's has no suggestions)
        _unknown_flags(getattr(args, "parser", parser), extras)
    return args.handler(args)


def _unknown_flags(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """Exit as argparse does for arguments ``parser`` does not take, naming the closest flag of each misspelt one."""
    from numba_flash.arguments import closest

    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    hints = []
    for word in extras:
        near = closest(word.split("=")[0], flags) if word.startswith("--") else []
        if near:
            hints.append(f"{word}: did you mean {' or '.join(near)}?")
    parser.error(f"unrecognized arguments: {' '.join(extras)}" + ("; " + "; ".join(hints) if hints else ""))


def bench_main(argv: Sequence[str] | None = None) -> int:
    """``python -m numba_flash.bench [bench] ARGS``; another subcommand (``warmup``, ``explain``) goes to ``main``.
    Returns the exit status (see ``numba_flash.bench.cli``'s docstring). It lives here, not in the bench package,
    so that the bench never imports the command that imports it."""
    from .bench.cli import EXIT_INTERRUPTED, parse_args, run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS and argv[0] != "bench":
        return main(argv)
    try:
        return run_command(*parse_args(argv))
    except KeyboardInterrupt:
        print("numba-flash bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
