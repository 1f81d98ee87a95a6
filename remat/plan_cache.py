"""Plans cached by graph, on disk, so that compiling the same graph again does not solve again.

Where: ``<remat cache dir>/compile/`` (``$REMAT_CACHE_DIR``, default ``~/.cache/remat``), one
pickle per entry, ``plans/<key>.pkl`` for plans and ``graphs/<key>.pkl`` for the records that
restore a plan on an AOTAutograd cache hit (``remat/compile_cache.py``). Entries are written to a
temporary file and renamed into place, so concurrent writers leave one whole entry, never half of
one; a missing, corrupt or foreign entry reads as a miss.

What a plan's key covers (``plan_key``): the joint graph's code as Inductor hands it to the
partitioner and its inputs' shapes, strides, dtypes and devices (``feedback_store.graph_key``), the
options that choose the plan with the budget (``RematOptions.cache_key``), the hardware profile,
remat's own source (``planner_source_hash``: any edit to the planner misses), the torch version and
thread count, the request (planning target, saved-bytes cap, best effort, headroom and the factor of
the feedback correction the target was corrected by: ``PlanningRequest.cache_repr``), the device type,
whether the simulator models the graph's code, the static-lifetime inputs and the Inductor settings the
simulator reads. A plan is a function of these alone; what a graph sharing its step (graph breaks, DDP/FSDP2 pieces) is planned
at depends on the other graphs too, and so each answer its share search gets is cached by the
request it answered, not the search's outcome: a warm run searches again, reading every answer
(``compile_cache.CachedPlanner``).

Turning it off: ``REMAT_COMPILE_CACHE=0`` (this cache and AOTAutograd's, as before issue 16).
Clearing it: ``clear_compile_cache()`` or ``python -m remat.caches clear``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Optional

from .cost_model.hardware import cache_dir, write_bytes_atomically

COMPILE_CACHE_ENV_VAR = "REMAT_COMPILE_CACHE"
ENTRY_SCHEMA = 1
_PACKAGE_DIR = Path(__file__).resolve().parent


def caching_enabled() -> bool:
    """False when ``$REMAT_COMPILE_CACHE`` is "0", "false", "no" or "off" (any case); True otherwise."""
    return os.environ.get(COMPILE_CACHE_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def compile_cache_dir() -> Path:
    """The root of remat's compile cache: ``<remat cache dir>/compile``."""
    return cache_dir() / "compile"


@functools.lru_cache(maxsize=1)
def planner_source_hash() -> str:
    """A hash of every ``.py`` file of the ``remat`` package (names and bytes): changes with any edit.
    Read once per process (92 files, ~4 ms; every planner request's key and every step key asks for it):
    the code a process runs is the code it imported, so an edit made while it runs is not its code."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        digest.update(path.relative_to(_PACKAGE_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def digest_of(*parts: object) -> str:
    """A 32-hex-digit key of ``parts``, each taken as its ``str`` (separated, so ("ab", "c") != ("a", "bc"))."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def plan_key(graph_key: str, options_key: str, profile: str, device_type: str, modeled: bool,
             graph_context: str, request: str) -> str:
    """The key of a planner's answer (see the module docstring). ``graph_key``: ``feedback_store.graph_key``
    of the joint graph (code, inputs, torch version, threads); ``profile``, ``graph_context`` (the
    static-lifetime inputs and the Inductor settings the simulator reads) and ``request`` (the
    ``PlanningRequest``: target, cap, best effort, headroom, feedback correction's factor) by ``cache_repr``."""
    return digest_of("plan", graph_key, options_key, profile, device_type, modeled, graph_context, request,
                     planner_source_hash())


def entry_path(kind: str, key: str) -> Path:
    return compile_cache_dir() / kind / f"{key}.pkl"


def read_entry(kind: str, key: str) -> Optional[Any]:
    """The object stored under ``kind``/``key``, or None: caching off, no entry, or one that does not
    unpickle as this schema's (then it is as if there were none; the next write replaces it)."""
    if not caching_enabled():
        return None
    try:
        schema, stored_key, value = pickle.loads(entry_path(kind, key).read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, ValueError, TypeError,
            IndexError):   # missing, truncated, from another version of remat: a miss
        return None
    return value if schema == ENTRY_SCHEMA and stored_key == key else None


def write_entry(kind: str, key: str, value: Any) -> Optional[Path]:
    """Store ``value`` under ``kind``/``key`` (atomically: write, then rename); the path, or None when
    caching is off or the cache directory is not writable (the compile then just is not cached)."""
    if not caching_enabled():
        return None
    path = entry_path(kind, key)
    try:
        write_bytes_atomically(path, pickle.dumps((ENTRY_SCHEMA, key, value), protocol=pickle.HIGHEST_PROTOCOL))
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        return None
    return path


def clear_compile_cache() -> int:
    """Delete every cached plan, record and settled step; returns how many entries there were. Inductor's
    own caches (``TORCHINDUCTOR_CACHE_DIR``, AOTAutograd's entries among them) are Inductor's: a record missing
    on an AOTAutograd hit is made again by compiling that graph once more without AOTAutograd's cache."""
    root = compile_cache_dir()
    count = len(list(root.glob("*/*.pkl"))) if root.is_dir() else 0
    shutil.rmtree(root, ignore_errors=True)
    return count
