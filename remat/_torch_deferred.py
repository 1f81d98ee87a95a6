"""Inductor's generated wrapper modules loaded only for the plan that runs.

A plan Inductor's check judges (a graph's first plan, a refused budget's candidate plans, a corrected
re-plan, a try of the room search: ``judge_loop.py``) needs Inductor's generated *source*, the wrapper the check reads
(``inductor_check.py``); it needs the *module* only if it is the plan that runs. Loading a wrapper
module is what builds its kernels: its top level calls ``async_compile.cpp_pybinding(...)`` once per
kernel and ``async_compile.wait(globals())``, the C++ compiles of a cold compile. Inside
``deferred_loading()`` the wrapper modules Inductor generates are not loaded: each is a
``DeferredModule`` whose ``call`` loads it at its first call, and ``load_deferred`` loads the ones a
compile made (the backend does that for the plan it keeps, before its first step). A plan the check
rejects is never loaded: no kernel of it is built. Measured on the zoo GPT, one forward and backward
from an empty Inductor cache on the 2-core VM (torch 2.13): 17.0 s to the wrappers' source against
31.0 s with the modules loaded (``/tmp`` script of session 30, not in the repo).

Private torch API (torch 2.13): ``torch._inductor.codecache.PyCodeCache.load_by_key_path``, which
``GraphLowering._compile_to_module_lines`` calls once per graph it generates and
``CompiledFxGraph.after_deserialization`` on an FX-graph-cache hit; both read ``call`` of the module,
and ``runner`` and ``recursively_apply_fns`` with a default. Only wrapper modules (a top-level
``call``) are deferred, and only on the thread inside ``deferred_loading()``; every other load (a kernel
module, another thread's compile) goes to Inductor's function unchanged. Verified on torch 2.13 only
(``deferral_supported``): on 2.11-2.12, which ``pyproject.toml`` allows, every module loads as Inductor loads it.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable, Iterator, Optional

VERIFIED_TORCH = ((2, 13),)      # (major, minor) versions whose load path the deferral was checked against


def deferral_supported() -> bool:
    """Whether this torch is one ``deferred_loading`` was verified on (``VERIFIED_TORCH``)."""
    import torch

    return tuple(int(part) for part in torch.__version__.split(".")[:2]) in VERIFIED_TORCH


_local = threading.local()        # .deferred: the list the compiles inside deferred_loading() append to
_lock = threading.Lock()
_installed = {"count": 0, "original": None}


class DeferredModule:
    """A generated wrapper module not loaded yet. A name its source defines at its top level (``call``,
    ``runner``, ``recursively_apply_fns``) is a ``_DeferredAttribute`` that loads the module when it is
    called; another name is missing, as it is on the module."""

    def __init__(self, source: str, path: str, load: Callable[[], Any]) -> None:
        self._source, self._load, self._module = source, load, None
        self.__file__ = path      # Inductor logs where the code was written

    def load(self) -> Any:
        """The loaded module (its kernels built), loading it the first time."""
        if self._module is None:
            self._module = self._load()
        return self._module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not _defines(self._source, name):
            raise AttributeError(name)
        return _DeferredAttribute(self, (name,))


class _DeferredAttribute:
    """``module.a.b...`` of a ``DeferredModule`` (``path``: the names), read from the module once it is
    loaded: calling it loads the module; reading an attribute of it extends the path, without loading."""

    def __init__(self, module: DeferredModule, path: tuple[str, ...]) -> None:
        self._module, self._path, self._target = module, path, None

    def _resolved(self) -> Any:
        """The object the path names in the loaded module (loading it), kept as Inductor keeps it."""
        if self._target is None:
            target = self._module.load()
            for name in self._path:
                target = getattr(target, name)
            self._target = target
        return self._target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolved()(*args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        if self._module._module is not None:
            return getattr(self._resolved(), attribute)
        return _DeferredAttribute(self._module, self._path + (attribute,))

    def __delattr__(self, attribute: str) -> None:
        # ``CompiledFxGraph.__del__`` drops ``runner.partitions``: nothing to drop in a module never loaded
        target = self._resolved() if self._module._module is not None else None
        if target is not None:     # None too at interpreter exit, once the module's globals are cleared
            delattr(target, attribute)


def _defines(source: str, name: str) -> bool:
    """Whether module ``source`` binds ``name`` at its top level (an assignment, a def or a class)."""
    return re.search(rf"^(?:def |class )?{re.escape(name)}\b", source, re.M) is not None


def _load_by_key_path(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_by_key_path(cls: Any, key: str, path: str, linemap: Optional[list] = None,
                         attrs: Optional[dict] = None, **kwargs: Any) -> Any:
        deferred = getattr(_local, "deferred", None)
        if deferred is not None:
            with open(path) as file:
                source = file.read()
            if _defines(source, "call"):
                module = DeferredModule(source, path, lambda: original(cls, key, path, linemap, attrs, **kwargs))
                deferred.append(module)
                return module
        return original(cls, key, path, linemap, attrs, **kwargs)
    return load_by_key_path


@contextlib.contextmanager
def deferred_loading(modules: list) -> Iterator[None]:
    """Inductor's wrapper modules generated on this thread inside are appended to ``modules`` as
    ``DeferredModule``s instead of being loaded (see the module docstring); ``load_deferred(modules)``
    loads them."""
    from torch._inductor.codecache import PyCodeCache

    with _lock:
        if _installed["count"] == 0:
            _installed["original"] = PyCodeCache.__dict__["load_by_key_path"]
            PyCodeCache.load_by_key_path = classmethod(_load_by_key_path(_installed["original"].__func__))
        _installed["count"] += 1
    outer, _local.deferred = getattr(_local, "deferred", None), modules
    try:
        yield
    finally:
        _local.deferred = outer
        with _lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                PyCodeCache.load_by_key_path = _installed["original"]


def load_deferred(modules: list) -> None:
    """Load every module of ``modules`` (``deferred_loading``'s list) now: their kernels are built here,
    not inside the first call."""
    for module in modules:
        module.load()
