"""Compile time, remat next to plain Inductor, cold (empty caches) and warm (caches as a cold run left them).

Each measurement is a fresh process (``--child``) that builds the model, compiles it with
``torch.compile`` and runs one training step (forward, ``loss.backward()``); the time is that first
step's, from its call to the end of the backward: Dynamo, AOTAutograd, remat's planning (and, for
remat, the measured first step of its feedback loop), Inductor's code generation and C++ builds. The
Python and torch import are outside it and the same for both.

Cold: a process whose caches are new, empty temporary directories: Inductor's (``TORCHINDUCTOR_CACHE_DIR``,
which holds its FX graph and AOTAutograd caches and the C++ builds) and remat's (``REMAT_CACHE_DIR``: the
compile cache, the feedback store and the CPU profile, so remat starts with no measured profile, as on
a new machine). Warm: a second process on the same directories. Plain Inductor and remat each get their
own directories, and the four runs of a model are interleaved (Inductor cold, remat cold, Inductor warm,
remat warm; the order of the two backends alternates between repetitions) so that the other jobs on a
shared machine weigh on both alike; each row records the load average at its start.

    PYTHONPATH=$PWD python benchmarks/compile_time.py --reps 1   # writes benchmarks/results/compile_time-cpu.md (.json)
    PYTHONPATH=$PWD python benchmarks/compile_time.py --models gpt --append   # one more repetition, added
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compile_time-cpu.md"

# model -> (description, remat budget in GB: 50-60% of the no-remat simulated peak, so that remat recomputes)
MODELS: dict[str, tuple[str, Optional[float]]] = {
    "gpt": ("zoo GPT (remat/testing/zoo.py: 4 layers, d=128, seq 128, batch 8, dropout 0.1), the README's example", 0.03),
    "gpt8": ("zoo GPT, 8 layers (otherwise the same)", 0.06),
    "hf-gpt2-eager": ("Hugging Face GPT2LMHeadModel from a config (remat/testing/hf_models.py), 3 layers", 0.02),
}


def _model(name: str):
    """The model and a function running one training step of the compiled model."""
    import torch
    import torch.nn.functional as F

    from remat.testing.zoo import GPTConfig, make_gpt

    if name in ("gpt", "gpt8"):
        cfg = GPTConfig(n_layers=8) if name == "gpt8" else GPTConfig()
        model, _ = make_gpt(cfg, batch=8)
        tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

        def loss_fn() -> Any:
            return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        return model, loss_fn
    from remat.testing.hf_models import build_hf, hf_specs

    spec = next(s for s in hf_specs() if s.name == name)
    model, kwargs = build_hf(spec, seed=0)
    return model, lambda: model(**kwargs).loss


def child(model_name: str, backend_name: str, dump_dir: str) -> dict[str, Any]:
    """One process's measurement: the first step's seconds, the second step's (where remat's graph-break
    graphs are re-planned once the step's graphs are known, and its feedback loop re-plans a graph
    measured over budget), and what remat recorded."""
    import torch

    import remat

    torch.manual_seed(0)
    load = os.getloadavg()[0]
    model, loss_fn = _model(model_name)
    backend: Any = "inductor"
    if backend_name == "remat":
        backend = remat.backend(MODELS[model_name][1], dump_dir=dump_dir)
    step = torch.compile(loss_fn, backend=backend)
    start = time.perf_counter()
    step().backward()
    seconds = time.perf_counter() - start
    # a training step's gradients are new each step (an optimizer step would follow): without this, the second
    # step's backward adds to the first's, which remat takes for gradient accumulation (since session 35) and
    # re-plans for (session 37: the zoo GPT's warm process then planned next to them and missed AOTAutograd's cache)
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step().backward()
    out: dict[str, Any] = {"seconds": seconds, "second_step_seconds": time.perf_counter() - start, "load": load}
    if backend_name == "remat":
        graphs = backend.compiled_graphs
        out["graphs"] = len(graphs)
        out["cache"] = [g.cache.split(":")[0] or "solved" for g in graphs]
        out["dump_complete"] = all(g.dump_path and all((Path(g.dump_path) / f).is_file() for f in
                                                       ("forward.py", "backward.py", "plan.json", "report.md"))
                                   for g in graphs) and bool(graphs)
        out["predicted_peak_mb"] = [round(g.plan.predicted_peak_bytes / 1e6, 2) for g in graphs]
        out["budget_gb"] = MODELS[model_name][1]
    return out


def _run_child(model: str, backend: str, caches: Path) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), REMAT_CACHE_DIR=str(caches / "remat"),
               PYTHONPATH=str(ROOT))
    env.pop("REMAT_FEEDBACK_DIR", None)     # the feedback store under REMAT_CACHE_DIR: empty when cold
    env.pop("REMAT_COMPILE_CACHE", None)
    done = subprocess.run([sys.executable, __file__, "--child", model, backend, str(caches / "dump")],
                          capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model}/{backend} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--reps", type=int, default=1, help="interleaved repetitions per model (default 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--append", action="store_true",
                        help="add to the runs recorded in the .json next to --out (repetitions continue its numbering)")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "BACKEND", "DUMP_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return 0
    record = args.out.with_suffix(".json")
    previous = json.loads(record.read_text()) if args.append and record.exists() else {"rows": [], "loads": []}
    rows: list[tuple[str, int, str, str, dict[str, Any]]] = [tuple(r) for r in previous["rows"]]  # type: ignore[misc]
    before = _uptime()
    for model in args.models:
        done = sum(1 for r in rows if r[0] == model and r[2] == "cold" and r[3] == "remat")
        for rep in range(done, done + args.reps):
            with tempfile.TemporaryDirectory(prefix="remat_compile_time_") as tmp:
                order = ("inductor", "remat") if rep % 2 == 0 else ("remat", "inductor")
                for state in ("cold", "warm"):
                    for backend in order:
                        result = _run_child(model, backend, Path(tmp) / backend)
                        rows.append((model, rep, state, backend, result))
                        print(model, rep, state, backend, json.dumps(result), flush=True)
    after = _uptime()
    loads = previous["loads"] + [[before, after]]
    record.parent.mkdir(parents=True, exist_ok=True)     # a new --out folder (session 42 lost a run's table to it)
    record.write_text(json.dumps({"rows": rows, "loads": loads}, indent=1) + "\n")
    args.out.write_text(render(rows, loads, args.reps))
    print(f"wrote {args.out}")
    return 0


def render(rows: list[tuple[str, int, str, str, dict[str, Any]]], loads: list[list[str]], reps: int) -> str:
    import torch

    lines = [
        "# Compile time: remat vs plain Inductor (CPU)",
        "",
        f"`PYTHONPATH=$PWD python benchmarks/compile_time.py --reps {reps}` (later runs with `--append`), "
        f"torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores shared with other jobs.",
        "",
        *[f"- run {i + 1}: load before `{before}`; after `{after}`" for i, (before, after) in enumerate(loads)],
        "",
        "Seconds of the first training step (compile included), each in a fresh process. Cold: empty "
        "`TORCHINDUCTOR_CACHE_DIR` and `REMAT_CACHE_DIR` (new temporary directories: no Inductor/AOTAutograd "
        "cache, no remat plan cache, no feedback store, no measured CPU profile, so remat plans with the "
        "x86-64 default profile). Warm: a second process on the directories the cold one filled. Runs of a "
        "model are interleaved; `load` is the 1-minute load average when the run started. `step 2 s`: the "
        "second step in the same process (remat re-plans graph-break graphs once the step's graphs are known, "
        "and the feedback loop re-plans a graph measured over its budget, both before or in that step).",
        "",
        "| model | rep | state | inductor s | remat s | remat / inductor | step 2 s (ind., remat) | load (ind., remat) "
        "| remat's record |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[tuple[str, str], list[float]] = {}
    keyed = {(m, r, s, b): res for m, r, s, b, res in rows}
    for (model, rep, state, backend), remat_result in sorted(keyed.items()):
        if backend != "remat":
            continue
        ind = keyed[(model, rep, state, "inductor")]
        ratio = remat_result["seconds"] / ind["seconds"]
        ratios.setdefault((model, state), []).append(ratio)
        record = (f"{remat_result['graphs']} graph(s), {', '.join(remat_result['cache'])}, "
                  f"dump {'complete' if remat_result['dump_complete'] else 'INCOMPLETE'}, "
                  f"predicted {remat_result['predicted_peak_mb']} MB at {remat_result['budget_gb']} GB")
        second = ", ".join(f"{r['second_step_seconds']:.1f}" if "second_step_seconds" in r else "-"
                           for r in (ind, remat_result))
        lines.append(f"| {model} | {rep} | {state} | {ind['seconds']:.1f} | {remat_result['seconds']:.1f} | "
                     f"{ratio:.2f} | {second} | {ind['load']:.1f}, {remat_result['load']:.1f} | {record} |")
    lines += ["", "Median ratio (remat / inductor) per model and state:", ""]
    for (model, state), values in sorted(ratios.items()):
        lines.append(f"- {model} {state}: {statistics.median(values):.2f} (of {len(values)})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
