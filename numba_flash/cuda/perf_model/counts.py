"""What one main-loop iteration of a CUDA kernel issues, per warp: the counting half of the static performance model
(``perf_model.py`` turns the counts into bounds and says how the whole model works).

``loop_counts`` reads the kernel's Python source: how often each line runs per iteration, from the trip counts of the
loops inside it (the tile config's constants, per warp's lanes), the loops of the helpers it inlines included.
``dynamic_counts`` reads the SASS with line info: the instructions each line compiled to, with each inner SASS
loop's trip count recovered from its anchors (instructions that issue once per execution of their line).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

from numba_flash.cuda.perf_model.latency import iteration_cycles
from numba_flash.cuda.compile_check.sass import Function, hgmma_n

#: The key of ``dynamic_counts``'s per-warp dict that holds clocks (the latency-bound issue time), not counts.
LATENCY_KEY = "latency_clocks"

# Opcodes that issue once per execution of the source line holding them (the anchors that undo unrolling).
_ANCHOR_OPS = frozenset({"FFMA", "MUFU", "FMNMX", "HMMA"})
_ANCHOR_CLASSES = frozenset({"lds", "sts", "ldg", "stg"})


# ---- how often each source line runs per main-loop iteration ----

def _constants(py_func: Callable) -> dict[str, Any]:
    """The compile-time constants a kernel closes over (tile sizes, flags)."""
    code = py_func.__code__
    cells = py_func.__closure__ or ()
    env = {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    return {k: v for k, v in env.items() if isinstance(v, (int, bool, float))}


def _range_args(node: ast.For) -> list[ast.expr] | None:
    it = node.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
        return list(it.args)
    return None


def _trips(args: list[Any], env: dict[str, Any]) -> int | None:
    """len(range(*args)) for ``range`` arguments compiled by ``_compiled``, evaluated in ``env``; None when an
    argument depends on a runtime value."""
    try:
        values = [eval(code, {"__builtins__": {}}, env) for code in args]
    except (NameError, TypeError):
        return None
    return len(range(*(int(v) for v in values)))


def _is_rare_branch(node: ast.AST) -> bool:
    """``if <name>_nonfinite:``, the kernels' branch for a tile holding an inf or a NaN (see masks.py), and
    ``if <name>_edge:``, the masking pass of a tile that crosses the band's or the sequence's edge (tc_forward.py):
    off the steady state the model describes (a long sequence's tiles are interior)."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id.endswith(("_nonfinite", "_edge")))


def _compiled(node: ast.For) -> list[Any]:
    return [compile(ast.Expression(a), "<range>", "eval") for a in _range_args(node)]


@dataclass
class LoopCounts:
    """Per-warp executions of each source line during one iteration of the kernel's main loop."""

    file: str
    main_lines: tuple[int, int]            # first and last line of the main loop's statement
    per_warp: list[dict[int, int]]         # warp -> {line: executions}
    rare_lines: frozenset[int] = frozenset()   # lines of branches counted as not taken (``_is_rare_branch``)
    # Loops of the kernel's helpers (device functions it closes over) with compile-time trip counts: (file, line)
    # of each line of such a loop -> (trips per call for each warp, the kernel lines that call the helper).
    helper_loops: dict[tuple[str, int], tuple[list[int], tuple[int, ...]]] = field(default_factory=dict)


def _helper_loops(py_func: Callable, tree: ast.AST, first: int,
                  threads: int) -> dict[tuple[str, int], tuple[list[int], tuple[int, ...]]]:
    """The range loops of the device functions ``py_func`` closes over whose trip counts follow from the helper's
    own compile-time constants and the thread index ``t`` it is passed (make_keep_bits' loop over a lane's scores,
    make_dropout_tile's cooperative pass), per warp (its busiest lane), with the kernel lines that call each
    helper, so that a SASS loop made of a helper's lines alone gets a trip count."""
    found: dict[tuple[str, int], tuple[list[int], tuple[int, ...]]] = {}
    for helper, calls, helper_tree in _called_helpers(py_func, tree, first):
        env, start = _constants(helper), helper.__code__.co_firstlineno - 1
        loops = [node for node in ast.walk(helper_tree) if isinstance(node, ast.For)]
        for node in loops:
            # Only a loop with no loop inside or around it: each line of its body runs once per trip.
            nested = any(other is not node and (other.lineno <= node.lineno <= other.end_lineno
                                                or node.lineno <= other.lineno <= node.end_lineno)
                         for other in loops)
            if not nested and _range_args(node) is not None:
                loop_args = _compiled(node)
                per_warp = []
                for w in range(-(-threads // 32)):
                    lanes = [_trips(loop_args, dict(env, t=lane)) for lane in range(32 * w, min(32 * w + 32, threads))]
                    per_warp.append(None if None in lanes else max(lanes))
                if None not in per_warp:
                    for line in range(node.lineno, node.end_lineno + 1):
                        found[(helper.__code__.co_filename, start + line)] = (per_warp, calls)
    return found


def _called_helpers(py_func: Callable, tree: ast.AST, first: int, depth: int = 2) -> list[tuple]:
    """(helper, kernel lines that call it, helper's syntax tree) for each device function ``py_func`` closes over
    and calls, and, ``depth`` levels down, for those helpers' own (tc_softmax's per-tile start calls
    make_keep_bits' helper): a nested helper's lines run where the kernel calls the outer one."""
    out = []
    for name, cell in zip(py_func.__code__.co_freevars, py_func.__closure__ or ()):
        helper = getattr(cell.cell_contents, "py_func", None)
        if helper is None:
            continue
        calls = tuple(first + node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                      and isinstance(node.func, ast.Name) and node.func.id == name)
        if not calls:
            continue
        try:
            helper_tree = ast.parse(textwrap.dedent(inspect.getsource(helper)))
        except (OSError, TypeError):
            continue
        out.append((helper, calls, helper_tree))
        if depth > 1:
            out += [(inner, calls, inner_tree) for inner, _, inner_tree
                    in _called_helpers(helper, helper_tree, helper.__code__.co_firstlineno - 1, depth - 1)]
    return out


def loop_counts(py_func: Callable, threads: int) -> LoopCounts:
    """Executions of every line inside the kernel's main loop, per iteration, for each warp of a block of
    ``threads`` threads. The main loop is the innermost loop whose trip count depends on runtime values (the
    sequence lengths); loops inside it have compile-time trip counts, possibly depending on the thread index
    ``t`` (``range(t, N, threads)``), and a warp runs a loop as often as its busiest lane. Branches are taken as
    taken (full tiles, every key visible), the steady state of a long sequence, except the rare path for
    non-finite data (``if x_nonfinite:``) and the masking pass of an edge tile (``if x_edge:``), taken as not
    taken."""
    src = textwrap.dedent(inspect.getsource(py_func))
    first = py_func.__code__.co_firstlineno - 1
    tree = ast.parse(src)
    consts = _constants(py_func)
    thread_var = "t"

    # Every statement with the range loops around it, outermost first; each range loop's arguments, compiled once.
    enclosing: dict[ast.stmt, list[ast.For]] = {}
    args: dict[ast.For, list[Any]] = {}
    rare: set[int] = set()

    def visit(child: ast.AST, chain: list[ast.For]) -> None:
        inside = chain
        if isinstance(child, ast.stmt):
            enclosing[child] = chain
            if isinstance(child, ast.For) and _range_args(child) is not None:
                args[child] = _compiled(child)
                inside = chain + [child]
            if _is_rare_branch(child):
                # Counted as not taken: its body's lines get no executions, its else branch the usual ones.
                rare.update(range(child.body[0].lineno, child.body[-1].end_lineno + 1))
                for stmt in child.orelse:
                    visit(stmt, chain)
                return
        walk(child, inside)

    def walk(node: ast.AST, chain: list[ast.For]) -> None:
        for child in ast.iter_child_nodes(node):
            visit(child, chain)

    walk(tree, [])
    probe = dict(consts, **{thread_var: 0})
    runtime = [f for f in args if _trips(args[f], probe) is None]
    inner = [f for f in runtime if not any(g is not f and f in enclosing[g] for g in runtime)]
    if not inner:
        raise ValueError(f"{py_func.__name__}: no main loop (a loop over runtime bounds) found")
    main = max(inner, key=lambda f: f.end_lineno - f.lineno)

    # A statement inside the main loop runs once per trip of each range loop between it and the main loop, and a
    # loop's own line (its control) once per trip of itself too.
    statements = []
    for node, chain in enclosing.items():
        if main in chain:
            loops = chain[chain.index(main) + 1:] + ([node] if node in args else [])
            statements.append((node.lineno, [args[f] for f in loops]))

    per_warp = []
    for w in range(-(-threads // 32)):
        counts: dict[int, int] = {main.lineno: 1}
        for lane in range(32 * w, min(32 * w + 32, threads)):
            env = dict(consts, **{thread_var: lane})
            for lineno, loops in statements:
                n = 1
                for loop_args in loops:
                    n *= _trips(loop_args, env) or 0
                counts[lineno] = max(counts.get(lineno, 0), n)
        per_warp.append({first + k: v for k, v in counts.items()})
    return LoopCounts(py_func.__code__.co_filename, (first + main.lineno, first + main.end_lineno), per_warp,
                      frozenset(first + line for line in rare), _helper_loops(py_func, tree, first, threads))


# ---- what the SASS issues per main-loop iteration ----

def _weight(ins) -> int:
    """How many executions of its source line one anchor instruction stands for (a 128-bit load: four words)."""
    return max(1, ins.bits // 32) if ins.cls in _ANCHOR_CLASSES else 1


def _is_anchor(ins) -> bool:
    return ins.base in _ANCHOR_OPS or ins.cls in _ANCHOR_CLASSES


def _trip(anchors: dict[tuple[int, str], int], remaining: dict[tuple[int, str], float]) -> float:
    """Iterations of a loop body from its anchors: the executions left to one anchor, divided by the copies of it
    the body holds. Stores come first (an assignment writes one element, however many it reads), then the
    arithmetic anchors, then loads (a statement may read several elements); among those, the anchor with the most
    copies (an anchor with few may be an instruction the compiler filed under a neighbouring line)."""
    rank = {"sts": 2, "stg": 2, "lds": 0, "ldg": 0}
    key = max(anchors, key=lambda k: (rank.get(k[1], 1), anchors[k], remaining[k]))
    return remaining[key] / anchors[key]


def dynamic_counts(fn: Function, counts: LoopCounts) -> list[dict[str, float]]:
    """Per warp: instructions issued per main-loop iteration by class (see ``sass.classify``), plus
    'smem_wavefronts' (shared-memory clocks), 'total', and ``LATENCY_KEY``: the clocks the warp takes to issue the
    iteration when each instruction waits for its operands (``perf_latency.iteration_cycles`` over the stretches of
    instructions that run equally often)."""
    ins = fn.instructions
    lo_line, hi_line = counts.main_lines

    def in_main(i: int) -> bool:
        src = ins[i].source
        return src is not None and src[0] == counts.file and lo_line <= src[1] <= hi_line

    loops = fn.loops()
    tagged = [sum(1 for i in range(a, b + 1) if in_main(i)) for a, b in loops]
    if not loops or max(tagged) == 0:
        raise ValueError(f"{fn.name}: no SASS loop holds the main loop's lines")
    best = max(tagged)
    # The main loop: the shortest loop holding nearly all of the main loop's instructions (an outer loop, such as
    # the dK/dV kernel's loop over the heads of a group, holds them too).
    main = min((ab for ab, n in zip(loops, tagged) if n >= 0.9 * best), key=lambda ab: ab[1] - ab[0])
    inner = [ab for ab in loops if main[0] <= ab[0] and ab[1] <= main[1] and ab != main]

    def innermost(i: int) -> tuple[int, int] | None:
        holding = [ab for ab in inner if ab[0] <= i <= ab[1]]
        return min(holding, key=lambda ab: ab[1] - ab[0]) if holding else None

    home = [innermost(i) for i in range(len(ins))]
    # Loops of the rare path (``_is_rare_branch``): they hold rare lines and no line of the steady state (values
    # computed before the main loop may be recomputed in them). Not counted, with any helper's instructions in them.
    kernel_lines: dict[tuple[int, int], set[int]] = {}
    for i in range(main[0], main[1] + 1):
        src = ins[i].source
        if home[i] is not None and src is not None and src[0] == counts.file:
            kernel_lines.setdefault(home[i], set()).add(src[1])
    steady = set().union(*counts.per_warp)
    rare_loops = {ab for ab, lines in kernel_lines.items() if lines & counts.rare_lines and not lines & steady}
    results = []
    for warp, per_line in enumerate(counts.per_warp):
        # Anchor instructions of each line in each inner loop, in executions of the line per loop iteration.
        anchors: dict[tuple[int, int] | None, dict[tuple[int, str], int]] = {}
        plain: dict[tuple[int, int] | None, dict[int, int]] = {}
        for i in range(main[0], main[1] + 1):
            src = ins[i].source
            if src is None or src[0] != counts.file or src[1] not in per_line:
                continue
            loop = home[i]
            plain.setdefault(loop, {}).setdefault(src[1], 0)
            plain[loop][src[1]] += 1
            if _is_anchor(ins[i]):
                key = (src[1], ins[i].base if ins[i].base in _ANCHOR_OPS else ins[i].cls)
                anchors.setdefault(loop, {}).setdefault(key, 0)
                anchors[loop][key] += _weight(ins[i])
        remaining_anchor: dict[tuple[int, str], float] = {}
        remaining_line = {line: float(n) for line, n in per_line.items()}
        trips: dict[tuple[int, int] | None, float] = {None: 1.0}
        # Inner loops with the most copies of a line first: an unrolled loop takes its share of the line's
        # executions before the remainder loop that follows it.
        order = sorted(inner, key=lambda ab: -max(anchors.get(ab, {0: 0}).values() or [0]))
        for ab in order:
            ab_anchors = anchors.get(ab, {})
            if ab in rare_loops:
                trip = 0.0
            elif ab_anchors:
                for k in ab_anchors:
                    remaining_anchor.setdefault(k, float(per_line[k[0]]))
                trip = _trip(ab_anchors, remaining_anchor)
                for k, n in ab_anchors.items():
                    remaining_anchor[k] = max(0.0, remaining_anchor[k] - trip * n)
            elif plain.get(ab):
                trip = max(remaining_line[line] / n for line, n in plain[ab].items())
            elif (helper := _helper_loop_of(ins, ab, counts)) is not None:
                # A helper's own loop: its trips per call times the calls this iteration makes, divided by the
                # copies of the body an unrolled SASS loop holds (from its anchors; none: kept rolled).
                trips_per_call, calls = helper
                runs = float(trips_per_call[warp] * sum(per_line.get(line, 0) for line in calls))
                copies: dict[tuple[int, str], int] = {}
                for i in range(ab[0], ab[1] + 1):
                    src = ins[i].source
                    if src is not None and (src[0], src[1]) in counts.helper_loops and _is_anchor(ins[i]):
                        key = (src[1], ins[i].base if ins[i].base in _ANCHOR_OPS else ins[i].cls)
                        copies[key] = copies.get(key, 0) + _weight(ins[i])
                trip = _trip(copies, {k: runs for k in copies}) if copies else runs
            else:
                raise ValueError(_unanchored_message(fn.name, ins, ab, home))
            for line, n in plain.get(ab, {}).items():
                remaining_line[line] = max(0.0, remaining_line[line] - trip * n)
            trips[ab] = trip
        # Straight-line code of the main loop runs once per iteration, except copies of a looped line that the
        # compiler peeled off a loop (the runtime remainder of an unrolled loop): they get what the loops left.
        straight: dict[int, float] = {}
        for line, n in plain.get(None, {}).items():
            keys = {k: c for k, c in anchors.get(None, {}).items() if k[0] == line}
            if keys:   # lines without an anchor (a barrier, index arithmetic) run once
                straight[line] = min(1.0, _trip(keys, {k: remaining_anchor.get(k, float(per_line[line]))
                                                       for k in keys}))
        out: dict[str, float] = {"total": 0.0, "smem_wavefronts": 0.0}
        runs: list[tuple[Any, float, list[int]]] = []   # stretches of one loop and one count, for the latency
        for i in range(main[0], main[1] + 1):
            loop = home[i]
            src = ins[i].source
            if loop in rare_loops or (src is not None and src[0] == counts.file and src[1] in counts.rare_lines):
                continue
            # An inner loop nested in another inner loop: its trip count already counts every execution.
            m = trips.get(loop, 1.0)
            if loop is None and src is not None and src[0] == counts.file:
                m = straight.get(src[1], 1.0)
            if runs and runs[-1][0] == loop and runs[-1][1] == m:
                runs[-1][2].append(i)
            else:
                runs.append((loop, m, [i]))
            c = ins[i].cls
            out[c] = out.get(c, 0.0) + m
            out["total"] += m
            # a warp's quarter of the warpgroup's 64 x N x 16 multiply-adds; a QGMMA's 64 x N x 32 8-bit ones count
            # as that many 16-bit ones, the time they take at the 16-bit rate
            if c == "hgmma":
                out["hgmma_fma"] = out.get("hgmma_fma", 0.0) + m * 16 * hgmma_n(ins[i]) * 16
            if c in ("lds", "sts", "ldg", "stg", "local"):   # memory instructions also by access width
                key = f"{c}.{ins[i].bits}"
                out[key] = out.get(key, 0.0) + m
            if c in ("lds", "sts"):
                out["smem_wavefronts"] += m * max(1, ins[i].bits // 32)
        # 'latency_clocks': the warp's issue time with its dependency waits (perf_latency), not an instruction count
        out[LATENCY_KEY] = iteration_cycles([(loop is not None, m, [ins[i] for i in run]) for loop, m, run in runs])
        results.append(out)
    return results


def _helper_loop_of(ins: Any, loop: tuple[int, int],
                    counts: LoopCounts) -> tuple[list[int], tuple[int, ...]] | None:
    """The helper loop (``LoopCounts.helper_loops``) whose lines the SASS loop holds, or None."""
    for i in range(loop[0], loop[1] + 1):
        src = ins[i].source
        if src is not None and (src[0], src[1]) in counts.helper_loops:
            return counts.helper_loops[(src[0], src[1])]
    return None


def _unanchored_message(name: str, ins: Any, loop: tuple[int, int], home: list) -> str:
    where = sorted({f"{os.path.basename(x.source[0])}:{x.source[1]}" for i, x in enumerate(ins)
                    if home[i] == loop and x.source is not None})
    short = re.findall(r"\d([A-Za-z_]+_kernel)", name)   # the Python name is the last one numba mangled in
    return (f"{short[-1] if short else name[:60]}: a SASS loop inside the main loop ({loop[1] - loop[0] + 1} instructions, from "
            f"{', '.join(where[:8]) or 'no source line'}) holds no instruction of a kernel line that runs in the "
            "steady state, so its trip count cannot be recovered: a loop the compiler kept inside an inlined helper. "
            "Write the loop on kernel lines (as the tile fetches are), or fully unroll it.")
