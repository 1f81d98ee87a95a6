"""Where remat stands under DDP and FSDP2: the smallest per-rank budget, measured on each rank.

    python benchmarks/distributed_budget.py                       # both modes, 60% of plain Inductor's peak
    python benchmarks/distributed_budget.py --modes fsdp2 --fractions 0.6 0.7 --headroom 0.05 --timeline

Two gloo ranks on 127.0.0.1 (this script started again with ``--worker``), the zoo GPT as in
``tests/test_distributed.py`` (4 layers, no dropout, batch 4 per rank, DDP with 1 MiB
buckets, FSDP2 ``fully_shard`` on each block and the model). Per rank: plain Inductor's
peak on the third step (docs/design.md's CPU method), then remat at each fraction of the larger
rank's plain peak. A budget the planner refuses is retried at the smallest budget it names
(``--attempts`` times), so a row reads "60% requested; smallest feasible x% named; measured
y%". Per graph: its share of the budget (remat/distributed.py), predicted peak and what it
holds for its backward. With ``--timeline``: what was live at the measured peak, grouped
by the innermost profiler scope that allocated it (FSDP2's all-gathers, the compiled
graphs, autograd's accumulation), to see what the ledger leaves out.

Results: ``benchmarks/results/distributed_budget-cpu.{json,md}`` (``--out`` to change), with
the machine's load. 1 MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

import remat
from remat.testing.distributed_setup import CFG, STEPS, WORLD_SIZE, all_max, batches, run_ranks, worker_parser, wrap
from remat.testing.zoo import GPT

ROOT = Path(__file__).resolve().parents[1]

RUN_TIMEOUT_S = 900


# ---------------------------------------------------------------- what was live at the peak

_SCOPES = ("FSDP::", "## Call CompiledFxGraph", "CompiledFunction", "torch::autograd::AccumulateGrad",
           "DistributedDataParallel", "autograd::engine")


def _scope_of(event: Any) -> str:
    """The innermost ancestor scope of an allocation event worth naming (else its op)."""
    node, first = event.parent, None
    while node is not None:
        name = node.name
        if first is None:
            first = name
        if name.startswith(_SCOPES):
            return name if not name.startswith("## Call CompiledFxGraph") else "Inductor graph " + name.split()[3][:10]
        node = node.parent
    return first or "?"


def live_at_peak(prof: Any) -> dict[str, Any]:
    """The window peak (as remat.measure_peak_bytes computes it) and, at that instant, the
    live in-window bytes grouped by the scope that allocated them, plus a coarse timeline:
    the running live bytes at each change of scope."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr, _scope_of(event)))
    events.sort(key=lambda e: e[0])
    live, peak, mine, at_peak = 0, 0, {}, {}
    timeline: list[tuple[str, int]] = []
    for _, size, address, scope in events:
        if size > 0:
            old = mine.pop(address, None)
            live -= old[0] if old else 0
            mine[address] = (size, scope)
            live += size
            if live > peak:
                peak, at_peak = live, dict(mine)
        elif address in mine:
            live -= mine.pop(address)[0]
        if not timeline or timeline[-1][0] != scope:
            timeline.append((scope, live))
        else:
            timeline[-1] = (scope, max(timeline[-1][1], live))
    by_scope: dict[str, int] = defaultdict(int)
    for size, scope in at_peak.values():
        by_scope[scope] += size
    return {"peak_bytes": peak, "live_at_peak": dict(sorted(by_scope.items(), key=lambda kv: -kv[1])),
            "timeline": timeline}


def _measure(fn: Any, timeline: bool) -> tuple[int, Any, Optional[dict[str, Any]]]:
    if not timeline:
        measured = remat.measure_peak_bytes(fn, "cpu")
        return measured.peak_bytes, measured.result, None
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    finally:
        gc.enable()
    detail = live_at_peak(prof)
    return detail["peak_bytes"], result, detail


# ---------------------------------------------------------------- worker (one rank)

