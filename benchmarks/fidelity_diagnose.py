"""Why did a corpus point miss? The measured allocation timeline of one corpus model's step next to the plan.

    PYTHONHASHSEED=0 python benchmarks/fidelity_diagnose.py rand-1001 none
    PYTHONHASHSEED=0 python benchmarks/fidelity_diagnose.py cnn-vgg-b8-s32-w16 0.9 --dump /tmp/dump
    PYTHONHASHSEED=0 python benchmarks/fidelity_diagnose.py cnn-1294 none --seeds 1294   # a drawn CNN

BUDGET: "none", "plain" (plain Inductor, no remat), a fraction of plain Inductor's measured peak
(< 1, e.g. 0.9), or bytes (>= 1). Prints plain Inductor's and the remat step's measured peak
(docs/design.md's CPU method: allocations made inside step 3's window, each labelled with the aten op
that made it), what is live at the measured peak grouped by op, and each graph's plan: simulated
peak, the step where it is reached, and its dump (``report.md`` says what the simulator holds
there). Units: bytes.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections import Counter
from typing import Any, Optional

import torch

import remat  # noqa: E402
from fidelity import STEP_SEED  # noqa: E402  (run as a script: benchmarks/ is sys.path[0])
from remat.testing import corpus as corpus_mod, finetune  # noqa: E402


def labelled_allocations(prof: Any) -> list[tuple[int, int, int, str]]:
    """``(time_ns, size, address, aten op)`` of every CPU allocation and free, in time order."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int, str]] = []
    stack = [(event, "") for event in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, op = stack.pop()
        if event.tag == _EventType.Allocation:
            if event.extra_fields.device.type == "cpu":
                out.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr, op or "?"))
            continue
        inner = op if op.startswith("aten::") else event.name
        stack.extend((child, inner) for child in event.children)
    return sorted(out)


def live_at_peak(events: list[tuple[int, int, int, str]]) -> tuple[int, dict[int, tuple[int, str]], tuple[int, str]]:
    """The peak of allocations made in the window, what is live there (address -> (size, op)) and
    the allocation that reached it (size, op): inside a library call, the call's own working memory."""
    live, peak, mine, at_peak, reached_by = 0, 0, {}, {}, (0, "")
    for _, size, address, op in events:
        if size > 0:
            live -= mine.pop(address, (0, ""))[0]
            mine[address] = (size, op)
            live += size
        elif address in mine:
            live -= mine.pop(address)[0]
        if live > peak:
            peak, at_peak, reached_by = live, dict(mine), (size, op)
    return peak, at_peak, reached_by


def profile_step(entry: corpus_mod.CorpusEntry, backend: Any,
                 freeze: Optional[str] = None) -> tuple[int, dict[int, tuple[int, str]], tuple[int, str]]:
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    built = entry.build(freeze=freeze)
    compiled = torch.compile(built.model, backend=backend)
    for _ in range(2):
        built.model.zero_grad(set_to_none=True)
        torch.manual_seed(STEP_SEED)
        built.loss(compiled).backward()
    built.model.zero_grad(set_to_none=True)
    torch.manual_seed(STEP_SEED)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        built.loss(compiled).backward()
    return live_at_peak(labelled_allocations(prof))


def show(title: str, peak: int, at_peak: dict[int, tuple[int, str]], reached_by: tuple[int, str]) -> None:
    by_op: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for size, op in at_peak.values():
        by_op[op] += size
        counts[op] += 1
    print(f"{title}: measured peak {peak:,} bytes, reached by an allocation of {reached_by[0]:,} bytes in {reached_by[1]}; "
          "live there, by the op that allocated it:")
    for op, size in by_op.most_common(14):
        print(f"  {size:>12,}  {counts[op]:>3} x {op}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("budget")
    parser.add_argument("--dump", default=None, help="remat's dump directory (report.md per graph)")
    parser.add_argument("--seeds", default=None, help="seed range of the random nets and of the drawn CNNs and Hugging Face configurations "
                                                          "(cnn-<seed>, hf-<seed>), e.g. 1000-1027 (default: the benchmark's)")
    parser.add_argument("--freeze", choices=finetune.FREEZE_REGIMES, default=None,
                        help="the fine-tuning regime of benchmarks/fidelity.py --freeze")
    parser.add_argument("--no-loop", action="store_true",
                        help="turn the closed loop off (verify_peak=0): profile the plan as Inductor's check accepted it")
    args = parser.parse_args()
    from fidelity import parse_seeds

    seeds = parse_seeds(args.seeds) if args.seeds else corpus_mod.BENCHMARK_SEEDS
    entry = next(e for e in corpus_mod.entries(seeds, cnn_seeds=seeds, hf_seeds=seeds) if e.name == args.model)
    print(f"{entry.name}: {entry.description}")
    plain_peak, plain_live, plain_reached_by = profile_step(entry, "inductor", args.freeze)
    show("plain Inductor", plain_peak, plain_live, plain_reached_by)
    if args.budget == "plain":
        return 0
    value = None if args.budget == "none" else float(args.budget)
    budget = None if value is None else int(value * plain_peak if value < 1 else value)
    backend = remat.backend(None if budget is None else budget / 1e9, dump_dir=args.dump,
                            **({"verify_peak": 0} if args.no_loop else {}))
    peak, live, reached_by = profile_step(entry, backend, args.freeze)
    show(f"remat at budget {budget}", peak, live, reached_by)
    for record in backend.compiled_graphs:
        plan = record.plan
        checked = getattr(getattr(record, "judgement", None), "checked_peak_bytes", None)
        print(f"{record.graph_id}: simulated peak {plan.predicted_peak_bytes:,} at {plan.peak_step_name}, "
              f"Inductor-checked {checked if checked is None else f'{checked:,}'}, saved {plan.saved_bytes:,}, "
              f"no-remat simulated {plan.no_remat_peak_bytes:,}; dump {record.dump_path}")
    for event in getattr(backend, "feedback_events", []):
        print(f"loop: {event}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
