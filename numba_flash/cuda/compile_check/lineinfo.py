"""Line info that names the right file for code numba inlined from another file (for the performance model).

numba splices ``inline="always"`` helpers into a kernel at the IR level, and its debug-info builder gives every
instruction a location in the *kernel's* file at the statement's own line number: an instruction of a helper in
tiles.py, line 128, reads as "backward_dq.py, line 128". When that number falls inside the kernel's main loop, the
performance model takes the helper's instructions for the kernel statement on that line (a load of the helper for
an anchor of the kernel line, say), and its trip counts come out wrong; numba also moves any line before the
kernel's ``def`` to the ``def`` line. ``helper_lines_in_their_files`` makes the lowering emit such a statement's
location in a lexical-block scope of its own file (what C compilers emit for code from an included file), so that
``nvdisasm -g`` prints ``File "tiles.py", line 128`` and the model counts it as a helper's. It changes debug
metadata only: the code is the same.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

_lock = threading.Lock()


@contextlib.contextmanager
def helper_lines_in_their_files() -> Iterator[None]:
    """While active (in this process), kernels lowered with line info locate inlined statements in their own
    files. Not re-entrant across threads: the patch is global, so compilations inside it are serialised."""
    from numba.cuda import debuginfo, lowering

    with _lock:
        adjust = lowering.BaseLower._adjust_line_if_prologue
        mark = debuginfo.CUDADIBuilder.mark_location
        own_mark = "mark_location" in vars(debuginfo.CUDADIBuilder)

        def adjust_line(self: Any, line: int) -> int:
            filename = getattr(self.loc, "filename", None)
            self.debuginfo._statement_file = filename
            if filename and os.path.abspath(filename) != os.path.abspath(self.func_ir.loc.filename):
                return line   # another file's line: the 'def' line of this one would be wrong
            return adjust(self, line)

        def mark_location(self: Any, builder: Any, line: int) -> None:
            filename = getattr(self, "_statement_file", None)
            if not filename or os.path.abspath(filename) == self.filepath or not self.subprograms:
                mark(self, builder, line)
                return
            scopes = self.__dict__.setdefault("_file_scopes", {})
            key = (os.path.abspath(filename), id(self.subprograms[-1]))
            if key not in scopes:
                difile = self.module.add_debug_info("DIFile", {"directory": os.path.dirname(key[0]),
                                                               "filename": os.path.basename(key[0])})
                scopes[key] = self.module.add_debug_info(
                    "DILexicalBlockFile", {"scope": self.subprograms[-1], "file": difile, "discriminator": 0})
            builder.debug_metadata = self.module.add_debug_info(
                "DILocation", {"line": line, "column": 1, "scope": scopes[key]})

        lowering.BaseLower._adjust_line_if_prologue = adjust_line
        debuginfo.CUDADIBuilder.mark_location = mark_location
        try:
            yield
        finally:
            lowering.BaseLower._adjust_line_if_prologue = adjust
            if own_mark:
                debuginfo.CUDADIBuilder.mark_location = mark
            else:
                del debuginfo.CUDADIBuilder.mark_location
