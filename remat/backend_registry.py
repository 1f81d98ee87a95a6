"""``torch.compile(backend="remat")``: the backend by name, configured from the environment
(``REMAT_BUDGET_GB``, ``REMAT_DUMP_DIR``), and its registration with Dynamo (the package's
``torch_dynamo_backends`` entry point names ``remat_backend_from_env``)."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional, Sequence

from torch import fx

from ._torch_compile import register_dynamo_backend
from ._torch_dynamo import passthrough_error_class
from .backend import RematBackend, backend
from .options import budget_from_env


class _EnvBackends:
    """The backends ``backend="remat"`` made, one per configuration (the values of ``REMAT_BUDGET_GB`` and
    ``REMAT_DUMP_DIR``): while the environment is unchanged every graph goes to the same ``RematBackend``, so
    its dump numbers graphs across the whole run and its step ledger (DDP pieces) is kept. Per configuration,
    not per graph: one small entry per distinct environment the process used."""

    def __init__(self) -> None:
        self._by_config: dict[tuple[str, str], RematBackend] = {}
        self._lock = threading.Lock()

    def for_environment(self, environ: Optional[dict[str, str]] = None) -> RematBackend:
        """The backend for the environment's current configuration, made on first use (ValueError naming a
        bad variable and its value)."""
        from .options import BUDGET_ENV_VAR, DUMP_DIR_ENV_VAR, dump_dir_from_env

        env = os.environ if environ is None else environ
        config = (env.get(BUDGET_ENV_VAR, "").strip(), env.get(DUMP_DIR_ENV_VAR, ""))
        with self._lock:
            found = self._by_config.get(config)
            if found is None:
                found = self._by_config[config] = backend(budget_from_env(env), dump_dir=dump_dir_from_env(env))
            return found


_ENV_BACKENDS = _EnvBackends()


def remat_backend_from_env(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The backend behind ``torch.compile(backend="remat")``: budget from ``REMAT_BUDGET_GB``, dump
    directory from ``REMAT_DUMP_DIR``, read on every call; the same ``RematBackend`` serves every
    graph while they are unchanged (``_EnvBackends``). A bad value raises ``ValueError`` naming the
    variable, and it reaches the caller of the compiled function as a ``ValueError`` (Dynamo does
    not wrap it in ``BackendCompilerFailed``)."""
    try:
        compiler = _ENV_BACKENDS.for_environment()
    except ValueError as error:
        raise passthrough_error_class(ValueError)(error) from None
    return compiler(gm, example_inputs)


def register() -> None:
    """Make ``torch.compile(backend="remat")`` work (idempotent). An installed package declares the
    ``torch_dynamo_backends`` entry point, which Dynamo loads on first lookup (registering here as well would
    make that load fail as a duplicate), so this registers only without one (a source checkout on PYTHONPATH)."""
    from importlib.metadata import entry_points

    if any(ep.name == "remat" for ep in entry_points(group="torch_dynamo_backends")):
        return
    register_dynamo_backend(remat_backend_from_env, "remat")
