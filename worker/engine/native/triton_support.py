"""Where the engine's Triton kernels run (triton_attention.py, triton_ops.py): on CUDA devices when Triton is
importable (torch's CUDA wheels bring it), else the torch ops. On CPU they run only under Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported), which is how the tests check them against the torch
path; the tests add "cpu" to ``DEVICES`` for that."""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

DEVICES = {"cuda"}  # device types the Triton kernels are used on (the torch path elsewhere)


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether Triton is installed (not imported here: importing it costs ~1 s)."""
    return importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels replace the torch ops on ``device``."""
    return device.type in DEVICES and available()
