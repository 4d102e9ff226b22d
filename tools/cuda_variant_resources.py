"""Registers and local memory of the CUDA kernels per attention variant, from the real compiler (no GPU needed).

For each kernel and head-dim bucket, the tile config the picker makes for float32 on the given compute capability,
compiled with one switch on at a time (ALiBi, attn_bias, dropout) and with every switch on (window both sides,
softcap, ALiBi, attn_bias, dropout: the compile check's worst case). Prints a Markdown table: registers per thread,
and "spill" where the kernel keeps anything in local memory (spills or a stack frame).

Run: .venv/bin/python tools/cuda_variant_resources.py [--cc 9.0 | 9.0a] [--head-dim 32 64 128 256]
"""

from __future__ import annotations

import argparse

from numba_flash.cuda import compile_check as cc
from numba_flash.cuda.compile_check.targets import parse_target
from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT
from numba_flash.cuda.host.picker import tile_config_for
from numba_flash.cuda.kernels.registry import SPECS

#: (has_left, has_right, softcap, alibi, attn_bias, dropout)
VARIANTS = {"plain": (False,) * 6, "alibi": (False, False, False, True, False, False),
            "attn_bias": (False, False, False, False, True, False), "dropout": (False,) * 5 + (True,),
            "all six": (True,) * 6}
#: The SIMT kernels with a tile config, decoding aside.
KERNELS = tuple(spec.name for spec in SPECS if spec.kind == "simt" and spec.role != "decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", type=parse_target,
                        help="compute capability, e.g. 8.0, or an architecture-specific target, 9.0a (default 9.0)")
    parser.add_argument("--head-dim", nargs="+", type=int, default=[32, 64, 128, 256])
    args = parser.parse_args()
    target = args.cc
    print(f"| kernel | D | tiles | {' | '.join(VARIANTS)} |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    for kernel in KERNELS:
        for d in args.head_dim:
            cfg = tile_config_for(d, "float32", target, STATIC_SMEM_LIMIT, kernel, None)
            cells = []
            for flags in VARIANTS.values():
                res = cc.assemble(cc.kernel_ptx(kernel, cfg, "float32", target, flags), kernel, cfg, "float32",
                                  target)
                local = any("local memory" in p for p in res.problems())
                cells.append(f"{res.registers}{' spill' if local else ''}")
            tiles = f"{cfg.block_m}x{cfg.block_n}/{cfg.threads}"
            print(f"| {kernel} | {d} | {tiles} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
