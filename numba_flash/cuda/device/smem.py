"""Where each array of a kernel's one dynamic shared-memory buffer lies (the kernels past 48 KiB take their shared
memory dynamically: ``host/smem.py`` says why and how they are launched)."""

from __future__ import annotations


def carve(*sizes: int) -> list[tuple[int, int]]:
    """(start, end), in words, of each array within one dynamic shared buffer, in the order given, each starting
    where the previous one ends (sizes in multiples of 4 words keep every array 16-byte aligned for 128-bit loads).
    An array of size 0 is one its kernel never touches in this specialisation: it gets word 0, aliasing another,
    so that the buffer holds exactly ``FlashAttentionConfig.smem_floats()`` words."""
    spans, at = [], 0
    for words in sizes:
        spans.append((at, at + words) if words else (0, 1))
        at += words
    return spans
