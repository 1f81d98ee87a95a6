"""What benchmarks/pareto.py measures with: the models, the baseline methods, and one step.

- Models: the zoo's GPT (dropout 0.1) and CNN, a deeper 8-layer GPT for two CPU cores, a
  tiny GPT for smoke runs, and a GPT sized for one H200 (``--device cuda``).
- Methods: every method compiles the same parameters (one model instance; checkpointed
  variants are shallow copies whose chosen blocks run under ``torch.utils.checkpoint``), each
  with its own backend object, so Dynamo keeps one cache entry per method and a counter
  proves each method compiled its own graph.
- A step: gradients set to None outside the measured window (the budget's resident baseline
  holds no gradients), then ``loss = dot(out, w)`` with fixed random weights ``w`` (a plain
  sum sends identical gradients everywhere; see tests/conftest.py) and ``loss.backward()``.

Units: bytes and seconds; 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import remat
from remat.metrics import StepMonitor, timed_step
from remat.testing.zoo import GPT, GPTConfig, SmallCNN, make_cnn, make_gpt

STEP_SEED = 1234
LOSS_SEED = 4321
aten = torch.ops.aten


# ---- models ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    # Per-parameter relative gradient error above which a method's gradients count as wrong.
    grad_rel_tol: float = 1e-4


def _gpt(cfg: GPTConfig, batch: int) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    return functools.partial(make_gpt, cfg, batch)


H200_GPT = GPTConfig(vocab_size=32768, seq_len=2048, d_model=2048, n_heads=16, n_layers=4, dropout=0.1)

MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", f"zoo GPT {GPTConfig()}, batch 8", _gpt(GPTConfig(), 8)),
    "cnn": ModelSpec("cnn", "zoo SmallCNN (6 conv-BN-ReLU blocks, 16/32 channels), batch 16 x 3x32x32", make_cnn),
    "gpt-deep": ModelSpec("gpt-deep", f"deeper GPT {GPTConfig(n_layers=8)}, batch 8", _gpt(GPTConfig(n_layers=8), 8)),
    "gpt-tiny": ModelSpec(
        "gpt-tiny", f"tiny GPT {GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_heads=2, n_layers=2)}, batch 4",
        _gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_heads=2, n_layers=2), 4)),
    # fp32 parameters with TF32 matmuls (set in pareto.py for --device cuda): a gradient that
    # differs only by TF32 rounding stays near 1e-3; a different dropout mask gives ~1e-1 or more.
    "gpt-h200": ModelSpec("gpt-h200", f"GPT for one H200 {H200_GPT}, batch 8, fp32 with TF32 matmuls",
                          _gpt(H200_GPT, 8), grad_rel_tol=1e-2),
}


def blocks_of(model: nn.Module) -> tuple[str, list[int]]:
    """The attribute holding the model's repeated blocks, and the indices of the blocks in it."""
    if isinstance(model, GPT):
        return "blocks", list(range(len(model.blocks)))
    if isinstance(model, SmallCNN):
        return "features", [i for i, m in enumerate(model.features) if isinstance(m, nn.Sequential)]
    raise TypeError(f"no block structure known for {type(model).__name__}")


def has_attention(model: nn.Module) -> bool:
    return isinstance(model, GPT)


# ---- checkpointed variants ------------------------------------------------------------------


class Checkpointed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint`` (use_reentrant=False)."""

    def __init__(self, inner: nn.Module, context_fn: Optional[Callable[[], Any]] = None) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context_fn is None:
            return checkpoint(self.inner, x, use_reentrant=False)
        return checkpoint(self.inner, x, use_reentrant=False, context_fn=self.context_fn)


def with_checkpointed_blocks(model: nn.Module, every: int = 1, context_fn: Optional[Callable[[], Any]] = None) -> nn.Module:
    """A shallow copy of ``model`` (same parameter objects) whose blocks 0, every, 2*every, ...
    run under checkpoint; the original model is left as it is."""
    attr, indices = blocks_of(model)
    chosen = set(indices[::every])
    variant = copy.copy(model)
    variant._modules = dict(model._modules)
    container = getattr(model, attr)
    wrapped = [Checkpointed(m, context_fn) if i in chosen else m for i, m in enumerate(container)]
    setattr(variant, attr, nn.Sequential(*wrapped) if isinstance(container, nn.Sequential) else nn.ModuleList(wrapped))
    return variant


# Megatron's selective recomputation recomputes the attention core (QK^T, softmax, dropout,
# AV) and keeps everything else, the core's inputs q, k, v and its output included. On CPU
# with dropout, SDPA runs its math path (bmm, _safe_softmax, native_dropout on (b, h, s, s));
# on CUDA it is one fused op. Copies (clone) stay saved: they are q, k, v and the merged output.
FUSED_ATTENTION_OPS = frozenset(
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(aten, name)
)
ATTENTION_MATH_OPS = frozenset({
    aten.bmm.default, aten._safe_softmax.default, aten._softmax.default, aten.native_dropout.default,
    aten.mul.Scalar, aten.mul.Tensor, aten.div.Tensor, aten.div.Scalar, aten.where.self, aten.add.Tensor,
})


def attention_core_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Recompute the attention core (fused SDPA, or its math ops on 4-D per-head tensors); save the rest."""
    if op in FUSED_ATTENTION_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op in ATTENTION_MATH_OPS and any(isinstance(a, torch.Tensor) and a.dim() == 4 for a in args):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def selective_context_fn() -> Any:
    return create_selective_checkpoint_contexts(attention_core_policy)


