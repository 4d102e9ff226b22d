"""The ``bench`` subcommand of ``numba-flash``, also ``python -m numba_flash.bench`` and ``make bench``.

Exit status: 0; 1 when a backend or peer raised an error (its line says which); 2 for a bad argument or an output
file that cannot be written (checked before anything runs); 3 when a backend named with ``--backend`` cannot run
on this machine or this case; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Sequence

import numpy as np

from ..validation import PRECISIONS
from .cases import CONFIGS, DEFAULT_CONFIG, DTYPES, LAYOUTS, BenchArgumentError, Case, make_cases
from .decode import DECODE_DEFAULTS, DEFAULT_CACHE_LENS
from .engine import execute, resolve_runners
from .plot import plot_format_problem, title_for, write_plot
from .report import format_table, header_lines, write_csv, write_json
from .variants import VARIANTS_DEFAULTS
from .varlen import DEFAULT_TOTAL_TOKENS, VARLEN_DEFAULTS

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DESCRIPTION = ("Time numba-flash's attention backends against numpy naive attention and torch SDPA, forward and "
               "backward, with P50/P95/P99 times, TFLOP/s, peak memory and max error vs the float64 reference.")
EPILOG = ("configs (B, H, S, D): " + ", ".join(f"{n} {c}" for n, c in CONFIGS.items()) +
          f". Default: {DEFAULT_CONFIG}, every available backend, --compare naive,torch. Exit status: 0 ok, 1 a "
          "backend or peer failed, 2 bad arguments, 3 a backend named with --backend cannot run here.")


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or a comma-separated list, got {text!r}")
    if not values or any(x < 1 for x in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type: one positive integer."""
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _output_problem(path: str) -> str | None:
    """Why ``path`` cannot be written, checked before the run so that a typo does not cost the results."""
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    return None


