"""Dynamic shapes under a budget, on models remat was not written against: one compile, every size under it.

    python benchmarks/dynamic_budget.py                          # every case -> results/dynamic_budget-cpu.md
    python benchmarks/dynamic_budget.py --only hf-gpt2-eager --fraction 0.7

Each case marks one dim dynamic with a declared max (``torch._dynamo.mark_dynamic(t, dim, min=2,
max=MAX)`` on every input that has it), compiles plain Inductor that way and measures its peak at the
max size; then compiles remat at ``--fraction`` of that peak (if remat refuses it, at the budget its
``BudgetInfeasibleError`` names) and runs three sizes up to the max. Per size: remat's measured peak
(``remat.measure_peak_bytes``, gradients set to None first), plain Inductor's, and the largest relative
gradient error against plain Inductor's (both under ``fallback_random=True``, the same seed). Also
the frames remat compiled, how many times it compiled one of them again (its CompileIds less its
frames; ``frame_compile_id`` alone counts plain Inductor's compile of the same code too), and the
plans remat made. Units: bytes in the JSON, MB (1e6 bytes) in the table.

No CNN: plain Inductor itself specialises a BatchNorm CNN's batch dim (``remat.testing.cnns`` "vgg",
batch marked dynamic up to 8: ``ConstraintViolationError``, guard ``5 <= L['x'].size()[0]``).
Run with an empty ``REMAT_FEEDBACK_DIR`` so no correction stored by an earlier run changes a plan.

``VERIFY_PEAK=0`` turns off remat's closed loop on the measured peak (``remat.backend(verify_peak=)``);
with it on, hf-gpt2-eager crashed (SIGSEGV in ``gc.collect()`` inside ``measure._cpu_peak``, the
first measured step after the compiling one) on torch 2.13.0 CPU, so the recorded run uses 0.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import remat
from remat.testing import hf_models, random_nets

RESULTS = Path(__file__).resolve().parent / "results"
STEP_SEED = 1234
VERIFY_PEAK = int(__import__("os").environ.get("VERIFY_PEAK", "1"))   # the closed loop on the measured peak (issue 11)


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    build: Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]   # the model and its inputs at the max size
    dim: int                   # the dynamic dim of every input that has one
    sizes: tuple[int, ...]     # run in this order; the first is the traced size, the last the declared max


def _hf(name: str) -> Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]:
    spec = next(s for s in hf_models.hf_specs() if s.name == name)
    return lambda: hf_models.build_hf(spec, seed=0)


def _random_net(seed: int) -> Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]:
    def build() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        model, inputs = random_nets.build_net(random_nets.net_spec(seed), False)
        return model, {f"arg{i}": t for i, t in enumerate(inputs)}
    return build


CASES = [
    Case("hf-gpt2-eager", "GPT2LMHeadModel 3 layers d=128, dropout 0.1, batch 4; sequence dynamic, max 128",
         _hf("hf-gpt2-eager"), 1, (48, 96, 128)),
    Case("hf-llama-sdpa", "LlamaForCausalLM 2 layers d=128, GQA, SDPA, batch 4; sequence dynamic, max 128",
         _hf("hf-llama-sdpa"), 1, (48, 96, 128)),
    Case("rand-1003", f"random net: {random_nets.net_spec(1003).describe()}; sequence dynamic, max 128",
         _random_net(1003), 1, ()),
]


def _inputs_at(full: dict[str, torch.Tensor], dim: int, size: int, max_size: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, t in full.items():
        if t.dim() > dim and t.shape[dim] == max_size:
            t = t.narrow(dim, 0, size).clone()
            torch._dynamo.mark_dynamic(t, dim, min=2, max=max_size)
        out[key] = t
    return out


def _loss(module: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    args = [v for k, v in inputs.items() if k.startswith("arg")]
    kwargs = {k: v for k, v in inputs.items() if not k.startswith("arg")}
    out = module(*args, **kwargs)
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    out = out.float()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4321))
    return torch.dot(out.reshape(-1), weights.reshape(-1))


def _step(module: Callable[..., Any], model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(STEP_SEED)
    _loss(module, inputs).backward()


def _peak(module: Callable[..., Any], model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    model.zero_grad(set_to_none=True)
    return remat.measure_peak_bytes(lambda: _step(module, model, inputs), "cpu").peak_bytes


def _max_rel_error(model: nn.Module, reference: nn.Module) -> float:
    errors = [((p.grad - r.grad).norm() / r.grad.norm().clamp_min(1e-12)).item()
              for p, r in zip(model.parameters(), reference.parameters()) if r.grad is not None]
    return max(errors)


def run_case(case: Case, fraction: float) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, full = case.build()
    max_size = max(t.shape[case.dim] for t in full.values() if t.dim() > case.dim)
    sizes = case.sizes or (max(2, max_size // 4), max(2, max_size // 2), max_size)
    reference = copy.deepcopy(model)
    compile_ids: set[tuple[int, int]] = set()   # remat's compiles, as (frame_id, frame_compile_id)

    def counted(backend: Callable[..., Any]) -> Callable[..., Any]:
        def inner(gm: Any, example_inputs: Any) -> Any:
            from torch._guards import CompileContext

            compile_id = CompileContext.current_compile_id()
            compile_ids.add((compile_id.frame_id, compile_id.frame_compile_id))
            return backend(gm, example_inputs)
        return inner

    with torch._inductor.config.patch(fallback_random=True):
        plain = torch.compile(reference, backend="inductor")
        _step(plain, reference, _inputs_at(full, case.dim, max_size, max_size))
        plain_peak = _peak(plain, reference, _inputs_at(full, case.dim, max_size, max_size))
        budget_gb, named = fraction * plain_peak / 1e9, False
        for _ in range(2):
            backend = remat.backend(budget_gb, verify_peak=VERIFY_PEAK)
            compiled = torch.compile(model, backend=counted(backend))
            try:
                _step(compiled, model, _inputs_at(full, case.dim, sizes[0], max_size))
                break
            except remat.BudgetInfeasibleError as error:
                budget_gb, named = error.min_budget_gb, True
                torch._dynamo.reset()
                compile_ids.clear()
        rows = []
        for size in sizes:
            inputs = _inputs_at(full, case.dim, size, max_size)
            _step(compiled, model, inputs)
            _step(plain, reference, inputs)
            error = _max_rel_error(model, reference)
            rows.append({"size": size, "remat_peak_bytes": _peak(compiled, model, inputs),
                         "plain_peak_bytes": _peak(plain, reference, inputs), "max_rel_grad_error": error})
    plans = [g.plan for g in backend.compiled_graphs]
    return {"case": case.name, "description": case.description, "fraction": fraction, "named_budget": named,
            "budget_bytes": round(budget_gb * 1e9), "plain_peak_at_max_bytes": plain_peak, "frames": len({f for f, _ in compile_ids}),
            "recompiles": len(compile_ids) - len({f for f, _ in compile_ids}), "compile_ids": sorted(compile_ids),
            "plans": len(plans), "predicted_peak_bytes": [p.predicted_peak_bytes for p in plans], "sizes": rows}


def render(results: list[dict[str, Any]]) -> str:
    lines = ["# Dynamic shapes under a budget (CPU)", "",
             "`python benchmarks/dynamic_budget.py`: one dim marked dynamic with a declared max; remat at a fraction of "
             "plain Inductor's measured peak at the max (or the budget remat names when it refuses that). MB = 1e6 bytes.",
             "", "| case | budget MB | frames / recompiles / plans | size | remat MB | plain MB | remat / budget | max grad rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        budget = r["budget_bytes"]
        label = f"{r['budget_bytes'] / 1e6:.3f}" + (" (named)" if r["named_budget"] else f" ({r['fraction']:.0%})")
        for i, s in enumerate(r["sizes"]):
            head = (r["case"], label, f"{r['frames']} / {r['recompiles']} / {r['plans']}") if i == 0 else ("", "", "")
            lines.append(f"| {' | '.join(head)} | {s['size']} | {s['remat_peak_bytes'] / 1e6:.3f} | "
                         f"{s['plain_peak_bytes'] / 1e6:.3f} | {s['remat_peak_bytes'] / budget:.3f} | "
                         f"{s['max_rel_grad_error']:.1e} |")
    lines += ["", *[f"- {r['case']}: {r['description']}" for r in results]]
    return "\n".join(lines) + "\n"



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names")
    parser.add_argument("--fraction", type=float, default=0.7)
    parser.add_argument("--out", type=Path, default=RESULTS / "dynamic_budget-cpu")
    args = parser.parse_args()
    results = []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        result = run_case(case, args.fraction)
        print(json.dumps(result), flush=True)
        results.append(result)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
