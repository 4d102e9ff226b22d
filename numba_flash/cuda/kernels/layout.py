"""How the kernels lay tiles out in shared memory and split products over threads: row strides with the padding
that keeps 128-bit reads free of bank conflicts, and the thread grid of a product tile. Read by the kernels, by
each kernel's shared-memory words in its registry entry (registry.py) and by the tile config (host/config.py);
it imports nothing of the package, so the registry stays light to import."""

from __future__ import annotations

#: Extra words per row of a transposed (D x rows) tile: a multiple of 4 keeps rows 16-byte aligned for 128-bit
#: loads, and 4 makes the stride 4 times an odd number (see ``transposed_stride``).
TRANSPOSED_PAD = 4


def padded_stride(words: int) -> int:
    """Stride, in words, of a shared-memory row holding ``words`` values that threads read 4 at a time.

    4 words of padding make the stride 4 times an odd number once ``words`` is a multiple of 32, so 8 threads
    reading 16 bytes each from 8 consecutive rows at one column touch 8 different 16-byte pieces of the banks (no
    conflict). Rows of 8 stay unpadded: padding them would grow them by half, the margin that keeps D = 256 under
    48 KiB."""
    return words + TRANSPOSED_PAD if words >= 16 else words


def transposed_stride(rows: int) -> int:
    """Row stride, in words, of the transposed (D x rows) shared copy of a (rows x D) tile.

    A stride that is a multiple of 32 makes one warp's fetch cover 32 rows of a single column, one 4-byte read per
    input row; 4 words of padding let it cover 4 rows x 8 columns, 32 bytes per row (``padded_stride``)."""
    return padded_stride(rows)


def _whole_runs(share: int) -> bool:
    return share <= 4 or share % 4 == 0


def thread_grid(rows: int, cols: int, threads: int) -> tuple[int, int] | None:
    """Split a ``rows x cols`` product tile over ``threads`` threads as a ``(tr, tc)`` grid, each thread owning
    ``rows // tr`` rows and ``cols // tc`` columns (strided or contiguous, as the kernel lays them out). The most
    square per-thread block wins: it needs the fewest shared-memory loads per multiply-add. None when no split
    divides evenly. A thread's rows and columns come in runs of up to 4 (one 128-bit load), so a share of more
    than 4 is a whole number of runs: 576 columns split 16 ways (36 each), not 64 ways (9)."""
    best, best_cost = None, None
    tc = 1
    while tc <= threads:
        tr = threads // tc
        if (tr * tc == threads and rows % tr == 0 and cols % tc == 0
                and _whole_runs(rows // tr) and _whole_runs(cols // tc)):
            cost = rows // tr + cols // tc
            if best_cost is None or cost < best_cost or (cost == best_cost and tc > best[1]):
                best, best_cost = (tr, tc), cost
        tc *= 2
    return best


