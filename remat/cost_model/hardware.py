"""Which hardware profile a graph is planned with (``get_profile``), and measuring this machine's on request.

The profile itself, the datasheet and default profiles: ``profiles.py``; how a device is measured:
``profile_measure.py``; the measured profile's disk cache under ``$REMAT_CACHE_DIR`` (default
``~/.cache/remat``): ``profile_cache.py``. This module re-exports their public names.

- ``a100``, ``h100``, ``h200``: datasheet numbers (SXM, dense, no sparsity).
- ``cpu``: this machine's measured profile when one is cached. Otherwise, on a CPU family with a
  default (``DEFAULT_CPU_PROFILES``: x86-64), that default, so the first compile on a new machine
  does not spend 20-60 s measuring (issue 16); ``python -m remat.caches measure``
  (or ``measure_cpu_profile()``) measures and caches this machine's own, which every later compile
  then uses, and ``REMAT_MEASURE_HARDWARE=1`` measures at the first compile, as before. A family
  with no default is measured at its first compile. ``cuda``: the current CUDA device, measured.

``get_profile("auto", device)`` picks the datasheet profile of a recognised GPU, the measured
``cuda`` profile of any other GPU, else ``cpu``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch

from .profile_cache import (CACHE_ENV_VAR, cache_dir, measured_profile, profile_cache_path, read_cached_profile,
                            write_atomically, write_bytes_atomically)
from .profile_measure import CONV_WIDTHS, clock_for, real_tensors, time_call
from .profiles import (CACHE_SCHEMA, DATASHEET_NAMES, DATASHEET_PROFILES, DEFAULT_CPU_PROFILES, PROFILE_NAMES,
                       HardwareProfile, check_plausible, cpu_family, datasheet_name_for, profile_from_json,
                       profile_to_json)

MEASURE_ENV_VAR = "REMAT_MEASURE_HARDWARE"


def _measure_at_first_use() -> bool:
    return os.environ.get(MEASURE_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def cpu_profile(cache_path: Optional[Path] = None) -> HardwareProfile:
    """This machine's measured CPU profile when cached; else its family's default
    (``DEFAULT_CPU_PROFILES``), unless ``$REMAT_MEASURE_HARDWARE`` is set or the family has none:
    then measured and cached (``measured_profile``)."""
    if cache_path is None and not _measure_at_first_use():
        cached = read_cached_profile(torch.device("cpu"))
        if cached is not None:
            return cached
        default = DEFAULT_CPU_PROFILES.get(cpu_family())
        if default is not None:
            return default
    return measured_profile("cpu", cache_path)


def measure_cpu_profile() -> HardwareProfile:
    """Measure this machine's CPU (20-60 s on 2 cores) and cache it: every later compile plans with it.
    Replaces a cached measurement."""
    path = profile_cache_path(torch.device("cpu"))
    path.unlink(missing_ok=True)
    return measured_profile("cpu", path)


def get_profile(name: str = "auto", device: Optional[Union[str, torch.device]] = None) -> HardwareProfile:
    """Resolve a profile name: "auto", "cpu", "cuda" (measured), "a100", "h100", "h200" (datasheet).

    "auto" picks, for a CUDA ``device``, the datasheet profile of a recognised GPU
    or else a measured one; for any other device (or None), ``cpu_profile()``.
    """
    if name in DATASHEET_PROFILES:
        return DATASHEET_PROFILES[name]
    if name == "cpu":
        return cpu_profile()
    if name == "cuda":
        return measured_profile(torch.device("cuda"))
    if name != "auto":
        raise ValueError(f"unknown hardware profile {name!r}; use one of {', '.join(PROFILE_NAMES)}")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        known = datasheet_name_for(torch.cuda.get_device_name(device))
        return DATASHEET_PROFILES[known] if known else measured_profile(device)
    return cpu_profile()


__all__ = [
    "CACHE_ENV_VAR", "CACHE_SCHEMA", "CONV_WIDTHS", "DATASHEET_NAMES", "DATASHEET_PROFILES", "DEFAULT_CPU_PROFILES",
    "MEASURE_ENV_VAR", "PROFILE_NAMES", "HardwareProfile", "cache_dir", "check_plausible", "clock_for", "cpu_family",
    "cpu_profile", "datasheet_name_for", "get_profile", "measure_cpu_profile", "measured_profile",
    "profile_cache_path", "profile_from_json", "profile_to_json", "read_cached_profile", "real_tensors", "time_call",
    "write_atomically", "write_bytes_atomically",
]
