"""What remat's fusion choices cost and save: each model under remat's choices and under Inductor's own.

remat's compiles refuse a vertical fusion of two kernels far apart whose reader also needs later work
(``remat/_torch_inductor.py: fusion_choices``). This runs, side by side in one process, for each model:
plain Inductor, then remat under its choices and remat under Inductor's own rules (a user-set
``inductor_choices_class``, which remat leaves alone and its simulator follows), each at no budget and
at the floor remat names for it (the budget a 1-byte budget's refusal names, then compiled and run).
For every run: the measured peak of a step (``remat.measure_peak_bytes``, docs/design.md's method) and
the median time of ``--steps`` steps after three warm-up steps, with the machine's load average.

    PYTHONHASHSEED=0 python benchmarks/fusion_choices.py --models zoo-gpt zoo-llama hf-1491 \\
        --out benchmarks/results/fusion_choices-cpu.md

Model names: ``zoo-<name>`` (``remat.testing.zoo``), or corpus names (``rand-<seed>``, ``cnn-<seed>``,
``hf-<seed>``; the Hugging Face ones need ``transformers``). Bytes: 1 MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

import remat
from remat.measure import close_open_window
from remat.testing import corpus, hf_models
from remat.testing.steps import run_step
from remat.testing.zoo import ZOO


def _inductor_rules() -> type:
    """A choices class that is Inductor's own: set by the user, remat's compiles leave it in place."""
    from torch._inductor.choices import InductorChoices

    class InductorsOwn(InductorChoices):
        @classmethod
        def uuid(cls) -> str:
            return "inductors-own-choices"

    return InductorsOwn


def _builder(name: str) -> Callable[[], tuple[torch.nn.Module, Callable[[Callable[..., Any]], None]]]:
    """``build()`` -> (a fresh model, ``step(compiled)`` running one forward and backward of it)."""
    if name.startswith("zoo-"):
        def build_zoo() -> tuple[torch.nn.Module, Callable[[Callable[..., Any]], None]]:
            model, inputs = ZOO[name[4:]]()
            return model, lambda compiled: run_step(compiled, model, inputs) and None
        return build_zoo
    kind, seed = name.split("-", 1)
    entry = {"rand": lambda s: corpus.random_entry(s), "cnn": lambda s: corpus.cnn_entry(corpus.cnns.cnn_shape(s), s),
             "hf": lambda s: corpus.hf_entry(hf_models.hf_spec(s), s)}[kind](int(seed))

    def build_entry() -> tuple[torch.nn.Module, Callable[[Callable[..., Any]], None]]:
        built = entry.make(False)

        def step(compiled: Callable[..., Any]) -> None:
            built.model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            built.loss(compiled).backward()
        return built.model, step
    return build_entry


def _measure(build: Callable[..., Any], backend: Any, steps: int) -> dict[str, Any]:
    """Peak (bytes) and median step time (s) of a fresh model compiled with ``backend``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, step = build()
    compiled = torch.compile(model, backend=backend)
    for _ in range(3):
        step(compiled)
        close_open_window()
    peak = remat.measure_peak_bytes(lambda: step(compiled)).peak_bytes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(compiled)
        times.append(time.perf_counter() - start)
    return {"peak": peak, "median_s": statistics.median(times)}


def _floor(build: Callable[..., Any]) -> int:
    """The budget (bytes) a 1-byte budget's refusal names."""
    torch._dynamo.reset()
    model, step = build()
    try:
        step(torch.compile(model, backend=remat.backend(1e-9)))
    except remat.BudgetInfeasibleError as refused:
        return refused.min_budget_bytes
    raise AssertionError("a 1-byte budget was accepted")


def _model_rows(name: str, steps: int) -> list[str]:
    build = _builder(name)
    plain = _measure(build, "inductor", steps)
    rows = [f"| {name} | plain Inductor | | {plain['peak'] / 1e6:.3f} | {plain['median_s'] * 1e3:.1f} | | |"]
    for regime in ("remat's", "Inductor's own"):
        patch = {} if regime == "remat's" else {"inductor_choices_class": _inductor_rules()}
        with torch._inductor.config.patch(patch):
            free = _measure(build, remat.backend(None), steps)
            floor = _floor(build)
            at_floor = _measure(build, remat.backend(floor / 1e9), steps)
        rows.append(f"| {name} | remat, {regime} fusion rules | {floor / 1e6:.3f} | {free['peak'] / 1e6:.3f} | "
                    f"{free['median_s'] * 1e3:.1f} | {at_floor['peak'] / 1e6:.3f} | {at_floor['median_s'] * 1e3:.1f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["zoo-gpt", "zoo-llama", "zoo-cnn"])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows: list[str] = []
    for name in args.models:
        rows += _model_rows(name, args.steps)
    load_after = os.getloadavg()
    commit = os.environ.get("REMAT_SOURCE_COMMIT", "unknown")
    args.out.write_text("\n".join([
        "# remat's fusion choices against Inductor's own (CPU)", "",
        f"Command: `PYTHONHASHSEED=0 python benchmarks/fusion_choices.py --models {' '.join(args.models)} "
        f"--steps {args.steps} --out {args.out}`. Commit {commit}. torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; load average (1 min) {load_before[0]:.2f} "
        f"before, {load_after[0]:.2f} after.", "",
        "Peaks are measured (one step, docs/design.md); times are the median of the steps after three warm-up steps. "
        "The floor is the budget a 1-byte budget's refusal names; `at floor` runs that budget. 1 MB = 1e6 bytes.", "",
        "| model | run | floor named MB | no budget: peak MB | no budget: step ms | at floor: peak MB | at floor: step ms |",
        "|---|---|---:|---:|---:|---:|---:|", *rows, ""]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