def _train(mode: str, backend: Any, timeline: bool) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = wrap(GPT(CFG).train(), mode)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {}
    for step, ranks in enumerate(batches()):
        tokens, targets = ranks[rank]
        optimizer.zero_grad(set_to_none=True)

        def forward_backward() -> float:
            loss = F.cross_entropy(compiled(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            return loss.item()

        if step == STEPS - 1:
            out["peak_bytes"], out["loss"], out["detail"] = _measure(forward_backward, timeline)
        else:
            forward_backward()
        optimizer.step()
    return out


def _graphs(backend: Any) -> list[dict[str, Any]]:
    rows = []
    for g in backend.compiled_graphs:
        share = g.distributed.share if g.distributed else None
        rows.append({"graph_id": g.graph_id, "predicted_peak_bytes": g.plan.predicted_peak_bytes,
                     "target_bytes": g.plan.target_bytes, "saved_bytes": g.plan.saved_bytes,
                     "no_remat_peak_bytes": g.plan.no_remat_peak_bytes, "recomputed": len(g.plan.recomputed),
                     "share": share.to_json() if share else None})
    return rows


def worker_main(argv: list[str]) -> None:
    parser = worker_parser()
    parser.add_argument("--fractions", type=float, nargs="+", required=True)
    parser.add_argument("--headroom", type=float, default=None)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--timeline", action="store_true")
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=args.rank, world_size=WORLD_SIZE)
    try:
        plain = _train(args.mode, "inductor", args.timeline)
        plain_max = all_max(plain["peak_bytes"])
        rows = []
        for fraction in args.fractions:
            requested = budget = fraction * plain_max / 1e9
            named: list[float] = []
            row: dict[str, Any] = {"fraction": fraction, "requested_gb": requested}
            for _ in range(args.attempts):
                extra = {} if args.headroom is None else {"headroom_fraction": args.headroom}
                backend = remat.backend(budget, **extra)
                try:
                    ours = _train(args.mode, backend, args.timeline)
                except remat.BudgetInfeasibleError as error:
                    named.append(all_max(error.min_budget_bytes) / 1e9)
                    budget = named[-1]
                    row["last_error"] = str(error)[:600]
                    continue
                row.update(budget_gb=budget, peak_bytes=ours["peak_bytes"], detail=ours["detail"], graphs=_graphs(backend),
                           headroom_fraction=backend.options.headroom_for("cpu"))
                break
            row["named_gb"] = named
            rows.append(row)
        result = {"rank": args.rank, "mode": args.mode, "plain_peak_bytes": plain["peak_bytes"],
                  "plain_peak_max_bytes": plain_max, "plain_detail": plain["detail"], "rows": rows}
        Path(args.out, f"{args.mode}_rank{args.rank}.json").write_text(json.dumps(result, indent=2))
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- parent

def spawn(mode: str, out: Path, worker_args: list[str]) -> list[dict[str, Any]]:
    """Both ranks of one mode; both are killed if either fails or the time is up."""
    codes = run_ranks(__file__, ["--mode", mode, "--out", str(out), *worker_args],
                      [out / f"{mode}_log_rank{r}.txt" for r in range(WORLD_SIZE)], RUN_TIMEOUT_S)
    if any(code != 0 for code in codes):
        tails = "\n".join((out / f"{mode}_log_rank{r}.txt").read_text()[-3000:] for r in range(WORLD_SIZE))
        raise SystemExit(f"{mode}: a rank failed or timed out:\n{tails}")
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.2f}"


