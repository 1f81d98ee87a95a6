"""How good is remat's cost model? Estimated vs measured time, FLOPs vs FlopCounterMode.

    python benchmarks/cost_model_accuracy.py --threads 1         # CPU, zoo GPT and CNN
    python benchmarks/cost_model_accuracy.py --device cuda       # the same on a GPU (< 8 min on an H200)

On CUDA the zoo's batches are multiplied by ``--batch-scale`` (default 8) so kernels
are not all launch-bound; nodes are timed with CUDA events, the calibration and the
whole-graph times synchronise around each sample, and the profile is ``auto`` (the
datasheet profile matching the GPU's name, e.g. h200). ``--max-minutes`` bounds the
run (default 7.5 on CUDA): a model, or the Inductor compile of a model, that would
start too late is skipped and says so. One model failing does not lose the others:
its error is recorded, and the results files are rewritten after every model.

For each model, the joint forward+backward graph is traced as the backend sees
it (Inductor's decompositions and joint-graph passes, captured at the
partitioner; no code generation), then:

- per node: the roofline estimate (op alone, ``unfused_time_s``) and the
  calibrated estimate (``calibrate``: each op timed alone on random inputs) are
  ranked against the node's time measured *in context* (the joint graph run
  eagerly on real tensors, each op timed where it runs, median of several
  runs): Spearman rank correlation over all kernel nodes;
- whole graph: the per-phase sums of the estimates against the measured
  forward and backward times of the model compiled by Inductor (fused
  estimates: ``phase_totals``, the nodes' ``est_time_s`` plus each compiled
  graph's call), the reference, and of the eager model (unfused estimates).
  With ``--threads 1`` the compiled steps' CPU time is recorded too: on a
  shared machine it is the step's own time (wall-clock medians at load 5-7
  read 1.5-2x the quiet machine's, CPU time within ~5-10%);
- FLOPs: per phase and op, against ``FlopCounterMode`` on the eager model;
  the nodes whose FLOPs are estimates, by op.

Writes ``benchmarks/results/cost_model_accuracy-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import fx

from remat.testing.zoo import ZOO
from remat.cost_model.calibrate import calibrate, random_tensor
from remat.cost_model.costs import annotate_costs, graph_call_s, phase_totals
from remat.cost_model.flops import EXTRA_FLOP_FORMULAS, TORCH_RULE, node_flops, ops_without_formula
from remat.cost_model.fusion import find_fusion_groups, is_loop_op
from remat.cost_model.hardware import DEFAULT_CPU_PROFILES, cpu_family, get_profile, profile_to_json
from remat.cost_model.phases import node_phases
from remat.cost_model.tensors import is_free_op

ROOT = Path(__file__).resolve().parents[1]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- tracing the joint graph


def capture_joint(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[fx.GraphModule, list[Any]]:
    """The first joint graph Inductor hands its partitioner (decomposed, joint passes applied),
    and the real values of its placeholders (the model's parameters and inputs; tangents of ones)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import default_partition
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import partition_fn as inductor_partition_fn
    from torch._inductor.custom_graph_pass import CustomPartitionerFn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    captured: list[fx.GraphModule] = []

    class Capture(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            captured.append(gm)
            return default_partition(gm, joint_inputs, num_fwd_outputs=kwargs["num_fwd_outputs"],
                                     static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"))

        def uuid(self):
            return None

    def partition(gm, joint_inputs, **kwargs):
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return inductor_partition_fn(gm, joint_inputs, **kwargs)

    tracer = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=lambda gm, _: make_boxed_func(gm),
                          partition_fn=partition, decompositions=select_decomp_table())
    dynamo_inputs: list[list[Any]] = []

    def backend(gm, example_inputs):
        dynamo_inputs.append(list(example_inputs))
        return tracer(gm, example_inputs)

    torch._dynamo.reset()
    try:
        with inductor_config.patch(custom_partitioner_fn=Capture()), functorch_config.patch(enable_autograd_cache=False):
            torch.compile(model, backend=backend)(*inputs)
    finally:
        torch._dynamo.reset()
    joint = captured[0]
    joint.graph.eliminate_dead_code()
    joint.recompile()
    return joint, placeholder_values(joint.graph, dynamo_inputs[0])


def placeholder_values(graph: fx.Graph, dynamo_inputs: Sequence[Any]) -> list[Any]:
    """Real values for the joint graph's placeholders, read off AOTAutograd's input descriptors.

    Random weights would not do: scores of N(0, 1) weights underflow ``exp`` into
    denormals, which a CPU runs ~20x slower than the numbers a real model sees.
    """
    values = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        desc, val = node.meta.get("desc"), node.meta.get("val")
        kind = type(desc).__name__
        if kind == "PlainAOTInput" and isinstance(dynamo_inputs[desc.idx], torch.Tensor):
            values.append(dynamo_inputs[desc.idx].detach().clone())
        elif kind == "TangentAOTInput" and isinstance(val, torch.Tensor):
            values.append(torch.ones(tuple(val.shape), dtype=val.dtype, device=val.device))   # d(loss.sum())/d(out)
        elif isinstance(val, torch.Tensor):
            values.append(random_tensor(val, val.device))
        else:
            values.append(val)
    return values


# ---------------------------------------------------------------- measuring


class NodeTimer(fx.Interpreter):
    """Runs a graph on real tensors and times each kernel node where it runs."""

    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.device = device
        self.times: dict[str, float] = {}
        self.events: list[tuple[str, Any, Any]] = []

    def run_node(self, node: fx.Node) -> Any:
        if node.op != "call_function" or is_free_op(node):
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = node.target(*args, **kwargs)
            end.record()
            self.events.append((node.name, start, end))
            return out
        t0 = time.perf_counter()
        out = node.target(*args, **kwargs)
        self.times[node.name] = time.perf_counter() - t0
        return out

    def collect(self) -> dict[str, float]:
        if self.events:
            torch.cuda.synchronize(self.device)
            self.times.update({name: start.elapsed_time(end) / 1e3 for name, start, end in self.events})
        return self.times


def time_in_context(gm: fx.GraphModule, args: Sequence[Any], device: torch.device,
                    repeats: int) -> tuple[dict[str, float], float, float]:
    """Median per-node seconds over ``repeats`` runs of the joint graph on ``args``, the median run
    time, and the measurement's own repeatability: the Spearman correlation between the per-node
    medians of the odd and of the even runs (the ceiling any estimate can reach)."""
    samples: dict[str, list[float]] = {}
    runs = []
    with torch.no_grad():
        for i in range(repeats + 1):      # the first run warms up allocator and caches
            timer = NodeTimer(gm, device)
            sync(device)
            t0 = time.perf_counter()
            timer.run(*args, enable_io_processing=False)
            sync(device)
            if i == 0:
                continue
            runs.append(time.perf_counter() - t0)
            for name, seconds in timer.collect().items():
                samples.setdefault(name, []).append(seconds)
    names = sorted(samples)
    odd = [statistics.median(samples[n][0::2]) for n in names]
    even = [statistics.median(samples[n][1::2]) for n in names]
    repeatability = spearman(odd, even) if repeats >= 2 else float("nan")
    return {name: statistics.median(v) for name, v in samples.items()}, statistics.median(runs), repeatability


def phase_times(step: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> dict[str, Any]:
    """Median forward and backward wall-clock seconds of ``step`` (returns the loss; backward timed
    separately). On a CPU running one torch thread, also the CPU time of each phase (median and best):
    what the step itself costs, without the time a neighbour's load takes from it."""
    forward, backward, cpu_forward, cpu_backward = [], [], [], []
    for i in range(repeats + 2):
        sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = step()
        sync(device)
        t1, c1 = time.perf_counter(), time.thread_time()
        loss.backward()
        sync(device)
        t2, c2 = time.perf_counter(), time.thread_time()
        if i >= 2:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            cpu_forward.append(c1 - c0)
            cpu_backward.append(c2 - c1)
    result: dict[str, Any] = {"forward": statistics.median(forward), "backward": statistics.median(backward)}
    if device.type == "cpu" and torch.get_num_threads() == 1:
        result["cpu_time_s"] = {"forward": statistics.median(cpu_forward), "backward": statistics.median(cpu_backward),
                                "forward_best": min(cpu_forward), "backward_best": min(cpu_backward)}
    return result


_KERNEL_CALL = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?"
    r"|aten\.\w+(?:\.\w+)?)\(", re.M)


def kernel_calls(code: str) -> int:
    """Kernel launches in the ``call`` function of one module of Inductor's output code."""
    start = code.find("def call(")
    end = code.find("def benchmark_compiled_module", start)
    return len(_KERNEL_CALL.findall(code[start:end if end > 0 else None])) if start >= 0 else 0


def compiled_phase_times(make_model: Callable[[], tuple], device: torch.device, repeats: int) -> dict[str, Any]:
    from torch._inductor.utils import run_and_get_code

    model, inputs = make_model()
    compiled = torch.compile(model)
    start = time.perf_counter()
    _, codes = run_and_get_code(lambda: compiled(*inputs).sum().backward())
    sync(device)
    compile_s = time.perf_counter() - start
    result = phase_times(lambda: compiled(*inputs).sum(), device, repeats)
    torch._dynamo.reset()
    return {**result, "compile_s": compile_s, "inductor_kernel_calls": sum(kernel_calls(c) for c in codes),
            "inductor_modules": len(codes)}


# ---------------------------------------------------------------- statistics


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)


def relative_error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured


def flop_check(make_model: Callable[[], tuple], graph: fx.Graph) -> dict[str, Any]:
    from torch.utils.flop_counter import FlopCounterMode

    model, inputs = make_model()
    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd:
        loss = model(*inputs).sum()
    with bwd:
        loss.backward()
    phases = node_phases(graph)
    ours = {"forward": Counter(), "backward": Counter()}
    extra_ops = {str(op) for op in EXTRA_FLOP_FORMULAS}
    extra = {"forward": 0, "backward": 0}
    estimated = {"forward": 0, "backward": 0}
    for node in graph.nodes:
        estimate = node_flops(node)
        phase = phases[node.name]
        if estimate.rule == TORCH_RULE:
            ours[phase][str(node.target.overloadpacket)] += estimate.flops
        elif estimate.has_formula:
            extra[phase] += estimate.flops
        else:
            estimated[phase] += estimate.flops
    result: dict[str, Any] = {}
    for phase, mode in (("forward", fwd), ("backward", bwd)):
        counted = Counter({str(op): n for op, n in mode.get_flop_counts()["Global"].items() if str(op) not in extra_ops})
        result[phase] = {
            "flop_counter_mode": sum(counted.values()),
            "remat_same_ops": sum(ours[phase].values()),
            "equal_per_op": +ours[phase] == +counted,
            "per_op": {op: [ours[phase].get(op, 0), counted.get(op, 0)] for op in sorted(set(ours[phase]) | set(counted))},
            "remat_extra_formulas": extra[phase],
            "remat_estimated": estimated[phase],
        }
    kernels = [n for n in graph.nodes if n.op == "call_function" and not is_free_op(n)]
    missing = ops_without_formula(kernels)
    result["kernel_nodes"] = len(kernels)
    result["nodes_without_formula"] = sum(missing.values())
    result["share_without_formula"] = sum(missing.values()) / max(1, len(kernels))
    result["without_formula_by_op"] = dict(missing.most_common())
    return result


# ---------------------------------------------------------------- one model


def per_node_metrics(graph: fx.Graph, nodes: list[str], in_context: dict[str, float], roofline: dict,
                     calibrated_s: dict[str, float], repeatability: float) -> dict[str, Any]:
    """Spearman of each estimate against the in-context times, overall and by kind of node."""
    measured = [in_context[n] for n in nodes]
    metrics: dict[str, Any] = {
        "nodes": len(nodes),
        "spearman_measurement_repeatability": repeatability,
        "spearman_roofline_unfused": spearman([roofline[n].unfused_time_s for n in nodes], measured),
        "spearman_roofline_fused": spearman([roofline[n].est_time_s for n in nodes], measured),
        "spearman_calibrated": spearman([calibrated_s[n] for n in nodes], measured),
        "median_ratio_roofline_unfused": statistics.median(roofline[n].unfused_time_s / in_context[n] for n in nodes),
        "median_ratio_calibrated": statistics.median(calibrated_s[n] / in_context[n] for n in nodes),
        "by_kind": {},
    }
    wanted = set(nodes)
    for kind, pick in (("extern", lambda n: not is_loop_op(n)), ("loop", is_loop_op)):
        chosen = [n.name for n in graph.nodes if n.name in wanted and pick(n)]
        if len(chosen) > 2:
            measured_kind = [in_context[n] for n in chosen]
            metrics["by_kind"][kind] = {
                "nodes": len(chosen),
                "spearman_roofline_unfused": spearman([roofline[n].unfused_time_s for n in chosen], measured_kind),
                "spearman_calibrated": spearman([calibrated_s[n] for n in chosen], measured_kind),
            }
    return metrics


def phase_sums(graph: fx.Graph, roofline: dict, calibrated: dict, calibrated_s: dict[str, float],
               in_context: dict[str, float],
               per_graph_s: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Per phase, the summed estimates (op alone and fused) and the summed in-context times.

    The fused sums are ``phase_totals``: the nodes' ``est_time_s`` plus the call of each
    phase's compiled graph (``per_graph_s``); the unfused sums are what eager runs, op by op.
    """
    phases = node_phases(graph)
    fused = {"roofline": phase_totals(graph, roofline, per_graph_s=per_graph_s),
             "calibrated": phase_totals(graph, calibrated, per_graph_s=per_graph_s)}
    sums: dict[str, dict[str, float]] = {}
    for phase in ("forward", "backward"):
        names = [n.name for n in graph.nodes if phases[n.name] == phase]
        sums[phase] = {
            "roofline_unfused_s": sum(roofline[n].unfused_time_s for n in names),
            "roofline_fused_s": fused["roofline"][phase].est_time_s,
            "roofline_fused_loop_extra_s": fused["roofline"][phase].loop_extra_s,
            "calibrated_unfused_s": sum(calibrated_s.get(n, roofline[n].unfused_time_s) for n in names),
            "calibrated_fused_s": fused["calibrated"][phase].est_time_s,
            "graph_call_s": (per_graph_s or {}).get(phase, 0.0),
            "in_context_sum_s": sum(in_context.get(n, 0.0) for n in names),
        }
    return sums


def whole_graph_totals(name: str, make_model: Callable[[], tuple], sums: dict, device: torch.device,
                       repeats: int, compiled: bool) -> dict[str, Any]:
    """Measured eager (and Inductor) forward/backward times and the sums' relative errors against them."""
    print(f"[{name}] timing eager forward/backward", flush=True)
    eager_model, eager_inputs = make_model()
    eager = phase_times(lambda: eager_model(*eager_inputs).sum(), device, repeats)
    totals: dict[str, Any] = {"eager_s": eager}
    for phase in ("forward", "backward"):
        totals[f"{phase}_vs_eager"] = {
            "roofline_unfused": relative_error(sums[phase]["roofline_unfused_s"], eager[phase]),
            "calibrated_unfused": relative_error(sums[phase]["calibrated_unfused_s"], eager[phase]),
            "in_context_sum": relative_error(sums[phase]["in_context_sum_s"], eager[phase]),
        }
    if compiled:
        print(f"[{name}] compiling with Inductor", flush=True)
        inductor = compiled_phase_times(make_model, device, repeats)
        totals["inductor_s"] = inductor
        for phase in ("forward", "backward"):
            totals[f"{phase}_vs_inductor"] = {
                "roofline_fused": relative_error(sums[phase]["roofline_fused_s"], inductor[phase]),
                "calibrated_fused": relative_error(sums[phase]["calibrated_fused_s"], inductor[phase]),
            }
            if "cpu_time_s" in inductor:
                cpu = inductor["cpu_time_s"][phase]
                totals[f"{phase}_vs_inductor_cpu_time"] = {
                    "roofline_fused": relative_error(sums[phase]["roofline_fused_s"], cpu),
                    "calibrated_fused": relative_error(sums[phase]["calibrated_fused_s"], cpu),
                }
    return totals


def fusion_summary(graph: fx.Graph) -> dict[str, int]:
    groups = find_fusion_groups(graph)
    nodes = {n.name: n for n in graph.nodes}
    loops = sum(1 for members in groups.members.values() if any(is_loop_op(nodes[m]) for m in members))
    return {"predicted_kernels": groups.kernel_count(), "predicted_loop_kernels": loops}


class Deadline:
    """Seconds left before ``--max-minutes`` runs out (never, when it is 0)."""

    def __init__(self, max_minutes: float) -> None:
        self.end = time.perf_counter() + 60 * max_minutes if max_minutes > 0 else float("inf")

    def left_s(self) -> float:
        return self.end - time.perf_counter()


ZOO_BATCH = {"mlp": 2048, "gpt": 8, "cnn": 16, "llama": 8}    # the zoo's defaults (remat/testing/zoo.py)


def model_factory(name: str, device: torch.device, batch_scale: int) -> Callable[[], tuple]:
    def make_model():
        model, inputs = ZOO[name](batch=ZOO_BATCH[name] * batch_scale) if batch_scale != 1 else ZOO[name]()
        return model.to(device).train(), tuple(t.to(device) for t in inputs)
    return make_model


def resolve_profile(name: str, device: torch.device) -> Any:
    """``get_profile(name, device)``, or with ``name="default"`` the CPU family's default profile (the one a
    machine with no measured profile plans with; remat/cost_model/profiles.py)."""
    return DEFAULT_CPU_PROFILES[cpu_family()] if name == "default" else get_profile(name, device)


def run_model(name: str, device: torch.device, profile_name: str, repeats: int, compiled: bool,
              batch_scale: int = 1, deadline: Deadline | None = None, compile_reserve_s: float = 0.0) -> dict[str, Any]:
    make_model = model_factory(name, device, batch_scale)
    deadline = deadline or Deadline(0)

    print(f"[{name}] tracing the joint graph", flush=True)
    t0 = time.perf_counter()
    joint, joint_args = capture_joint(*make_model())
    graph, trace_s = joint.graph, time.perf_counter() - t0
    profile = resolve_profile(profile_name, device)

    print(f"[{name}] calibrating {len(graph.nodes)} nodes", flush=True)
    t0 = time.perf_counter()
    calibration = calibrate(graph, device=device, use_cache=False)
    calibrate_s = time.perf_counter() - t0
    roofline = annotate_costs(graph, profile)
    calibrated = annotate_costs(graph, profile, measured_times=calibration.times_s)

    print(f"[{name}] timing the joint graph in context", flush=True)
    in_context, graph_run_s, repeatability = time_in_context(joint, joint_args, device, repeats)
    nodes = [n.name for n in graph.nodes if n.name in in_context and n.name in calibration.times_s]
    sums = phase_sums(graph, roofline, calibrated, calibration.times_s, in_context, graph_call_s(graph, profile))
    targets, phases = {n.name: n.target for n in graph.nodes}, node_phases(graph)
    compile_now = compiled and deadline.left_s() > compile_reserve_s
    if compiled and not compile_now:
        print(f"[{name}] skipping the Inductor compile: {deadline.left_s():.0f} s left, "
              f"{compile_reserve_s:.0f} s reserved for it", flush=True)
    return {
        "model": name,
        "batch": ZOO_BATCH[name] * batch_scale,
        "inductor_skipped_for_time": compiled and not compile_now,
        "graph_nodes": len(graph.nodes),
        "trace_s": trace_s,
        "calibrate_s": calibrate_s,
        "calibration_skipped": dict(calibration.skipped),
        "joint_graph_run_s": graph_run_s,
        "per_node": per_node_metrics(graph, nodes, in_context, roofline, calibration.times_s, repeatability),
        "phase_sums": sums,
        "totals": whole_graph_totals(name, make_model, sums, device, repeats, compile_now),
        "fusion": fusion_summary(graph),
        "flops": flop_check(make_model, graph),
        "node_rows": [
            {"node": n, "op": str(targets[n]), "phase": phases[n], "in_context_s": in_context[n],
             "roofline_unfused_s": roofline[n].unfused_time_s, "roofline_fused_s": roofline[n].est_time_s,
             "calibrated_s": calibration.times_s[n], "calibrated_fused_s": calibrated[n].est_time_s,
             "flops": roofline[n].flops, "bytes": roofline[n].bytes_read + roofline[n].bytes_written}
            for n in nodes
        ],
    }


# ---------------------------------------------------------------- report


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = os.getloadavg()
    return info


def pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def _load(values: Any) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "-"


def _header(payload: dict[str, Any]) -> list[str]:
    m = payload["machine"]
    batches = ", ".join(f"{r['model']} {r.get('batch', '?')}" for r in payload["models"])
    return [
        f"# Cost model accuracy on {payload['device']}",
        "",
        f"Machine: {m.get('gpu', m['cpu'])}, {m['cpu_count']} cores, torch {m['torch']} "
        f"({m['torch_threads']} threads), host `{m['host']}`; load average (1/5/15 min) at start "
        f"{_load(m.get('load_average_at_start'))}, at end {_load(payload.get('load_average_at_end'))}.",
        f"Profile `{payload['profile']['name']}`: {payload['profile']['source']}.",
        f"Command: `{payload['command']}` ({payload.get('wall_s', 0):.0f} s); "
        f"zoo batches x{payload.get('batch_scale', 1)} ({batches}).",
    ]


def _per_node_section(models: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Per node: estimated vs measured in context (Spearman rank correlation)",
        "",
        "Measured in context: the joint graph run eagerly on the model's own weights and inputs, each op "
        "timed where it runs, median of the runs. Repeatability: the same measurement's odd runs against "
        "its even runs, the ceiling any estimate can reach on this machine.",
        "",
        "| model | kernel nodes | repeatability | roofline (op alone) | roofline (fused) | calibrated "
        "| extern only: roofline / calibrated | loop ops only: roofline / calibrated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in models:
        p, kinds = r["per_node"], r["per_node"]["by_kind"]

        def kind(k: str) -> str:
            if k not in kinds:
                return "-"
            return f"{kinds[k]['spearman_roofline_unfused']:.2f} / {kinds[k]['spearman_calibrated']:.2f} ({kinds[k]['nodes']})"

        lines.append(f"| {r['model']} | {p['nodes']} | {p['spearman_measurement_repeatability']:.3f} | "
                     f"{p['spearman_roofline_unfused']:.3f} | {p['spearman_roofline_fused']:.3f} | "
                     f"{p['spearman_calibrated']:.3f} | {kind('extern')} | {kind('loop')} |")
    return lines


def _totals_section(models: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Whole graph: summed estimates vs measured forward / backward",
        "",
        "Eager: the model run eagerly (sum of op-alone estimates). Inductor: the model compiled by "
        "`torch.compile` (sum of fused estimates, `est_time_s`). Relative error, estimate vs measured.",
        "",
        "| model | phase | eager measured | roofline | calibrated | Inductor measured | roofline (fused) | calibrated (fused) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in models:
        t = r["totals"]
        for phase in ("forward", "backward"):
            ind, vi, ve = t.get("inductor_s"), t.get(f"{phase}_vs_inductor", {}), t[f"{phase}_vs_eager"]
            compiled = (f"{1e3 * ind[phase]:.2f} ms | {pct(vi['roofline_fused'])} | {pct(vi['calibrated_fused'])} |"
                        if ind else "- | - | - |")
            lines.append(f"| {r['model']} | {phase} | {1e3 * t['eager_s'][phase]:.2f} ms | "
                         f"{pct(ve['roofline_unfused'])} | {pct(ve['calibrated_unfused'])} | " + compiled)
    cpu_rows = [(r, phase) for r in models for phase in ("forward", "backward")
                if f"{phase}_vs_inductor_cpu_time" in r["totals"]]
    if cpu_rows:
        lines += [
            "",
            "The same Inductor steps in CPU time (one torch thread: the CPU time is the step's own; the wall "
            "clock adds whatever neighbours took on a shared machine, though their cache and core sharing "
            "still slow it). Median of the steps; best in brackets.",
            "",
            "| model | phase | Inductor CPU time | roofline (fused) | calibrated (fused) |",
            "|---|---|---|---|---|",
        ]
        for r, phase in cpu_rows:
            cpu, vs = r["totals"]["inductor_s"]["cpu_time_s"], r["totals"][f"{phase}_vs_inductor_cpu_time"]
            lines.append(f"| {r['model']} | {phase} | {1e3 * cpu[phase]:.2f} ms ({1e3 * cpu[phase + '_best']:.2f}) | "
                         f"{pct(vs['roofline_fused'])} | {pct(vs['calibrated_fused'])} |")
    return lines


def _graph_totals_section(models: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Whole graph: summed estimates vs the same graph run eagerly",
        "",
        "The joint graph's own ops (Inductor's decompositions: `var_mean` for the norms, Python prims for "
        "dropout's random numbers and max pooling) are not the ops the eager model runs, and the eager model "
        "is timed minutes apart from them on a shared machine. Here the reference is the sum of the per-node "
        "times measured in context (same runs as the Spearman above), per phase.",
        "",
        "| model | phase | in context | roofline (op alone) | calibrated | eager model vs in context |",
        "|---|---|---|---|---|---|",
    ]
    for r in models:
        for phase in ("forward", "backward"):
            sums, eager = r["phase_sums"][phase], r["totals"]["eager_s"][phase]
            measured = sums["in_context_sum_s"]
            lines.append(f"| {r['model']} | {phase} | {1e3 * measured:.2f} ms | "
                         f"{pct(relative_error(sums['roofline_unfused_s'], measured))} | "
                         f"{pct(relative_error(sums['calibrated_unfused_s'], measured))} | "
                         f"{pct(relative_error(eager, measured))} |")
    return lines


def _flops_section(models: list[dict[str, Any]]) -> list[str]:
    lines = ["## FLOPs vs FlopCounterMode", "",
             "| model | phase | FlopCounterMode | remat (same ops) | equal per op | remat extra formulas | estimated (no formula) |",
             "|---|---|---|---|---|---|---|"]
    for r in models:
        for phase in ("forward", "backward"):
            f = r["flops"][phase]
            lines.append(f"| {r['model']} | {phase} | {f['flop_counter_mode']:,} | {f['remat_same_ops']:,} | "
                         f"{'yes' if f['equal_per_op'] else 'NO'} | {f['remat_extra_formulas']:,} | {f['remat_estimated']:,} |")
    lines += ["", "## Nodes whose FLOPs are estimated (no formula), by op", ""]
    for r in models:
        f = r["flops"]
        ops = ", ".join(f"`{op}` {n}" for op, n in f["without_formula_by_op"].items())
        lines.append(f"- {r['model']}: {f['nodes_without_formula']} of {f['kernel_nodes']} kernel nodes "
                     f"({100 * f['share_without_formula']:.0f}%): {ops}")
    return lines


def _fusion_section(models: list[dict[str, Any]]) -> list[str]:
    lines = ["## Fusion", ""]
    for r in models:
        ind = r["totals"].get("inductor_s", {})
        lines.append(f"- {r['model']}: predicted {r['fusion']['predicted_kernels']} kernel launches per step "
                     f"({r['fusion']['predicted_loop_kernels']} of them generated loops, the rest library calls); "
                     f"Inductor's code launches {ind.get('inductor_kernel_calls', '-')}.")
    return lines


def _problems_section(payload: dict[str, Any]) -> list[str]:
    lines = ["## Not measured", ""]
    lines += [f"- {f['model']}: failed, `{f['error'].splitlines()[0][:300]}`" for f in payload.get("failed", [])]
    lines += [f"- {name}: not started, --max-minutes {payload.get('max_minutes')} ran out"
              for name in payload.get("skipped_for_time", [])]
    lines += [f"- {r['model']}: Inductor compile skipped, too little of --max-minutes left"
              for r in payload["models"] if r.get("inductor_skipped_for_time")]
    return lines if len(lines) > 2 else []


def write_markdown(path: Path, payload: dict[str, Any]) -> None:
    models = payload["models"]
    sections = [_header(payload), _problems_section(payload), _per_node_section(models), _totals_section(models),
                _graph_totals_section(models), _flops_section(models), _fusion_section(models)]
    sections = [section for section in sections if section]
    path.write_text("\n\n".join("\n".join(section) for section in sections) + "\n")


def write_results(out_dir: Path, device: str, payload: dict[str, Any]) -> Path:
    """Write the JSON and the markdown (again after every model, so a cut-short run keeps what it has)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"cost_model_accuracy-{device}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
    write_markdown(stem.with_suffix(".md"), payload)
    return stem.with_suffix(".md")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", nargs="+", default=["gpt", "cnn"], choices=sorted(ZOO))
    parser.add_argument("--profile", default="auto", help="hardware profile: auto, cpu, cuda, a100, h100, h200, default (the CPU family's default)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--batch-scale", type=int, default=None,
                        help="multiply the zoo's batch sizes (default: 1 on CPU, 8 on CUDA)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop starting new work after this long (default: none on CPU, 7.5 on CUDA; 0: none)")
    parser.add_argument("--compile-reserve-s", type=float, default=None,
                        help="skip a model's Inductor compile with fewer seconds left (default: 20 CPU, 75 CUDA)")
    parser.add_argument("--no-compiled", action="store_true", help="skip the Inductor compile and its timings")
    parser.add_argument("--out-dir", "--out", dest="out_dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--render", action="store_true", help="only write the markdown again from the results JSON")
    args = parser.parse_args(argv)
    if args.render:
        stem = Path(args.out_dir) / f"cost_model_accuracy-{args.device}"
        write_markdown(stem.with_suffix(".md"), json.loads(stem.with_suffix(".json").read_text()))
        print(stem.with_suffix(".md").read_text())
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device on this machine")
    on_cuda = device.type == "cuda"
    batch_scale = args.batch_scale if args.batch_scale is not None else (8 if on_cuda else 1)
    max_minutes = args.max_minutes if args.max_minutes is not None else (7.5 if on_cuda else 0.0)
    reserve_s = args.compile_reserve_s if args.compile_reserve_s is not None else (75.0 if on_cuda else 20.0)
    deadline = Deadline(max_minutes)
    start = time.perf_counter()
    profile = resolve_profile(args.profile, device)
    payload: dict[str, Any] = {
        "device": args.device, "machine": machine(device), "profile": profile_to_json(profile),
        "command": " ".join(["python", "benchmarks/cost_model_accuracy.py"] + list(argv if argv is not None else sys.argv[1:])),
        "repeats": args.repeats, "batch_scale": batch_scale, "max_minutes": max_minutes, "models": [], "failed": [],
        "skipped_for_time": [],
    }
    out_dir = Path(args.out_dir)
    for name in args.models:
        # a model takes about a minute on either device without its compile: do not start one with less left
        if deadline.left_s() < 45:
            print(f"[{name}] skipped: {deadline.left_s():.0f} s left of --max-minutes {max_minutes}", flush=True)
            payload["skipped_for_time"].append(name)
            continue
        try:
            payload["models"].append(run_model(name, device, args.profile, args.repeats, not args.no_compiled,
                                               batch_scale, deadline, reserve_s))
        except Exception as error:  # noqa: BLE001 - one model failing must not lose the others' results
            import traceback

            print(f"[{name}] FAILED: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
            payload["failed"].append({"model": name, "error": f"{type(error).__name__}: {str(error)[:2000]}",
                                      "traceback": traceback.format_exc()[-4000:]})
        finally:
            if on_cuda:
                torch.cuda.empty_cache()
        payload["wall_s"] = time.perf_counter() - start
        if hasattr(os, "getloadavg"):
            payload["load_average_at_end"] = os.getloadavg()
        path = write_results(out_dir, args.device, payload)
    payload["wall_s"] = time.perf_counter() - start
    path = write_results(out_dir, args.device, payload)
    print(path.read_text())
    return 0 if payload["models"] and not payload["failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
