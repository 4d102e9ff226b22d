"""Helpers of the torch faces' eager-path tests (test_torch_eager_forward.py, test_torch_eager_kvcache.py)."""

import torch


class SeesOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op it sees and runs it: under it the face must go through its op (the slow path)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
