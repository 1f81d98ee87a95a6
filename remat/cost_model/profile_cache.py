"""The measured profile's disk cache: ``$REMAT_CACHE_DIR`` (default ``~/.cache/remat``), one JSON file
per device, keyed by host, thread count (or GPU name) and torch version. A missing, corrupt or
implausible file is measured again and rewritten; an unwritable cache directory only costs the caching.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from .profile_measure import measure_profile
from .profiles import CACHE_SCHEMA, HardwareProfile, check_plausible, profile_from_json, profile_to_json

CACHE_ENV_VAR = "REMAT_CACHE_DIR"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "remat")
    return Path(root)



def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    write_bytes_atomically(path, text.encode())


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file (named by process and thread) and a rename:
    readers, and concurrent writers, see the old file or one whole new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def profile_cache_path(device: torch.device) -> Path:
    """Where ``device``'s measured profile is cached (host, thread count or GPU name, torch version)."""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_")
    else:
        what = f"{torch.get_num_threads()}threads"
    torch_version = torch.__version__.split("+")[0]
    return cache_dir() / f"profile_v{CACHE_SCHEMA}_{device.type}_{socket.gethostname()}_{what}_torch{torch_version}.json"


def read_cached_profile(device: Union[str, torch.device], cache_path: Optional[Path] = None) -> Optional[HardwareProfile]:
    """The cached measured profile of ``device``, or None (none cached, or a file that is corrupt or implausible)."""
    device = torch.device(device)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    try:
        return profile_from_json(json.loads((cache_path or profile_cache_path(device)).read_text()), threads)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measured_profile(device: Union[str, torch.device] = "cpu", cache_path: Optional[Path] = None,
                     measure: Callable[[torch.device], HardwareProfile] = measure_profile) -> HardwareProfile:
    """The measured profile of ``device``, read from the on-disk cache or measured and cached."""
    device = torch.device(device)
    path = cache_path or profile_cache_path(device)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    cached = read_cached_profile(device, path)
    if cached is not None:
        return cached
    profile = measure(device)  # missing, corrupt or implausible: measure again
    try:
        check_plausible(profile, threads)
    except ValueError:
        profile = measure(device)   # one retry: a clock glitch or a burst of load
        check_plausible(profile, threads)
    try:
        write_atomically(path, json.dumps(profile_to_json(profile), indent=1))
    except OSError:
        pass  # an unwritable cache dir still gets a profile, just not a cached one
    return profile

