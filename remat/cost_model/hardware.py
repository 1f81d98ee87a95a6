"""Hardware profiles for the roofline time model.

A ``HardwareProfile`` holds peak FLOP/s per dtype, memory bandwidth and a
per-kernel launch floor. The GPU profiles are datasheet numbers (labelled as
such in ``source``); the ``cpu`` profile is measured once on this machine with a
matmul and a copy, and cached on disk. A missing or corrupt cache is rebuilt.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch

CACHE_ENV_VAR = "REMAT_CACHE_DIR"


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    flops_per_s: Mapping[str, float]          # dtype name -> peak FLOP/s
    bandwidth_bytes_per_s: float
    kernel_launch_s: float
    source: str                                # "datasheet" or "measured on <host>"
    extra: Mapping[str, str] = field(default_factory=dict)

    def peak_flops_per_s(self, dtype: Optional[torch.dtype]) -> float:
        key = str(dtype).replace("torch.", "") if dtype is not None else "float32"
        return self.flops_per_s.get(key, self.flops_per_s["float32"])


def _datasheet(name: str, fp32: float, tf32: float, bf16: float, bandwidth: float) -> HardwareProfile:
    return HardwareProfile(
        name=name,
        # fp32 matmuls on tensor cores run at the TF32 rate under torch's default
        # "high" matmul precision only when enabled; we use the plain fp32 rate.
        flops_per_s={"float32": fp32, "tf32": tf32, "bfloat16": bf16, "float16": bf16, "float64": fp32 / 2},
        bandwidth_bytes_per_s=bandwidth,
        kernel_launch_s=4e-6,
        source="datasheet (dense, no sparsity)",
    )


DATASHEET_PROFILES: dict[str, HardwareProfile] = {
    "a100": _datasheet("a100", 19.5e12, 156e12, 312e12, 2.039e12),
    "h100": _datasheet("h100", 67e12, 495e12, 989e12, 3.35e12),
    "h200": _datasheet("h200", 67e12, 495e12, 989e12, 4.8e12),
}


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "remat")
    return Path(root)


def _measure_cpu_profile() -> HardwareProfile:
    """Time a 512^3 fp32 matmul and a 32 MiB copy; best of several runs each."""
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    src = torch.empty(8 << 20)  # 32 MiB of fp32
    dst = torch.empty_like(src)

    def best_of(fn, reps: int = 7) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    mm_s = best_of(lambda: torch.mm(a, b))
    copy_s = best_of(lambda: dst.copy_(src))
    tiny = torch.ones(4)
    launch_s = best_of(lambda: torch.add(tiny, tiny), reps=50)
    fp32 = 2 * n**3 / mm_s
    return HardwareProfile(
        name="cpu",
        flops_per_s={"float32": fp32, "bfloat16": fp32 / 2, "float16": fp32 / 4, "float64": fp32 / 2},
        bandwidth_bytes_per_s=2 * src.numel() * src.element_size() / copy_s,
        kernel_launch_s=launch_s,
        source=f"measured on {os.uname().nodename} with {torch.get_num_threads()} threads",
    )


def _profile_to_json(profile: HardwareProfile) -> dict:
    return {
        "name": profile.name,
        "flops_per_s": dict(profile.flops_per_s),
        "bandwidth_bytes_per_s": profile.bandwidth_bytes_per_s,
        "kernel_launch_s": profile.kernel_launch_s,
        "source": profile.source,
    }


def _profile_from_json(data: dict) -> HardwareProfile:
    profile = HardwareProfile(
        name=str(data["name"]),
        flops_per_s={str(k): float(v) for k, v in data["flops_per_s"].items()},
        bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]),
        kernel_launch_s=float(data["kernel_launch_s"]),
        source=str(data["source"]),
    )
    if profile.bandwidth_bytes_per_s <= 0 or profile.peak_flops_per_s(torch.float32) <= 0:
        raise ValueError("non-positive rates")
    return profile


def cpu_profile(cache_path: Optional[Path] = None) -> HardwareProfile:
    """The measured CPU profile, read from the on-disk cache or measured and cached."""
    path = cache_path or cache_dir() / f"cpu_profile_{torch.get_num_threads()}threads.json"
    try:
        return _profile_from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or corrupt: rebuild
    profile = _measure_cpu_profile()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_profile_to_json(profile), indent=1))
    except OSError:
        pass  # a read-only home still gets a profile, just not a cached one
    return profile


def _cuda_profile_name() -> Optional[str]:
    if not torch.cuda.is_available():
        return None
    device_name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "a100"):
        if key in device_name:
            return key
    return None


def get_profile(name: str = "auto", device: Optional[torch.device] = None) -> HardwareProfile:
    """Resolve a profile name ("auto", "cpu", "a100", "h100", "h200").

    "auto" picks the GPU's datasheet profile when ``device`` is CUDA and
    recognised, the H100 profile for an unrecognised CUDA device, else the CPU.
    """
    if name == "cpu":
        return cpu_profile()
    if name in DATASHEET_PROFILES:
        return DATASHEET_PROFILES[name]
    if name != "auto":
        raise ValueError(f"unknown hardware profile {name!r}; use one of auto, cpu, {', '.join(DATASHEET_PROFILES)}")
    if device is not None and device.type == "cuda":
        return DATASHEET_PROFILES[_cuda_profile_name() or "h100"]
    return cpu_profile()
