"""What a kernel is, declared once: ``KernelSpec`` (one per tiled kernel, beside its factory) and ``Variant`` (what
a specialisation is compiled for beyond its tile config). The launch (host/launch.py), the plan of a call
(host/plan.py) and the compile check read a kernel's spec instead of knowing each kernel by name.

Every tiled kernel takes the same argument list but for its arrays and its tail::

    arrays..., sq, sk, d, group, window_left, window_right, qmult, capmult, [scale,]
    slopes, bias, seed_lo, seed_hi, threshold, dropout_scale, batch0, tiles, seqs, tail...

``arrays`` are its role's (``ROLE_ARRAYS``): (B, S, H, D) data, and the (B, Hq, Sq) float32 rows lse and delta;
``scale`` is the softmax scale (backward roles only); ``tail`` what the kernel adds (``KernelSpec.tail``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.host.config import FlashAttentionConfig

#: Per role: the arrays the kernel reads and writes, in argument order, and what its blocks tile: query tiles
#: (grid: tiles x query heads x batch) or key tiles (tiles x kv heads x batch).
ROLE_ARRAYS: dict[str, tuple[str, ...]] = {
    "forward": ("q", "k", "v", "out", "lse"),
    "dkdv": ("q", "k", "v", "dout", "lse", "delta", "dk", "dv"),
    "dq": ("q", "k", "v", "dout", "lse", "delta", "dq"),
}
#: The (B, Hq, Sq) float32 arrays among them; the others are (B, S, H, D) data.
ROW_ARRAYS = ("lse", "delta")
ROLE_TILES: dict[str, str] = {"forward": "q", "dkdv": "k", "dq": "q"}
#: The arguments a kernel may take past the common list (``KernelSpec.tail``): K and V as 16-bit slots for the TF32
#: kernel's cp.async (placeholders, never read, on its plain-load path); attn_bias's gradient target (a
#: placeholder without one); the call's (batch entry, query head) of the arrays' first, two int64, for a launch of
#: one slice of a call.
TAIL_ARGS = ("kv_slots", "dbias", "base")


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


@dataclass(frozen=True)
class KernelSpec:
    """One tiled kernel: its ``name`` (a tile config's ``kernel``), its ``role`` (``ROLE_ARRAYS``), whether it
    runs on tensor cores, whether its 16-bit data travels as uint16 bits (``bits``), the ``factory`` that builds
    it for a config and a variant, and ``tail``: the arguments it takes past the common list, by name
    (``TAIL_ARGS``)."""

    name: str
    role: str
    factory: Callable[[FlashAttentionConfig, Variant], Any]
    tensor_cores: bool = False
    bits: bool = False
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    tail: tuple[str, ...] = ()

    def build(self, cfg: FlashAttentionConfig, variant: Variant) -> Any:
        """The ``numba.cuda`` dispatcher of this kernel for ``cfg`` and ``variant`` (cached by the factory)."""
        if cfg.kernel != self.name:
            raise ValueError(f"cfg: expected a {self.name} tile config, got one for {cfg.kernel}")
        return self.factory(cfg, variant)
