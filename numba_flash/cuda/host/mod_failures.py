"""A user's mod that raises while a CUDA kernel runs, as ``AttentionInputError`` naming it.

Only the CUDA simulator runs a mod as Python, where its exception (a table read out of range is numpy's IndexError)
comes back from the launch, prefixed by the simulator with the raising thread and block (``tid=[..] ctaid=[..]:``).
On a GPU an exception in device code never reaches the host (``numba_flash.mods``' docstring says what happens
instead), so there is nothing to translate. An exception counts as the mod's when its traceback runs through the
mod's own code: a kernel's own bug under the simulator stays what it is.
"""

from __future__ import annotations

import contextlib
import re
from types import TracebackType
from typing import Any, Callable, Iterator

from numba_flash.cuda.device.user_mods import MOD_NAMES, CudaMods
from numba_flash.mods import mod_error

_SIM_PREFIX = re.compile(r"^tid=\[[^\]]*\] ctaid=\[([^\]]*)\](?:: )?")


def _mod_frame(mods: CudaMods, tb: TracebackType | None) -> tuple[str, Any, dict[str, Any]] | None:
    """(role, the mod's Python function, its arguments by name) of the outermost frame of ``tb`` that runs one of
    ``mods``, or None when none does."""
    codes = {}
    for name in MOD_NAMES:
        dev = getattr(mods, name)
        py = getattr(dev, "py_func", dev)
        if getattr(py, "__code__", None) is not None:
            codes[py.__code__] = (name, py)
    while tb is not None:
        found = codes.get(tb.tb_frame.f_code)
        if found is not None:
            code = tb.tb_frame.f_code
            args = {n: tb.tb_frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount]}
            return found[0], found[1], args
        tb = tb.tb_next
    return None


@contextlib.contextmanager
def named_mod_failures(mods: CudaMods, kernel: str, tile_of: Callable[[tuple[int, ...]], str]) -> Iterator[None]:
    """Around a launch of the kernel called ``kernel`` with ``mods``: an exception one of them raised becomes
    ``AttentionInputError`` naming the mod, its exception (without the simulator's prefix), the element it ran on,
    the block and ``tile_of(block)``, what that block covers (its query or key rows). Other exceptions pass."""
    if not mods.any:
        yield
        return
    try:
        yield
    except Exception as exc:
        found = _mod_frame(mods, exc.__traceback__)
        if found is None:
            raise
        name, fn, args = found
        text = str(exc)
        prefix = _SIM_PREFIX.match(text)
        where = []
        if len(args) >= 4:   # (b, h, q_idx, kv_idx) are the last four, after score_mod's score
            b, h, i, j = list(args.values())[-4:]
            where.append(f"at b={b}, h={h}, q_idx={i}, kv_idx={j}")
        if prefix is not None:
            block = tuple(int(x) for x in prefix.group(1).split(","))
            where.append(f"in block {block} of the {kernel} kernel: {tile_of(block)}")
            cause = type(exc)(text[prefix.end():]) if isinstance(exc.args, tuple) and len(exc.args) == 1 else exc
        else:
            where.append(f"in the {kernel} kernel")
            cause = exc
        raise mod_error(name, fn, cause, ", ".join(where)) from exc


__all__ = ["named_mod_failures"]