# ---- backends -------------------------------------------------------------------------------


class CountingInductor:
    """Inductor, with optional ``torch._functorch.config`` patches applied around the compile,
    counting the graphs it compiled. A fresh object per method keeps Dynamo's cache entries apart."""

    def __init__(self, functorch_patches: Optional[dict[str, Any]] = None) -> None:
        self.functorch_patches = dict(functorch_patches or {})
        self.graphs_compiled = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._dynamo import lookup_backend
        from torch._functorch import config as functorch_config

        self.graphs_compiled += 1
        with functorch_config.patch(**self.functorch_patches):
            return lookup_backend("inductor")(gm, example_inputs)


# ---- one step -------------------------------------------------------------------------------

_LOSS_WEIGHTS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def loss_weights(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Fixed pseudo-random weights for the output (own generator: the global RNG is untouched)."""
    key = (tuple(shape), str(device))
    if key not in _LOSS_WEIGHTS:
        generator = torch.Generator().manual_seed(LOSS_SEED)
        _LOSS_WEIGHTS[key] = torch.randn(tuple(shape), generator=generator).to(device)
    return _LOSS_WEIGHTS[key]


def forward_loss(compiled: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out = compiled(*inputs).float()
    return torch.dot(out.reshape(-1), loss_weights(out.shape, out.device).reshape(-1))


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every gradient, on the model's device (comparing there is fast on a GPU)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def global_relative_grad_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """``||a - e|| / ||e||`` over every parameter's gradient at once (infinite if the parameters differ): unlike
    the per-parameter maximum it is not ruled by a gradient that is zero up to rounding (an attention key's bias,
    whose exact gradient is 0: in bfloat16 its relative error was 98 on one corpus net)."""
    if actual.keys() != expected.keys() or not expected:
        return float("inf")
    diff = sum((actual[k].double() - expected[k].double()).pow(2).sum().item() for k in expected)
    norm = sum(expected[k].double().pow(2).sum().item() for k in expected)
    return (diff / max(norm, 1e-60)) ** 0.5


def max_relative_grad_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest per-parameter ||a - e|| / ||e|| and its parameter. A parameter whose reference
    norm is under 1e-6 of the largest is measured against that floor (numerically zero, e.g. a
    conv bias right before BatchNorm); a parameter missing on either side counts as infinite."""
    if actual.keys() != expected.keys() or not expected:
        missing = sorted(actual.keys() ^ expected.keys())
        return float("inf"), f"parameters with a gradient differ: {missing[:4]}"
    floor = 1e-6 * max(t.double().norm().item() for t in expected.values())
    worst, name = 0.0, ""
    for key, ref in expected.items():
        diff = (actual[key].double() - ref.double()).norm().item()
        err = diff / max(ref.double().norm().item(), floor, 1e-30)
        if not err <= worst:  # NaN counts as worst
            worst, name = err, key
    return worst, name


# ---- the measurements ------------------------------------------------------------------------


@dataclass
class Point:
    """One method at one setting, and everything measured about it."""

    method: str                      # inductor | ac-budget | checkpoint | checkpoint-every-k | selective | remat
    label: str
    settings: dict[str, Any] = field(default_factory=dict)
    planned_for: list[str] = field(default_factory=list)     # remat: the roles this budget serves
    error: Optional[str] = None
    compile_s: float = math.nan
    graphs_compiled: int = 0
    graph_ids: list[str] = field(default_factory=list)      # remat: the graphs its plans belong to
    grad_max_rel_err: float = math.nan
    grad_worst_param: str = ""
    grad_ok: Optional[bool] = None
    peak_bytes: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    budget_bytes: Optional[int] = None
    predicted_peak_bytes: Optional[int] = None
    simulated_no_remat_peak_bytes: Optional[int] = None     # remat: the plan's peak if every needed value were saved
    est_extra_time_s: Optional[float] = None
    min_feasible_bytes: Optional[int] = None
    min_budget_bytes: Optional[int] = None               # remat refused: the smallest budget its error names
    monitor_warnings: list[str] = field(default_factory=list)

    @property
    def has_peak(self) -> bool:
        return self.error is None and bool(self.peak_bytes)

    @property
    def measured(self) -> bool:
        """Compiled, and both its peak and its times were measured."""
        return self.has_peak and bool(self.step_s)

    @property
    def peak(self) -> int:
        return max(self.peak_bytes)

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else math.nan

    def spread(self) -> float:
        """Interquartile range of the step time over its median."""
        if len(self.step_s) < 4:
            return math.nan
        q1, _, q3 = statistics.quantiles(self.step_s, n=4)
        return (q3 - q1) / self.median("step_s")


@dataclass
class _Live:
    point: Point
    forward: Callable[[], torch.Tensor]
    monitor: StepMonitor


def _record_refusal(point: "Point", error: "remat.BudgetInfeasibleError", what: str) -> "Point":
    """``point`` marked as refused by ``error`` (``what`` starts its error text: "infeasible..."), with the
    budgets the error names."""
    point.error = f"{what}: {error}"
    point.min_feasible_bytes = error.min_feasible_bytes
    point.min_budget_bytes = getattr(error, "min_budget_bytes", None)
    return point


class Sweep:
    """Compiles methods over one model instance and measures them interleaved."""

    def __init__(self, spec: ModelSpec, device: torch.device, *, deadline: float = math.inf,
                 measure_deadline: float = math.inf) -> None:
        torch._dynamo.reset()
        self.spec, self.device = spec, device
        self.deadline = deadline                  # time.monotonic() after which no compile starts
        self.measure_deadline = measure_deadline  # after which no further measurement round starts
        self.load_average_1min: list[float] = []  # os.getloadavg()[0] at the start of every measurement round
        self.rounds_cut: list[str] = []           # measurement phases the deadline shortened
        model, inputs = spec.build()
        self.model = model.to(device).train()
        self.inputs = tuple(t.to(device) for t in inputs)
        self.live: list[_Live] = []
        self.points: list[Point] = []
        self.reference: Optional[dict[str, torch.Tensor]] = None

    def forward_of(self, compiled: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: forward_loss(compiled, self.inputs)

    def _prepare(self) -> None:
        """Outside the measured window: no gradients resident, the same dropout draws every step."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(STEP_SEED)

    def one_step(self, forward: Callable[[], torch.Tensor]) -> None:
        self._prepare()
        forward().backward()

    def add(self, point: Point, module: torch.nn.Module, backend: Any, patches: Optional[dict[str, Any]] = None) -> Point:
        """Compile ``module`` with ``backend``, run the compiling step, then a step whose gradients are checked."""
        from torch._functorch import config as functorch_config

        self.points.append(point)
        if time.monotonic() > self.deadline:
            point.error = "skipped: the run's time limit (--max-minutes) was reached before this compile"
            return point
        compiled = torch.compile(module, backend=backend)
        forward = self.forward_of(compiled)
        start = time.perf_counter()
        try:
            with functorch_config.patch(**(patches or {})):
                self.one_step(forward)
        except remat.BudgetInfeasibleError as error:
            return _record_refusal(point, error, "infeasible")
        except Exception as error:  # noqa: BLE001 - a method that fails is reported, not dropped
            point.error = f"failed: {type(error).__name__}: {str(error).strip()[:400]}"
            self._release_memory()
            return point
        point.compile_s = time.perf_counter() - start
        try:
            return self._check_compiled(point, forward, backend)
        except remat.BudgetInfeasibleError as error:
            # a step split at graph breaks refuses its budget at its second step, once its graphs are known
            self._release_memory()
            return _record_refusal(point, error, "infeasible (refused at the second step)")
        except Exception as error:  # noqa: BLE001 - e.g. out of memory in the gradient-check step
            point.error = f"failed after compiling: {type(error).__name__}: {str(error).strip()[:400]}"
            self._release_memory()
            return point

    def _check_compiled(self, point: Point, forward: Callable[[], torch.Tensor], backend: Any) -> Point:
        """Record what was compiled (remat: the plans' predictions), check the gradients, keep the method live."""
        if isinstance(backend, remat.RematBackend):
            graphs = backend.compiled_graphs
            point.graphs_compiled = len(graphs)
            point.graph_ids = [g.graph_id for g in graphs]
            plans = [g.plan for g in graphs]
            if not plans:
                point.error = "remat compiled no graph for this method (Dynamo reused another method's code)"
                return point
            point.budget_bytes = plans[0].budget_bytes
            point.predicted_peak_bytes = max(p.predicted_peak_bytes for p in plans)
            point.simulated_no_remat_peak_bytes = max(p.no_remat_peak_bytes for p in plans)
            point.est_extra_time_s = sum(p.est_extra_time_s for p in plans)
        else:
            point.graphs_compiled = backend.graphs_compiled
        if point.graphs_compiled == 0:
            point.error = "no graph was compiled for this method (Dynamo reused another method's code)"
            return point
        self.one_step(forward)
        grads = grads_of(self.model)
        if self.reference is None:
            self.reference = grads
        point.grad_max_rel_err, point.grad_worst_param = max_relative_grad_error(grads, self.reference)
        point.grad_ok = point.grad_max_rel_err < self.spec.grad_rel_tol
        monitor = StepMonitor(backend if isinstance(backend, remat.RematBackend) else None, self.device)
        self.live.append(_Live(point, forward, monitor))
        return point

    def _rounds(self, items: list[_Live], count: int, run: Callable[[_Live], None], phase: str) -> None:
        """``count`` rounds over ``items`` (A B C, B C A, ...): every method once per round.

        A method whose step raises (e.g. out of memory) gets the error recorded on its point and
        leaves the sweep; the others go on. No round starts after ``measure_deadline``.
        """
        for r in range(count):
            if time.monotonic() > self.measure_deadline:
                self.rounds_cut.append(f"{phase}: {r} of {count} rounds (time limit)")
                return
            self.load_average_1min.append(os.getloadavg()[0])
            shift = r % max(len(items), 1)
            for item in items[shift:] + items[:shift]:
                if item not in self.live:
                    continue
                try:
                    run(item)
                except Exception as error:  # noqa: BLE001 - a method that fails is reported, not fatal
                    item.point.error = f"failed while measuring ({phase}): {type(error).__name__}: {str(error).strip()[:400]}"
                    self.live.remove(item)
                    self._release_memory()

    def _release_memory(self) -> None:
        self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def measure_peaks(self, rounds: int, items: Optional[list[_Live]] = None) -> None:
        def one(item: _Live) -> None:
            self._prepare()
            item.monitor.step(item.forward, measure_peak=True)
            item.point.peak_bytes.append(item.monitor.last.peak_bytes)

        self._rounds(list(self.live if items is None else items), rounds, one, "peak")

    def measure_times(self, reps: int, warmup: int = 1) -> None:
        def warm(item: _Live) -> None:
            self._prepare()
            timed_step(item.forward, lambda loss: loss.backward(), self.device)

        def one(item: _Live) -> None:
            self._prepare()
            item.monitor.step(item.forward, measure_peak=False)
            last = item.monitor.last
            item.point.forward_s.append(last.forward_s)
            item.point.backward_s.append(last.backward_s)
            item.point.step_s.append(last.step_s)

        self._rounds(list(self.live), warmup, warm, "warm-up")
        self._rounds(list(self.live), reps, one, "timing")


def source_info() -> dict[str, Any]:
    """The commit measured, and the files under remat/ that differed from it (others edit them concurrently).
    ``$REMAT_SOURCE_COMMIT``, when set to another commit than git's HEAD, is taken as the commit measured
    (a ``git archive`` snapshot, or files copied over an older checkout)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "HEAD").strip()
    given = os.environ.get("REMAT_SOURCE_COMMIT")
    if given and given != head:
        # A `git archive` snapshot, or a working tree copied over an older checkout's .git: git cannot
        # tell which files differ from the stated commit, so none are listed (and the tables say so).
        return {"commit": given, "commit_from": "$REMAT_SOURCE_COMMIT", "git_head": head or None,
                "remat_files_modified_from_commit": []}
    if not head:
        return {"commit": "unknown", "commit_from": "no git checkout and no $REMAT_SOURCE_COMMIT",
                "remat_files_modified_from_commit": []}
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "remat").splitlines()]
    return {"commit": head, "remat_files_modified_from_commit": dirty}


def machine_info(device: torch.device) -> dict[str, Any]:
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return info
