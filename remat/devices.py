"""Which device a graph runs on, and how much memory it has free (for ``budget_gb="auto"``)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def device_of(joint_inputs: Sequence[Any]) -> torch.device:
    """The accelerator the graph runs on: the first non-CPU tensor input's device, else CPU.

    Not simply the first tensor's: a graph on a GPU can take CPU tensors too (RNG seeds and
    offsets, scalar constants), and the cost profile must be the GPU's."""
    devices = [value.device for value in joint_inputs if isinstance(value, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def free_device_bytes() -> Optional[int]:
    """The current CUDA device's free bytes if CUDA is available, else the host's available memory
    (``MemAvailable`` in /proc/meminfo); None where neither can be read."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


__all__ = ["device_of", "free_device_bytes"]