def add_size_arguments(p: argparse.ArgumentParser, sweep: bool = True) -> None:
    """The problem-size flags, shared by ``bench`` and ``explain``."""
    size = p.add_argument_group("problem size (flags override the --config's values)")
    size.add_argument("--config", choices=sorted(CONFIGS), help=f"a seed size (default {DEFAULT_CONFIG})")
    size.add_argument("--batch", type=positive_int)
    size.add_argument("--seqlen", type=_positive_ints if sweep else positive_int,
                      help="one length, or a comma-separated sweep: 512,1024,2048" if sweep else "sequence length")
    size.add_argument("--nheads", type=positive_int)
    size.add_argument("--nheads-kv", type=positive_int, help="key/value heads (GQA); default --nheads")
    size.add_argument("--headdim", type=positive_int)
    size.add_argument("--causal", action="store_true")
    size.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    size.add_argument("--layout", default="bshd", choices=LAYOUTS)
    size.add_argument("--precision", default="ieee", choices=PRECISIONS,
                      help="tf32 lets float32 products run on TF32 tensor cores where a backend can (the cuda "
                           "backend) and torch's (allow_tf32); default ieee")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``numba-flash bench``."""
    add_size_arguments(p)
    what = p.add_argument_group("what to run")
    what.add_argument("--backend", help="comma-separated backends (default: every available one); a named backend "
                                        "that cannot run makes the exit status 3")
    what.add_argument("--compare",
                      help="comma-separated peers from naive (numpy), torch (SDPA), torch_naive; 'none' for none "
                           "(default: naive,torch, plus torch_naive where torch sees a GPU)")
    what.add_argument("--no-grad", action="store_true", help="forward only (default: forward and backward)")
    what.add_argument("--repeats", type=positive_int, default=10, help="timed calls per pass (default 10)")
    what.add_argument("--no-check", action="store_true", help="skip the max error vs the float64 reference")
    what.add_argument("--seed", type=_seed, help="seed of the random inputs (default: fresh)")
    modes = p.add_argument_group(
        "decode and packed sequences (each replaces the dense forward/backward sweep)")
    one = modes.add_mutually_exclusive_group()
    one.add_argument("--decode", action="store_true",
                     help="one KV-cache decoding step (Sq=1, with_kvcache) per cache length vs torch SDPA and a "
                          "memory copy of the same bytes: P50/P95/P99, GB/s of cache read, %% of the copy's GB/s. "
                          f"Defaults B={DECODE_DEFAULTS['batch']} Hq={DECODE_DEFAULTS['nheads']} "
                          f"Hkv={DECODE_DEFAULTS['nheads_kv']} D={DECODE_DEFAULTS['headdim']}")
    one.add_argument("--varlen", action="store_true",
                     help="the packed (thd) forward over a seeded long-tailed mix of lengths vs a dense forward of "
                          f"the same work. Defaults Hq=Hkv={VARLEN_DEFAULTS['nheads']} D={VARLEN_DEFAULTS['headdim']}")
    one.add_argument("--variants", action="store_true",
                     help="the forward with each attention variant (attn_bias, ALiBi, bias_mod, a document "
                          "mask_mod, score_mod) against the plain forward, per backend (the torch path included), "
                          "and torch's flex_attention where it compiles (--compare none leaves it out). Defaults "
                          f"B={VARIANTS_DEFAULTS['batch']} H={VARIANTS_DEFAULTS['nheads']} "
                          f"S={VARIANTS_DEFAULTS['seqlen']} D={VARIANTS_DEFAULTS['headdim']}")
    one.add_argument("--host-overhead", action="store_true",
                     help="the host cost of tiny calls (B=1 H=8 D=64, Sq x Sk = 1x16 and 64x64): forward, "
                          "forward+backward and a KV-cache decode step on the cpu backend (numpy) and the torch "
                          "faces (CPU tensors), each against torch SDPA on the same call: P50/P95 us and the "
                          "ratio. 30 x --repeats calls per row; and the cuda backend's host path with a stub for the "
                          "driver's launch (P95 us against its goal); --backend cpu,torch,cuda; --json")
    modes.add_argument("--cache-lens", type=_positive_ints, metavar="L1,L2,...",
                       help="--decode's cache lengths (default " + ",".join(map(str, DEFAULT_CACHE_LENS)) + ")")
    modes.add_argument("--total-tokens", type=positive_int, metavar="N",
                       help=f"--varlen's packed tokens (default {DEFAULT_TOTAL_TOKENS})")
    out = p.add_argument_group("output")
    out.add_argument("--csv", metavar="FILE")
    out.add_argument("--json", metavar="FILE")
    out.add_argument("--plot", metavar="FILE.png",
                     help="TFLOP/s vs sequence length per backend, log scale, with P95-to-fastest error bars")


def build_parser(prog: str = "numba-flash bench") -> argparse.ArgumentParser:
    """The bench's own parser (``python -m numba_flash.bench``); ``numba_flash.cli`` builds the subcommand's."""
    from .. import __version__

    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"numba-flash {__version__}")
    add_bench_arguments(p)
    return p


def cases_from_args(args: argparse.Namespace, **limits: Any) -> list[Case]:
    """The cases the size flags describe; BenchArgumentError when they do not fit together. ``limits``: passed to
    ``make_cases`` (``max_headdim``)."""
    return make_cases(args.config, batch=args.batch, nheads=args.nheads, nheads_kv=args.nheads_kv,
                      seqlen=args.seqlen, headdim=args.headdim, causal=args.causal, dtype=args.dtype,
                      layout=args.layout, precision=args.precision, **limits)


def _flag_message(exc: BenchArgumentError) -> str:
    """make_cases and resolve_runners name their keyword arguments; on the command line they are flags."""
    text = re.sub(r"\b(nheads_kv|nheads|headdim|batch|seqlen|cache_lens)\b",
                  lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
    return re.sub(r"^(backend|compare|config|dtype|layout|repeats):", r"--\1:", text)


def _mode(args: argparse.Namespace) -> str | None:
    """'--decode', '--varlen' or '--variants' when one of those modes replaces the sweep, else None."""
    for mode in ("decode", "varlen", "variants", "host_overhead"):
        if getattr(args, mode, False):
            return "--" + mode.replace("_", "-")
    return None


def _variants_cases(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """--variants' one case, its backends (the torch path too where torch is installed) and flex_attention."""
    from .decode import resolve_backends
    from .variants import make_variants_case

    unused = {"--config": args.config, "--plot": args.plot, "--causal": args.causal,
              "--layout": args.layout if args.layout != "bshd" else None, "--nheads-kv": args.nheads_kv,
              "--total-tokens": args.total_tokens, "--cache-lens": args.cache_lens, "--no-grad": args.no_grad}
    for flag, value in unused.items():
        if value:
            parser.error(f"{flag} does not apply to --variants")
    if args.compare not in (None, "none", "flex"):
        parser.error(f"--compare: --variants compares with flex (torch's flex_attention) or none, got {args.compare!r}")
    seqlen = args.seqlen[0] if isinstance(args.seqlen, list) and len(args.seqlen) == 1 else args.seqlen
    if isinstance(seqlen, list):
        parser.error("--seqlen: --variants takes one sequence length")
    case = make_variants_case(args.batch, args.nheads, seqlen, args.headdim, args.dtype)
    backends = resolve_backends(args.backend, kvcache=False)
    if args.backend is None and "rocm" not in backends:
        try:
            import torch  # noqa: F401
            backends.append("rocm")  # the torch path, forced: on the CPU it is where the variants run today
        except ImportError:
            pass
    runners = [(n, "backend") for n in backends] + ([] if args.compare == "none" else [("flex_attention", "peer")])
    return [case], runners