def to_markdown(results: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    lines = ["# remat under DDP and FSDP2: per-rank budgets (CPU, gloo, 2 ranks)", "",
             f"`{meta['command']}` · commit {meta['commit']}"
             + (" with uncommitted changes to " + ", ".join(line.split()[-1] for line in meta["modified"].splitlines())
                if meta["modified"] else "")
             + f" · torch {meta['torch']} · {meta['machine']} · load before/after "
             f"{meta['load_before']} / {meta['load_after']} · {meta['wall_s']:.0f} s", "",
             f"Zoo GPT, {CFG.n_layers} layers, batch 4 per rank. Peaks are per rank, above what was resident when the step began "
             "(docs/design.md's CPU method), of the third training step. Fractions are of the larger rank's plain "
             "Inductor peak. 1 MB = 1e6 bytes.", "",
             "| mode | rank | plain Inductor MB | requested | named smallest budgets | budget run MB (fraction) | "
             "headroom | measured MB (fraction of plain) | predicted per graph MB |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for mode, ranks in results.items():
        for r in ranks:
            base = r["plain_peak_max_bytes"]
            for row in r["rows"]:
                named = ", ".join(f"{g * 1e3:.3f} ({g * 1e9 / base:.0%})" for g in row["named_gb"]) or "none"
                if "peak_bytes" in row:
                    run = f"{row['budget_gb'] * 1e3:.3f} ({row['budget_gb'] * 1e9 / base:.1%})"
                    measured = f"{_mb(row['peak_bytes'])} ({row['peak_bytes'] / base:.1%})"
                    predicted = ", ".join(_mb(g["predicted_peak_bytes"]) for g in row["graphs"])
                    headroom = f"{row['headroom_fraction']:.2f}"
                else:
                    run = measured = predicted = headroom = "infeasible"
                lines.append(f"| {mode} | {r['rank']} | {_mb(r['plain_peak_bytes'])} | {row['fraction']:.0%} | {named} | "
                             f"{run} | {headroom} | {measured} | {predicted} |")
    lines += ["", "## How each graph's share was set (rank 0; remat/distributed.py)", "",
              "| mode | budget MB | graph | step target MB | held before MB | outside MB | later runs / reserve MB | "
              "planning target MB | predicted peak MB | saved MB |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, ranks in results.items():
        for row in ranks[0]["rows"]:
            for g in row.get("graphs", []):
                sh = g["share"] or {}
                later = (f"{_mb(sh.get('later_run_bytes', 0))} + {sh.get('rs_buffers', 0)} x {_mb(sh.get('rs_buffer_bytes', 0))}"
                         f", prefetch {_mb(sh.get('prefetch_bytes', 0))}" if sh.get("kind") == "fsdp2"
                         else _mb(sh.get("reserved_later_bytes", 0)))
                lines.append(f"| {mode} | {row['budget_gb'] * 1e3:.3f} | {g['graph_id']} | {_mb(sh.get('step_target_bytes', 0))} | "
                             f"{_mb(sh.get('held_before_bytes', 0))} | {_mb(sh.get('outside_bytes', 0))} | {later} | "
                             f"{_mb(g['target_bytes'])} | {_mb(g['predicted_peak_bytes'])} | {_mb(g['saved_bytes'])} |")
    for mode, ranks in results.items():
        for r in ranks:
            for label, detail in [("plain Inductor", r["plain_detail"])] + [
                    (f"remat at {row.get('budget_gb', 0) * 1e3:.3f} MB", row.get("detail")) for row in r["rows"]]:
                if not detail:
                    continue
                lines += ["", f"## {mode} rank {r['rank']}, {label}: live at the peak ({_mb(detail['peak_bytes'])} MB)", ""]
                lines += [f"- {_mb(size)} MB: `{scope}`" for scope, size in detail["live_at_peak"].items() if size >= 10_000]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=("ddp", "fsdp2"), default=["ddp", "fsdp2"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.6])
    parser.add_argument("--headroom", type=float, default=None, help="headroom_fraction (default: remat's)")
    parser.add_argument("--attempts", type=int, default=3, help="plans per fraction: the request, then the named minima")
    parser.add_argument("--timeline", action="store_true", help="record what was live at each measured peak")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "distributed_budget-cpu"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="remat_distributed_budget_"))  # per-rank logs and results
    worker_args = ["--fractions", *map(str, args.fractions), "--attempts", str(args.attempts)]
    if args.headroom is not None:
        worker_args += ["--headroom", str(args.headroom)]
    if args.timeline:
        worker_args.append("--timeline")
    load_before, start = os.getloadavg(), time.perf_counter()
    results = {mode: spawn(mode, work, worker_args) for mode in args.modes}
    meta = {"command": "python benchmarks/distributed_budget.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": _git("rev-parse", "--short", "HEAD"), "modified": _git("status", "--short", "--untracked-files=no"),
            "torch": torch.__version__, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "load_before": " ".join(f"{x:.2f}" for x in load_before),
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "wall_s": time.perf_counter() - start}
    Path(str(out) + ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    text = to_markdown(results, meta)
    Path(str(out) + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        worker_main(sys.argv[1:])
    else:
        sys.exit(main())
