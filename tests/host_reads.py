"""`ValuesReadBack`, for the tests that check a pass reads no value back from its tensors."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ValuesReadBack(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (`.item()`, `bool(tensor)`,
    `int(tensor)`) while active: on a GPU each is a device synchronisation, so a CPU test counts these
    in its place."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
