"""What a specialisation is compiled for beyond its tile config: the masks, softcap, the data type, ALiBi,
attn_bias, dropout, the copy path, the user's mods, packed sequences and attn_bias's gradient, as one frozen
``Variant`` that every kernel's ``build(cfg, variant)`` takes (registry.py lists the kernels). Apart from spec.py
because the mods' type imports ``numba.cuda``, which the registry must not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods


@dataclass(frozen=True)
class Variant:
    """One specialisation's switches beside its tile config: the masks (``has_left``, ``has_right``: a sliding
    window's sides; causal is a right window of 0), softcap, bfloat16 data (``bf16``; float16 and float32 otherwise,
    told apart by the arrays' types), ALiBi slopes, attn_bias, dropout, the tensor-core kernels' copy path
    (``async_copy``: cp.async, else plain loads), the user's mods (with ``mods.block_tiles`` when a BlockMask
    skips tiles), packed sequences (``varlen``) and attn_bias's gradient (``dbias``: "" none, "per_key",
    "per_row" or "pairs"; SIMT backward kernels only)."""

    has_left: bool = False
    has_right: bool = False
    softcap: bool = False
    bf16: bool = False
    alibi: bool = False
    bias: bool = False
    dropout: bool = False
    async_copy: bool = True
    mods: CudaMods = NO_MODS
    varlen: bool = False
    dbias: str = ""

    def factory_switches(self) -> dict[str, Any]:
        """The factories' keyword switches that are off by default, passed only when on: a call without them
        builds (and caches) the kernel it always did, under the same factory arguments."""
        switches: dict[str, Any] = {}
        if self.varlen:
            switches["varlen"] = True
        if self.dbias:
            switches["dbias"] = self.dbias
        return switches
