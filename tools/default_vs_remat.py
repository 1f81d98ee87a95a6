"""Diagnostic: PyTorch's default partitioner (``min_cut_rematerialization_partition``, what plain
Inductor runs) next to remat's plans on one corpus model's joint graph.

    python tools/default_vs_remat.py rand-1100 [--seeds 1100-1101] [--run default|mincut|none]

For every joint graph: the values each saves (the default's saved set read from its forward's
outputs, remat's free min-cut), the simulated peak of each saved set under remat's simulator
(``evaluate``), the values one saves and the other does not (op, bytes, whether remat may recompute
it and why not), and the forward values the default's backward recomputes that remat's partition
of the same saved set would not. ``--run`` then compiles the model with that partition (``default``:
the default's own modules; ``mincut``: remat's free min-cut through remat's rewrite; ``none``: the
default's saved set through remat's rewrite) and prints the measured step peak.
Sizes in bytes.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch

import remat
import os

import torch._inductor.config as inductor_config

for kv in filter(None, os.environ.get("INDUCTOR", "").split(",")):  # e.g. INDUCTOR=reorder_for_peak_memory=0
    key, value = kv.split("=")
    setattr(inductor_config, key, value == "1")

from remat._torch_compile import CodeCapture, compile_with_partitioner, split_joint
from remat.inductor_check import checked_peak_of
from remat.passes.mincut import min_cut_saved, saved_cost_bytes
from remat.passes.recompute_bans import why_not_recomputable
from remat.passes.rewrite import place_recompute_regions
from remat.pipeline import budget_request, plan_graph, prepare_graph
from remat.simulator import evaluate
from remat.simulator.schedule import register_only
from remat.testing import corpus


def _saved_of(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    out = next(n for n in fw.graph.nodes if n.op == "output")
    return [a.name for a in out.args[0][num_fwd_outputs:] if isinstance(a, torch.fx.Node)]


def _describe(facts, name: str) -> str:
    node = facts.nodes.get(name)
    if node is None:
        return f"{name} (not in remat's facts)"
    ban = why_not_recomputable(facts, name)
    flags = [node.role, node.op, f"{saved_cost_bytes(facts, name) if node.role == 'forward' else 0} B",
             f"shape {node.shape}"]
    if node.is_view:
        flags.append("view")
    if name in register_only(facts):
        flags.append("register-only")
    if not node.free_to_recompute:
        flags.append("not free")
    if ban:
        flags.append(f"ban: {ban}")
    return f"{name}: " + ", ".join(flags)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--seeds", default=None)
    parser.add_argument("--run", choices=("default", "mincut", "none"), default=None)
    parser.add_argument("--smallest", action="store_true", help="print the smallest-peak plan's peak")
    parser.add_argument("--sim", action="store_true", help="print the simulated backward timelines")
    parser.add_argument("--code", action="store_true", help="print the generated wrappers' call()")
    args = parser.parse_args()
    seed = int(args.model.split("-")[1]) if args.model.startswith("rand-") else 1100
    entry = next(e for e in corpus.entries((seed,)) if e.name == args.model)
    print(entry.name, entry.description)

    def partition(joint, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        n_out = int(kwargs["num_fwd_outputs"])
        dfw, dbw = min_cut_rematerialization_partition(copy.deepcopy(joint), joint_inputs, **kwargs)
        default_saved = _saved_of(dfw, n_out)
        prepared = prepare_graph(joint, joint_inputs, n_out, "auto")
        facts = prepared.facts
        fwd = {n for n in facts.nodes if facts.nodes[n].role == "forward"}
        d_saved = {n for n in default_saved if n in fwd}
        mc = set(min_cut_saved(facts))
        ev_d, ev_m = evaluate(facts, d_saved), evaluate(facts, mc)
        print(f"\n== joint graph: {len(facts.order)} nodes, {len(fwd)} forward values")
        print(f"default saves {len(default_saved)} ({len(d_saved)} forward values): simulated peak "
              f"{ev_d.peak_bytes:,} B at {ev_d.simulation.peak_step_name}; remat's partition saves "
              f"{sum(saved_cost_bytes(facts, n) for n in ev_d.partition.saved):,} B")
        print(f"remat min-cut saves {len(mc)}: simulated peak {ev_m.peak_bytes:,} B at {ev_m.simulation.peak_step_name}; "
              f"{sum(saved_cost_bytes(facts, n) for n in ev_m.partition.saved):,} B")
        print("saved by default, not by remat's partition of the min-cut:")
        for n in sorted(set(default_saved) - set(ev_m.partition.saved) - set(ev_m.partition.saved_primals), key=facts.order.index):
            print("   ", _describe(facts, n))
        print("saved by remat's min-cut, not by the default:")
        for n in sorted(set(ev_m.partition.saved) - set(default_saved), key=facts.order.index):
            print("   ", _describe(facts, n))
        print("remat's partition of the default's set differs from it:",
              sorted(set(ev_d.partition.saved) ^ d_saved))
        d_recomputed = {n.name for n in dbw.graph.nodes if n.name in fwd}
        print("default's backward recomputes:", len(d_recomputed), "values; remat's partition of its set:",
              len(ev_d.partition.recomputed))
        for n in sorted(d_recomputed ^ set(ev_d.partition.recomputed), key=facts.order.index):
            print("    only", "default" if n in d_recomputed else "remat", _describe(facts, n))
        if args.smallest:
            from remat.passes.solve_greedy import smallest_peak_plan
            best, _ = smallest_peak_plan(facts, (ev_m,))
            print(f"smallest-peak plan: simulated {best.peak_bytes:,} B, saves {len(best.partition.saved)}, "
                  f"recomputes {len(best.partition.recomputed)}")
            with_default, _ = smallest_peak_plan(facts, (ev_m, ev_d))
            print(f"smallest-peak plan with the default's set as a start: simulated {with_default.peak_bytes:,} B")
        if args.sim:
            for label, ev in (("default", ev_d), ("min-cut", ev_m)):
                sim = ev.simulation
                print(f"\n-- simulated {label}: peak {sim.peak_bytes:,} at step {sim.peak_step} ({sim.peak_step_name})")
                for sid, size in sim.live_at_peak:
                    print(f"   {size:9d} {sid}")
                for i, (st, live) in enumerate(zip(ev.steps, sim.timeline_bytes)):
                    if st.phase == "backward":
                        print(f"   {i:4d} {live:9d} {st.name:28s} +{sum(b for _, b in st.allocs):7d} ph {st.phantom_bytes}")
        if args.run in (None, "default"):
            return dfw, dbw
        plan = plan_graph(facts, budget_request(None))
        if args.run == "none":
            import dataclasses
            plan = dataclasses.replace(plan, saved=tuple(sorted(ev_d.partition.saved)),
                                       recomputed=tuple(sorted(ev_d.partition.recomputed)),
                                       saved_primals=tuple(sorted(ev_d.partition.saved_primals)),
                                       backward_order=ev_d.backward_order)
        fw, bw = split_joint(joint, plan.saved_primals + plan.saved, n_out)
        bw, _ = place_recompute_regions(bw, facts, plan)
        return fw, bw

    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class P(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None

    torch._dynamo.reset()
    built = entry.build()
    capture = CodeCapture()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(built.model, backend=lambda gm, ex: compile_with_partitioner(gm, ex, P(), capture))

        def step():
            built.model.zero_grad(set_to_none=True)
            torch.manual_seed(1234)
            built.loss(compiled).backward()
        step()
        if args.run is not None:
            step()
            print(f"\nmeasured step peak ({args.run}):", f"{remat.measure_peak_bytes(step, 'cpu').peak_bytes:,} B")
            checked = checked_peak_of(capture.graphs, "cpu")
            print("Inductor-checked peak:", checked)
            if args.code:
                for is_bw, code, _ in capture.graphs:
                    print("\n#### backward" if is_bw else "\n#### forward")
                    print(code.source_code[code.source_code.find("def call("):])


if __name__ == "__main__":
    sys.exit(main())
