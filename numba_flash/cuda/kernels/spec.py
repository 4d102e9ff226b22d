"""What a kernel is, declared once: a ``KernelSpec`` per kernel, its registry entry (registry.py). The launch
(host/launch.py), the tile config and picker (host/config.py, host/picker.py), the plan of a call (host/plan.py),
the compile check, the self-check, the performance model and the backend read a kernel's spec instead of knowing
each kernel by name. A spec imports no ``numba.cuda``: its kernel's file (``module``) is imported when the kernel
is first built.

Every tiled kernel takes the same argument list but for its arrays and its tail::

    arrays..., sq, sk, d, group, window_left, window_right, qmult, capmult, [scale,]
    slopes, bias, seed_lo, seed_hi, threshold, dropout_scale, batch0, tiles, seqs, tail...

``arrays`` are its role's (``ROLE_ARRAYS``): (B, S, H, D) data, and the (B, Hq, Sq) float32 rows lse and delta;
``scale`` is the softmax scale (backward roles only); ``tail`` what the kernel adds (``KernelSpec.tail``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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
#: one slice of a call; the row statistics, a (2, B, Hq, Sq) float32 array of each row's max of the scores (log2
#: units) and log2 of its sum of exponentials, with an int64 switch: the SIMT forward writes them where the switch
#: is 1, and the SIMT backward kernels read them where it is 1 and they give the row's lse bit for bit (else lse),
#: so that P of a dominant score is exactly 1 (config.SCORE_PARTS; a placeholder when the switch is 0).
TAIL_ARGS = ("kv_slots", "dbias", "base", "row_stats")
#: What a kernel runs on: float32 FMAs ("simt"), mma.sync on 16-bit data ("mma"), mma.sync's TF32 ("tf32"),
#: Hopper's wgmma on 16-bit data ("wgmma", sm_90a only: ``KernelSpec.min_compute_capability``).
KINDS = ("simt", "mma", "tf32", "wgmma")
#: Roles of kernels without a tile config (``AuxKernel``): the backward's delta pre-pass, the sums of attn_bias's
#: gradient, decoding's split merge.
AUX_ROLES = ("delta", "bias_grad_sum", "merge")

#: (block_m, block_n, threads)
Tiles = tuple[int, int, int]


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """One tiled kernel.

    ``name``: what a tile config's ``kernel`` says; ``role``: "forward", "dkdv", "dq" (``ROLE_ARRAYS``) or
    "decode"; ``kind``: ``KINDS``; ``module``: its file in kernels/, whose ``build(cfg, variant)`` makes it (a
    ``numba.cuda`` dispatcher, cached by the kernel's factory); ``smem_words(cfg)``: float32 words of shared memory
    it declares for a tile config (16-bit tiles: half as many bytes per element, rounded up); ``tiles``: the
    picker's preferred (block_m, block_n, threads) per head-dim bucket within 48 KiB; ``wide_tiles``: best first,
    those past 48 KiB (dynamic shared memory, host/smem.py; a kernel without them never takes it); ``bits``: its
    16-bit data travels as uint16 bits; ``dtypes``: what it is built for; ``tail``: the arguments it takes past
    the common list (``TAIL_ARGS``); ``max_head_dim``: its largest bucket; ``warp_rows``: tensor-core kernels run
    one warp per 16 of these (a tile config's field); ``fragments``: how many 16-row fragments of ``warp_rows``
    one warp may own (a tile config's ``fragments``: ``rows / (16 * warps)``; more than one lets each K or V
    fragment loaded from shared memory feed that many independent mma); ``products``: matrix products per tile
    pair (the performance model); ``dbias_sum``: the gradient sum it can build for a broadcast attn_bias
    ("per_key", "per_row"; the compile check builds those apart); ``min_compute_capability``: the oldest GPU it
    compiles for (9.0 for wgmma, whose instructions exist only on the "a" target of that one)."""

    name: str
    role: str
    kind: str
    module: str
    smem_words: Callable[[Any], int]
    tiles: Mapping[int, Tiles]
    wide_tiles: Mapping[int, tuple[Tiles, ...]] = field(default_factory=dict)
    bits: bool = False
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    tail: tuple[str, ...] = ()
    max_head_dim: int = 576
    warp_rows: str = "block_m"
    fragments: tuple[int, ...] = (1,)
    products: int = 0
    dbias_sum: str = ""
    min_compute_capability: tuple[int, int] = (7, 5)

    @property
    def tensor_cores(self) -> bool:
        """Whether it runs on tensor cores (one warp per 16 rows of ``warp_rows``; 16-bit or TF32 tiles)."""
        return self.kind != "simt"

    @property
    def dynamic_smem(self) -> bool:
        """Whether it can take its shared memory as one dynamic buffer, past 48 KiB."""
        return bool(self.wide_tiles)

    def build(self, cfg: Any, variant: Any) -> Any:
        """The ``numba.cuda`` dispatcher of this kernel for ``cfg`` (a ``FlashAttentionConfig``) and ``variant``
        (a ``Variant``), cached by the kernel's factory."""
        if cfg.kernel != self.name:
            raise ValueError(f"cfg: expected a {self.name} tile config, got one for {cfg.kernel}")
        return importlib.import_module(f"numba_flash.cuda.kernels.{self.module}").build(cfg, variant)


@dataclass(frozen=True, eq=False)
class AuxKernel:
    """A kernel without a tile config: ``name``, ``role`` (``AUX_ROLES``), the ``threads`` of its blocks, and the
    factory (``module``'s ``factory``) that builds it for the 16-bit flag it takes (bfloat16 data; the dbias sum
    takes none)."""

    name: str
    role: str
    module: str
    factory: str
    threads: int
    takes_bf16: bool = True

    def build(self, bf16: bool = False) -> Any:
        """The ``numba.cuda`` dispatcher of this kernel (for bfloat16 data with ``bf16``)."""
        make = getattr(importlib.import_module(f"numba_flash.cuda.kernels.{self.module}"), self.factory)
        return make(bf16) if self.takes_bf16 else make()