def _host_overhead_cases(parser: argparse.ArgumentParser, args: argparse.Namespace
                         ) -> tuple[list[Any], list[Any]]:
    """--host-overhead's rows are fixed (``host_overhead.host_cases``); only --backend, --repeats, --seed and
    --json apply."""
    from .host_overhead import host_backends

    given = {"--config": args.config, "--seqlen": args.seqlen, "--batch": args.batch, "--nheads": args.nheads,
             "--nheads-kv": args.nheads_kv, "--headdim": args.headdim, "--causal": args.causal,
             "--compare": args.compare, "--csv": args.csv, "--plot": args.plot, "--no-grad": args.no_grad,
             "--layout": args.layout if args.layout != "bshd" else None,
             "--dtype": args.dtype if args.dtype != "fp32" else None, "--cache-lens": args.cache_lens,
             "--total-tokens": args.total_tokens}
    for flag, value in given.items():
        if value:
            parser.error(f"{flag} does not apply to --host-overhead")
    try:
        # cuda's rows time its host path with a stub for the driver's launch: they need no GPU, so not a backend's
        return [], [(n, "stub" if n == "cuda" else "backend") for n in host_backends(args.backend)]
    except ValueError as exc:
        parser.error(str(exc))


def _mode_cases(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """--decode's cases and (name, kind) runners, or --varlen's one case and backends; flags that have no meaning
    in the mode are refused rather than ignored."""
    from .decode import decode_peers, make_decode_cases, resolve_backends
    from .varlen import make_varlen_case

    if args.variants:
        return _variants_cases(parser, args)
    if args.host_overhead:
        return _host_overhead_cases(parser, args)
    mode = "--decode" if args.decode else "--varlen"
    unused = {"--config": args.config, "--seqlen": args.seqlen, "--plot": args.plot,
              "--layout": args.layout if args.layout != "bshd" else None,
              "--causal": args.causal if args.decode else None,
              "--total-tokens": args.total_tokens if args.decode else None,
              "--cache-lens": args.cache_lens if args.varlen else None,
              "--compare": args.compare if args.varlen else None,
              "--batch": args.batch if args.varlen else None}
    for flag, value in unused.items():
        if value:
            hint = "; use --cache-lens for the cache lengths" if (flag, mode) == ("--seqlen", "--decode") else ""
            parser.error(f"{flag} does not apply to {mode}{hint}")
    if args.decode:
        cases = make_decode_cases(args.batch, args.nheads, args.nheads_kv, args.headdim, args.cache_lens,
                                  args.dtype)
        return cases, [(n, "backend") for n in resolve_backends(args.backend, kvcache=True)] + \
            [(n, "peer") for n in decode_peers(args.compare)]
    # The lengths are drawn now, from the run's seed, so that the header can show the mix before anything runs.
    if args.seed is None:
        args.seed = int(np.random.SeedSequence().entropy % 2**32)
    case = make_varlen_case(np.random.default_rng(args.seed), args.total_tokens, args.nheads, args.nheads_kv,
                            args.headdim, args.causal, args.dtype)
    return [case], [(n, "backend") for n in resolve_backends(args.backend, kvcache=False)]


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace
               ) -> tuple[list[Any], list[tuple[str, str]]]:
    """Everything that can be wrong with the arguments, found before anything runs (``parser.error`` exits 2).
    Returns the cases (``Case``, or with --decode ``DecodeCase``, with --varlen one ``VarlenCase``) and the
    ``(name, kind)`` runners."""
    if not _mode(args):
        for flag, value in (("--cache-lens", args.cache_lens), ("--total-tokens", args.total_tokens)):
            if value:
                parser.error(f"{flag} needs {'--decode' if flag == '--cache-lens' else '--varlen'}")
    elif args.precision != "ieee":
        parser.error(f"--precision {args.precision} applies to the plain sweep, not to {_mode(args)}")
    try:
        if _mode(args):
            cases, runners = _mode_cases(parser, args)
        else:
            cases = cases_from_args(args)
            runners = resolve_runners(args.backend, args.compare)
    except BenchArgumentError as exc:
        parser.error(_flag_message(exc))
    if _mode(args) and not runners:
        parser.error("nothing to run: no available backend implements this mode and no peer was asked for")
    for flag, path in (("--csv", args.csv), ("--json", args.json), ("--plot", args.plot)):
        problem = path is not None and _output_problem(path)
        if problem:
            parser.error(f"{flag} {path}: {problem}")
    if args.plot:
        problem = plot_format_problem(args.plot)
        if problem:
            parser.error(f"--plot {args.plot}: {problem}")
    return cases, runners


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[Case], list[tuple[str, str]]]:
    """The bench's arguments (a leading ``bench`` is dropped), its cases and its ``(name, kind)`` runners."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    return (args, *check_args(parser, args))


def finish(args: argparse.Namespace, rows: Sequence[Any], table: str, notes: Sequence[str],
           writers: Sequence[tuple[str | None, Any]]) -> int:
    """Every mode's ending: print the table and the notes, write the files (``(path, write)`` pairs, None for a
    flag not given), and return the exit status from the rows (anything with ``name``, ``kind``, ``status``)."""
    print()
    print(table)
    for note in notes:
        print(note)
    for path, write in writers:
        if not path:
            continue
        try:
            write(path)
        except OSError as exc:  # the paths were checked before the run; the disk may still fill up
            print(f"numba-flash bench: error: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"wrote {path}")
    if any(r.status.startswith("error") for r in rows):
        return EXIT_ERROR
    unavailable = [r for r in rows if r.kind == "backend" and r.status.startswith("skipped")] \
        if args.backend is not None else []
    if unavailable:
        names = sorted({r.name for r in unavailable})
        print(f"numba-flash bench: error: {', '.join(names)} named with --backend could not run: "
              + "; ".join(sorted({f'{r.name}: {r.status}' for r in unavailable})), file=sys.stderr)
        return EXIT_UNAVAILABLE
    return EXIT_OK


def _writers(args: argparse.Namespace, rows: Sequence[Any], meta: dict[str, Any], columns: Sequence[str]
             ) -> list[tuple[str | None, Any]]:
    return [(args.csv, lambda p: write_csv(p, rows, columns)), (args.json, lambda p: write_json(p, rows, meta))]


def run_mode_command(args: argparse.Namespace, cases: list[Any], runner_specs: list[tuple[str, str]]) -> int:
    """``--decode`` or ``--varlen``: run, print the header first and the table after, write the files."""
    from .decode import DECODE_COLUMNS, execute_decode
    from .engine import progress_bar
    from .harness import matched_torch_threads
    from .report import format_decode_table, format_varlen_table, machine_info
    from .varlen import VARLEN_COLUMNS, execute_varlen

    backends = [n for n, kind in runner_specs if kind == "backend"]
    check = not args.no_check

    def header(meta: dict[str, Any], text: str) -> None:
        for line in header_lines(meta, text, args.repeats, check)[:-1]:
            print(line)
        which = "the query heads of KV head 0" if args.decode else "the sequences of at most 512 tokens"
        print(f"timing: {args.repeats} calls each after one untimed call (the first compiles); max err: max abs vs "
              f"the float64 reference over {which}" + (" (skipped)" if not check else ""))
        sys.stdout.flush()

    if args.variants:
        return _run_variants(args, cases[0], runner_specs)
    if args.host_overhead:
        from .host_overhead import run_command as run_host_overhead

        return run_host_overhead(args)
    if args.decode:
        peers = [n for n, kind in runner_specs if kind == "peer"]
        rows, meta, notes = execute_decode(
            cases, backends, peers, repeats=args.repeats, check=check, seed=args.seed,
            on_start=lambda m: header(m, cases[0].describe([c.cache_len for c in cases])))
        return finish(args, rows, format_decode_table(rows), notes, _writers(args, rows, meta, DECODE_COLUMNS))
    (case,) = cases
    rng = np.random.default_rng([args.seed, 1])   # the inputs' stream, apart from the one that drew the lengths
    with matched_torch_threads():
        meta = machine_info()
        meta.update(seed=args.seed, repeats=args.repeats, mode="varlen", lengths=list(case.lengths))
        header(meta, case.describe())
        with progress_bar(len(backends), enabled=len(backends) > 1) as tick:
            rows, notes = execute_varlen(case, backends, rng, repeats=args.repeats, check=check, tick=tick)
    return finish(args, rows, format_varlen_table(rows), notes, _writers(args, rows, meta, VARLEN_COLUMNS))


def _run_variants(args: argparse.Namespace, case: Any, runner_specs: list[tuple[str, str]]) -> int:
    """``--variants``: the header, one progress tick per backend, the table of times relative to the plain forward."""
    from .engine import progress_bar
    from .harness import matched_torch_threads
    from .report import machine_info
    from .variants import VARIANTS_COLUMNS, execute_variants, format_variants_table

    backends = [n for n, kind in runner_specs if kind == "backend"]
    if args.seed is None:
        args.seed = int(np.random.SeedSequence().entropy % 2**32)
    with matched_torch_threads():
        meta = machine_info()
        meta.update(seed=args.seed, repeats=args.repeats, mode="variants")
        for line in header_lines(meta, case.describe(), args.repeats, False)[:-1]:
            print(line)
        print(f"timing: {args.repeats} calls each after one untimed call (the first compiles); outputs not checked "
              "here (the test suite checks every variant against the float64 reference)")
        sys.stdout.flush()
        with progress_bar(len(backends), enabled=len(backends) > 1) as tick:
            rows, notes = execute_variants(case, backends, np.random.default_rng(args.seed), repeats=args.repeats,
                                           flex=any(kind == "peer" for _, kind in runner_specs), tick=tick)
    return finish(args, rows, format_variants_table(rows), notes, _writers(args, rows, meta, VARIANTS_COLUMNS))


def unrunnable(args: argparse.Namespace, cases: list[Any], runner_specs: list[tuple[str, str]]) -> list[str]:
    """``name: why`` for each backend named with --backend that cannot run: this machine lacks what it needs (no
    GPU), or, in the plain sweep, it turns down the smallest case's arrays (their dtype). Asked before anything is
    timed, so that a run which is to end in exit 3 does not first spend minutes on the peers."""
    if args.backend is None:
        return []
    from numba_flash import backend_registry

    from .cases import Inputs, Skip
    from .runners import BackendRunner

    problems = []
    for name, kind in runner_specs:
        be = next((b for b in backend_registry.backends("flash") if b.name == name), None)
        if kind != "backend" or be is None:
            continue
        reasons = be.unavailable_reasons(forced=True)
        if not reasons and not _mode(args):
            case = min(cases, key=lambda c: c.seqlen)
            runner = BackendRunner(name)
            try:
                runner.prepare(case, Inputs(case, np.random.default_rng(0)))
            except Skip as exc:
                reasons = [str(exc)]
            finally:
                runner.release()
        if reasons:
            problems.append(f"{name}: {'; '.join(reasons)}")
    return problems


def run_command(args: argparse.Namespace, cases: list[Case], runner_specs: list[tuple[str, str]]) -> int:
    """Run the bench the arguments describe, print the report, write the files; returns the exit status."""
    problems = unrunnable(args, cases, runner_specs)
    if problems:
        names = ", ".join(p.split(":", 1)[0] for p in problems)
        print(f"numba-flash bench: error: {names} named with --backend cannot run ({'; '.join(problems)}); "
              "nothing was run", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if _mode(args):
        return run_mode_command(args, cases, runner_specs)

    def header(meta: dict[str, Any]) -> None:
        for line in header_lines(meta, cases[0].describe([c.seqlen for c in cases]), args.repeats,
                                 not args.no_check):
            print(line)
        sys.stdout.flush()

    results = execute(cases, runner_specs, grad=not args.no_grad, repeats=args.repeats, check=not args.no_check,
                      seed=args.seed, on_start=header)
    writers = ((args.csv, lambda p: write_csv(p, results.rows)),
               (args.json, lambda p: write_json(p, results.rows, results.meta)),
               (args.plot, lambda p: write_plot(p, results.rows, title_for(results.cases, results.meta))))
    return finish(args, results.rows, format_table(results.rows), results.notes, writers)
