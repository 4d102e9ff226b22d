"""What the compiler reports for one kernel specialisation (registers, spills, stack, shared memory), read from
nvJitLink's log, and the record the compile check keeps of it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from numba_flash.cuda.compile_check.targets import Target, target_name
from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT, FlashAttentionConfig, smem_limit_for
from numba_flash.cuda.host.gpus import Occupancy, gpu_spec, occupancy
from numba_flash.cuda.kernels.registry import AUX_KERNELS

#: Kernels without a tile config, one specialisation per dtype, and their threads per block (their registry
#: entries'): the delta pre-pass of the backward, the merge of decoding's splits and the sum of a broadcast bias's
#: gradient.
UNTILED_THREADS = {name: aux.threads for name, aux in AUX_KERNELS.items()}


@dataclass(frozen=True)
class KernelResources:
    """One row of the compile check: ``cc`` is the target it was assembled for (targets.py: (9, 0, "a") for a
    wgmma kernel); the GPU it runs on is ``cc[:2]``."""

    kernel: str
    cc: Target
    dtype: str
    config: FlashAttentionConfig | None
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    lmem: int
    smem: int
    f64_instructions: int

    @property
    def threads(self) -> int:
        return self.config.threads if self.config else UNTILED_THREADS[self.kernel]

    @property
    def declared_smem(self) -> int:
        """Static shared memory the kernel declares. On sm_90 the assembler's report adds 1 KiB to any kernel that
        uses shared memory (a kernel declaring 48 KiB reports 50176 B there and 49152 B on sm_75..sm_89; one
        declaring none reports 0 everywhere, tests/numba_flash/cuda/test_cuda_compile.py): the driver's per-block
        reservation, which every GPU from sm_80 on makes and which does not count against the 48 KiB a block may
        declare statically (ptxas, which refuses more than 48 KiB, accepts 48 KiB for sm_90)."""
        return self.smem - 1024 if self.cc >= (9, 0) and self.smem >= 1024 else self.smem

    @property
    def dynamic_smem(self) -> int:
        """Dynamic shared memory the kernel is launched with (its config past 48 KiB, smem.py); the assembler's
        report does not see it."""
        return self.config.dynamic_smem_bytes() if self.config else 0

    @property
    def occupancy(self) -> Occupancy:
        """Blocks per SM on this compute capability, static and dynamic shared memory together; zero means the
        launch would fail with "too many resources requested for launch"."""
        return occupancy(gpu_spec(self.cc[:2]), self.threads, self.registers, self.smem + self.dynamic_smem)

    def problems(self, smem_limit: int = STATIC_SMEM_LIMIT) -> list[str]:
        why = []
        occ = self.occupancy
        if not occ.launchable:
            why.append(f"cannot launch on {target_name(self.cc)}: {occ.limited_by}")
        if self.spill_stores or self.spill_loads or self.lmem or self.stack:
            why.append(f"local memory: {self.spill_stores} B spill stores, {self.spill_loads} B spill loads, "
                       f"{self.stack} B stack, {self.lmem} B lmem")
        if self.declared_smem > smem_limit:
            why.append(f"{self.declared_smem} B static shared memory > {smem_limit}")
        if self.dynamic_smem and self.declared_smem + self.dynamic_smem > smem_limit_for(self.cc[:2]):
            why.append(f"{self.declared_smem} B static + {self.dynamic_smem} B dynamic shared memory > the "
                       f"{smem_limit_for(self.cc[:2])} B opt-in limit of {target_name(self.cc)}")
        if self.registers > 255:
            why.append(f"{self.registers} registers")
        if self.f64_instructions:
            why.append(f"{self.f64_instructions} float64 instructions (a float literal leaked into the math)")
        return why


def _count(pattern: str, log: str) -> int:
    found = re.findall(pattern, log)
    return max((int(x) for x in found), default=0)


def parse_resources(log: str) -> dict[str, int]:
    """Registers, spill bytes, stack, local and shared memory from nvJitLink's verbose log."""
    return {
        "registers": _count(r"used (\d+) registers", log),
        "spill_stores": _count(r"(\d+) bytes spill stores", log),
        "spill_loads": _count(r"(\d+) bytes spill loads", log),
        "stack": _count(r"(\d+) bytes stack frame", log) or _count(r"(\d+) stack", log),
        "lmem": _count(r"(\d+) bytes lmem", log),
        "smem": _count(r"(\d+) bytes smem", log),
    }
