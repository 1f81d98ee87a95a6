"""The options of one remat backend, validated at the API boundary.

Everything a planner needs to know travels in one frozen ``RematOptions``; no
module reads a global config.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional, Union

from .units import gb_to_bytes

BUDGET_ENV_VAR = "REMAT_BUDGET_GB"
DUMP_DIR_ENV_VAR = "REMAT_DUMP_DIR"
# Writing a test file there may "succeed" on some kernels, or do harm; a dump never belongs there.
KERNEL_FILE_SYSTEMS = ("/proc", "/sys", "/dev")
SOLVERS = ("greedy", "milp", "save-all")
DEFAULT_MILP_TIME_LIMIT_S = 30.0
HARDWARE_NAMES = ("auto", "cpu", "cuda", "a100", "h100", "h200")
ESTIMATORS = ("roofline", "profile")
# How far under the budget the plan keeps its simulated peak when the user does not say, by the
# device type the graph runs on. CPU: on a corpus of 25 models nobody tuned to (10 random nets, 6 CNNs,
# 9 Hugging Face models; benchmarks/results/fidelity-unseen5-scratch-cpu.md, 58 plans) the peak a plan
# is accepted on (Inductor-checked, else simulated) is within 2.6% of the measured one (p95 and max),
# and no step measured more than 2.7% above its checked peak, so 5% covers it, with room for what
# neither sees (eager code between the forward and the backward). A graph
# with code the simulator is known not to model gets the 15% instead (``headroom_for(modeled=False)``:
# ``pipeline.simulator_models``). Any other device:
# 15%, because on CUDA the simulator was last measured up to 23% under for convolutions
# (benchmarks/results/e2e-cuda.md) and the caching allocator rounds blocks.
DEFAULT_HEADROOM_BY_DEVICE = {"cpu": 0.05}
DEFAULT_HEADROOM_FRACTION = 0.15
# How far under the budget Inductor's check keeps the checked peak of a plan for a graph alone in its
# step, by device type, when the user does not say (``check_headroom_for``). The check reads the code
# Inductor generated, so what it can miss is what no generated code states: eager code between the
# forward and the backward (a loss), the autograd engine's buffers, a library call whose working memory
# was not measured. CPU: no step measured above its checked peak on the last two corpora (81 points of
# random nets, CNNs and Hugging Face models, benchmarks/results/fidelity-unseen7-cpu.md; 28 points,
# fidelity-unseen9-cpu.md); the one miss since (rand-1255, +5.0%, fidelity session 18) was a misread
# library tuple, fixed in c576306. 1% keeps room for a small eager loss. Elsewhere the planning headroom.
DEFAULT_CHECK_HEADROOM_BY_DEVICE = {"cpu": 0.01}
DEFAULT_VERIFY_PEAK = 1   # feedback loop: steps measured after each compile (remat/feedback.py)

BudgetSpec = Union[None, float, int, str]


@dataclass(frozen=True)
class RematOptions:
    """What one ``remat.backend(...)`` was asked for.

    ``budget_bytes`` is None for "no budget" (save the least bytes that cost no
    extra compute); ``budget_is_auto`` means it was resolved from free device memory.
    """

    budget_bytes: Optional[int] = None
    budget_is_auto: bool = False
    dump_dir: Optional[str] = None
    hardware: str = "auto"
    solver: str = "greedy"          # "milp": exact on small graphs, falls back to "greedy" (Plan.solver says why)
    milp_time_limit_s: float = DEFAULT_MILP_TIME_LIMIT_S   # per graph, solver="milp" only
    best_effort: bool = False
    # The planner keeps the simulated peak this fraction under the budget, for what the simulator
    # does not model exactly; None: the device's default (``headroom_for``).
    headroom_fraction: Optional[float] = None
    pareto_points: int = 0          # > 0: the dump adds a Pareto curve of this many budgets per graph
    estimator: str = "roofline"     # "profile": time each graph's real kernels once (cached) instead
    # Steps measured after each compile by the feedback loop (remat/feedback.py); 0 turns it off.
    verify_peak: int = DEFAULT_VERIFY_PEAK
    # Inductor judges each plan before its first step (remat/inductor_check.py): the peak of the code it
    # generated is the number the plan is accepted on (with no budget, the number report.md gives as the
    # plan's peak). False: the simulated peak stands and only the feedback loop corrects it, from the
    # measured step.
    inductor_check: bool = True
    # Whether the training step keeps the model's outputs alive through its backward (``out = step(x);
    # loss_fn(out).backward(); use(out)``). False (the usual ``loss_fn(step(x)).backward()``): they are
    # planned to die when the forward returns unless the backward reads them; a step that does hold them
    # measures over a tight budget once and the feedback loop re-plans it (remat/feedback.py).
    outputs_held: bool = False

    def headroom_for(self, device_type: str, modeled: bool = True) -> float:
        """The headroom a graph running on ``device_type`` ("cpu", "cuda", ...) is planned with:
        the one asked for, else ``DEFAULT_HEADROOM_BY_DEVICE`` (``DEFAULT_HEADROOM_FRACTION`` for
        devices it does not list, and for a graph whose generated code the simulator is known
        not to model, ``modeled=False``)."""
        if self.headroom_fraction is not None:
            return self.headroom_fraction
        if not modeled:
            return DEFAULT_HEADROOM_FRACTION
        return DEFAULT_HEADROOM_BY_DEVICE.get(device_type, DEFAULT_HEADROOM_FRACTION)

    def check_headroom_for(self, device_type: str, modeled: bool = True) -> float:
        """The headroom Inductor's check keeps a graph alone in its step to (its checked peak at or
        under the budget less it): the one asked for, else ``DEFAULT_CHECK_HEADROOM_BY_DEVICE`` where
        the simulator models the code, never more than ``headroom_for``."""
        if self.headroom_fraction is not None or not modeled:
            return self.headroom_for(device_type, modeled)
        return min(DEFAULT_CHECK_HEADROOM_BY_DEVICE.get(device_type, 1.0), self.headroom_for(device_type, modeled))

    def check_target_for(self, budget_bytes: int, device_type: str, modeled: bool = True) -> int:
        """The largest checked peak a plan for a graph alone in its step may have at a budget of
        ``budget_bytes``: the budget less ``check_headroom_for``. Non-decreasing, and at least
        ``planning_target_for`` of the same budget."""
        return target_for_budget(budget_bytes, self.check_headroom_for(device_type, modeled))

    def planning_target_bytes(self, device_type: str, modeled: bool = True) -> Optional[int]:
        """The simulated peak a plan for a graph on ``device_type`` must meet so the measured
        peak meets the budget: the budget less ``headroom_for(device_type, modeled)``."""
        if self.budget_bytes is None:
            return None
        return self.planning_target_for(self.budget_bytes, device_type, modeled)

    def planning_target_for(self, budget_bytes: int, device_type: str, modeled: bool = True) -> int:
        """The planning target these options give a budget of ``budget_bytes`` (the rule
        ``planning_target_bytes`` applies to the budget asked; the budgets an infeasibility error
        names are the smallest this rule accepts, ``smallest_budget_bytes``). Non-decreasing."""
        return target_for_budget(budget_bytes, self.headroom_for(device_type, modeled))

    def cache_key(self) -> str:
        """A string that changes whenever an option that changes the plan changes."""
        return (
            f"budget={self.budget_bytes};hw={self.hardware};solver={self.solver};milp_s={self.milp_time_limit_s};"
            f"best_effort={self.best_effort};headroom={'by-device' if self.headroom_fraction is None else self.headroom_fraction};"
            f"estimator={self.estimator};verify_peak={self.verify_peak};inductor_check={self.inductor_check};"
            f"outputs_held={self.outputs_held}"
        )


def target_for_budget(budget_bytes: int, headroom_fraction: float) -> int:
    """The planning target of a budget: ``floor(budget_bytes * (1 - headroom_fraction))``, in exact
    arithmetic on the headroom as written (``0.1`` is 1/10, not the float nearest it): no float
    rounding and no overflow for any budget. Non-decreasing in the budget."""
    return math.floor(budget_bytes * (1 - Fraction(repr(float(headroom_fraction)))))


def smallest_budget_bytes(accepts: Callable[[int], bool], start_bytes: int = 1) -> int:
    """The smallest budget ``b >= 1`` (bytes) with ``accepts(b)``, for an ``accepts`` that is
    monotone (once true, true for every larger budget) and true for some budget.

    ``start_bytes`` is a first guess (any positive int). Doubling from it, then bisecting: about
    ``2 * log2`` of the answer calls. The budgets an infeasibility error names come from here,
    with ``accepts`` the very rule that admits a plan, so retrying at the named budget is accepted.
    """
    low, high = 0, max(int(start_bytes), 1)       # accepts(low) is false or low is 0
    while not accepts(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if accepts(middle):
            high = middle
        else:
            low = middle
    return high


def validate_budget_gb(budget_gb: BudgetSpec) -> BudgetSpec:
    """Return ``budget_gb`` unchanged if it is None, "auto" or a positive finite number.

    Raises ValueError (TypeError for a non-number type) naming the value, why it
    is wrong and what to pass instead.
    """
    if budget_gb is None:
        return None
    if isinstance(budget_gb, str):
        if budget_gb.strip().lower() == "auto":
            return "auto"
        raise ValueError(
            f"budget_gb={budget_gb!r} is a string; pass the budget as a number of decimal "
            f"gigabytes (1 GB = 1e9 bytes), e.g. budget_gb=8 or budget_gb=0.5, "
            f"or budget_gb='auto' to fit the device's free memory."
        )
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)):
        raise TypeError(
            f"budget_gb={budget_gb!r} has type {type(budget_gb).__name__}; pass a number of "
            f"decimal gigabytes, None (no budget) or 'auto'."
        )
    if math.isnan(budget_gb) or math.isinf(budget_gb):
        raise ValueError(f"budget_gb={budget_gb!r} is not a finite number; pass a positive number of GB, e.g. budget_gb=8.")
    if budget_gb <= 0:
        raise ValueError(
            f"budget_gb={budget_gb!r} must be positive: it bounds the memory one compiled "
            f"forward+backward allocates above what was resident at step start. Pass e.g. budget_gb=8."
        )
    return float(budget_gb)


def budget_from_env(environ: Optional[dict[str, str]] = None) -> BudgetSpec:
    """Read ``REMAT_BUDGET_GB``: unset or empty means no budget; "auto" or a positive finite
    number of GB. Anything else raises ValueError naming the variable and its value."""
    env = os.environ if environ is None else environ
    raw = env.get(BUDGET_ENV_VAR, "").strip()
    if not raw:
        return None
    if raw.lower() == "auto":
        return "auto"
    what_to_set = (f"set it to a positive number of decimal GB (1 GB = 1e9 bytes, e.g. {BUDGET_ENV_VAR}=8), "
                   f"to 'auto' (the device's free memory), or leave it unset for no budget.")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV_VAR}={raw!r} is not a number; {what_to_set}") from None
    if not math.isfinite(value):
        raise ValueError(f"{BUDGET_ENV_VAR}={raw} is not a finite number; {what_to_set}")
    if value <= 0:
        raise ValueError(f"{BUDGET_ENV_VAR}={raw} must be a positive number of GB: it bounds the memory one "
                         f"training step allocates above what was resident at its start; {what_to_set}")
    return value


def dump_dir_from_env(environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """Read ``REMAT_DUMP_DIR``: unset or empty means no dump; else the directory, checked by
    ``validate_dump_dir`` (ValueError naming the variable and the value)."""
    env = os.environ if environ is None else environ
    raw = env.get(DUMP_DIR_ENV_VAR, "")
    if not raw.strip():
        return None
    return validate_dump_dir(raw, name=DUMP_DIR_ENV_VAR)


def validate_dump_dir(dump_dir: Union[str, os.PathLike], name: str = "dump_dir") -> str:
    """Check that ``dump_dir`` can hold remat's dump, before anything is traced: it is a
    directory or can be made one, and a file can be written in it. Creates the directory
    (the dump would) and leaves nothing else behind.

    Raises ValueError naming ``name``, the path and why (an existing file, under ``/proc`` or
    ``/sys``, permission denied, ...); TypeError for something that is not a path.
    """
    import tempfile

    if isinstance(dump_dir, bool) or not isinstance(dump_dir, (str, os.PathLike)):
        raise TypeError(f"{name}={dump_dir!r} has type {type(dump_dir).__name__}; pass a directory path (str).")
    path = os.path.abspath(os.fspath(dump_dir))
    shown = f"{name}={os.fspath(dump_dir)!r}"
    what_to_do = "pass a directory remat can create and write to (e.g. dump_dir='remat_dump')"
    for root in KERNEL_FILE_SYSTEMS:
        if path == root or path.startswith(root + os.sep):
            raise ValueError(f"{shown} is under {root}, a kernel file system where remat cannot write its dump; "
                             f"{what_to_do}.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{shown} is an existing file, not a directory; {what_to_do}.")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(f"{shown} cannot hold the dump: {error.strerror or error} ({path}); {what_to_do}.") from None
    return os.fspath(dump_dir)


def make_options(
    budget_gb: BudgetSpec,
    *,
    dump_dir: Optional[Union[str, os.PathLike]] = None,
    hardware: str = "auto",
    solver: str = "greedy",
    milp_time_limit_s: float = DEFAULT_MILP_TIME_LIMIT_S,
    best_effort: bool = False,
    headroom_fraction: Optional[float] = None,
    pareto_points: int = 0,
    estimator: str = "roofline",
    free_bytes_for_auto: Optional[int] = None,
    verify_peak: int = DEFAULT_VERIFY_PEAK,
    inductor_check: bool = True,
    outputs_held: bool = False,
) -> RematOptions:
    """Validate every user-facing argument and build the frozen options record (``dump_dir``
    is created and checked writable here, before anything is traced)."""
    budget = validate_budget_gb(budget_gb)
    if hardware not in HARDWARE_NAMES:
        raise ValueError(f"hardware={hardware!r} is not one of {HARDWARE_NAMES}.")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {ESTIMATORS}.")
    if solver not in SOLVERS:
        raise ValueError(
            f"solver={solver!r} is not one of {SOLVERS}: 'greedy' (the default, fast on any graph), "
            "'milp' (exact, for small graphs, with a time limit and a fallback to 'greedy') or 'save-all' "
            "(no recomputation: the reference peak without remat).")
    if isinstance(milp_time_limit_s, bool) or not isinstance(milp_time_limit_s, (int, float)) \
            or not math.isfinite(milp_time_limit_s) or milp_time_limit_s <= 0:
        raise ValueError(
            f"milp_time_limit_s={milp_time_limit_s!r} must be a positive finite number of seconds "
            f"(default {DEFAULT_MILP_TIME_LIMIT_S:g}); on a time-out solver='milp' keeps its best verified plan.")
    if not isinstance(best_effort, bool):
        raise TypeError(f"best_effort={best_effort!r} must be a bool.")
    if headroom_fraction is not None and (isinstance(headroom_fraction, bool) or not isinstance(headroom_fraction, (int, float))
                                          or not 0.0 <= headroom_fraction < 0.9):
        raise ValueError(f"headroom_fraction={headroom_fraction!r} must be a number in [0, 0.9), or None for the "
                         f"device's default ({DEFAULT_HEADROOM_BY_DEVICE}, {DEFAULT_HEADROOM_FRACTION} elsewhere).")
    if isinstance(pareto_points, bool) or not isinstance(pareto_points, int) or pareto_points < 0:
        raise ValueError(f"pareto_points={pareto_points!r} must be a non-negative int (0 turns the curve off).")
    if isinstance(verify_peak, bool) or not isinstance(verify_peak, int) or verify_peak < 0:
        raise ValueError(f"verify_peak={verify_peak!r} must be an int >= 0: the steps measured after each compile "
                         f"to check the peak against the budget and re-plan a graph over it (default "
                         f"{DEFAULT_VERIFY_PEAK}; 0 turns the feedback loop off).")
    if not isinstance(inductor_check, bool):
        raise TypeError(f"inductor_check={inductor_check!r} must be a bool.")
    if not isinstance(outputs_held, bool):
        raise TypeError(f"outputs_held={outputs_held!r} must be a bool: True when the training step keeps the "
                        "model's outputs alive through its backward, False (the default) when it drops them first.")
    budget_bytes: Optional[int]
    if budget == "auto":
        if free_bytes_for_auto is None:
            raise ValueError("budget_gb='auto' needs the device's free memory, which could not be read.")
        budget_bytes = int(free_bytes_for_auto)
    elif budget is None:
        budget_bytes = None
    else:
        budget_bytes = gb_to_bytes(float(budget))
    return RematOptions(
        budget_bytes=budget_bytes,
        budget_is_auto=budget == "auto",
        dump_dir=validate_dump_dir(dump_dir) if dump_dir is not None else None,
        hardware=hardware,
        solver=solver,
        milp_time_limit_s=float(milp_time_limit_s),
        best_effort=best_effort,
        headroom_fraction=None if headroom_fraction is None else float(headroom_fraction),
        pareto_points=pareto_points,
        estimator=estimator,
        verify_peak=verify_peak,
        inductor_check=inductor_check,
        outputs_held=outputs_held,
    )
