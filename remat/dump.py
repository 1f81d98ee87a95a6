"""Write one graph's dump directory: forward.py, backward.py, plan.json, report.md."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from torch import fx

from .cost_model.hardware import HardwareProfile
from .feedback_store import Correction
from .pareto_curve import curve_for_graph, plot_curve, render_table
from .passes.joint_graph import JointGraphFacts
from .passes.plan import Plan
from .passes.rewrite import KEPT_APART_KEY, REMAT_KEY, RecomputeTag, RegionSummary, describe_region
from .report import dumps_plan, plan_to_json, render_report, render_symbolic_sizes


def annotated_code(gm: fx.GraphModule, regions: tuple[RegionSummary, ...]) -> str:
    """The module's Python code with each recompute region fenced by comments, and each sum the
    rewrite kept apart from Inductor's addmm fusion preceded by its reason."""
    region_start: dict[str, RegionSummary] = {}
    region_end: dict[str, int] = {}
    by_id = {r.region: r for r in regions}
    for node in gm.graph.nodes:
        tag = node.meta.get(REMAT_KEY)
        if isinstance(tag, RecomputeTag):
            region_start.setdefault(by_id[tag.region].nodes[0], by_id[tag.region])
            region_end[node.name] = tag.region
    last_of_region = {}
    for name, region in region_end.items():
        last_of_region[region] = name
    closing = {name: region for region, name in last_of_region.items()}
    kept_apart = {node.name: node.meta[KEPT_APART_KEY] for node in gm.graph.nodes if KEPT_APART_KEY in node.meta}
    out = []
    for line in gm.code.splitlines():
        stripped = line.strip()
        name = stripped.split(" = ", 1)[0] if " = " in stripped else None
        if name in region_start:
            summary = region_start[name]
            out.append(f"    # ---- {describe_region(summary)}")
            for reason in summary.reasons:
                out.append(f"    #      not saved: {reason}")
        if name in kept_apart:
            out.append(f"    # kept apart from Inductor's addmm fusion (written as a sub): {kept_apart[name]}")
        out.append(line)
        if name in closing:
            out.append(f"    # ---- end of recompute region {closing[name]}")
    return "\n".join(out) + "\n"


def write_dump(
    directory: Path,
    graph_id: str,
    plan: Plan,
    regions: tuple[RegionSummary, ...],
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    facts: JointGraphFacts,
    profile: HardwareProfile,
    pareto_points: int = 0,
    correction: Optional[Correction] = None,
) -> str:
    """Write the dump; ``correction``: the feedback loop's correction the plan was made with."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "forward.py").write_text(
        f"# remat {graph_id}: forward graph after the rewrite. It returns its outputs, then the saved values.\n"
        + annotated_code(fw, ())
    )
    (directory / "backward.py").write_text(
        f"# remat {graph_id}: backward graph after the rewrite; recompute regions are fenced below.\n"
        + annotated_code(bw, regions)
    )
    (directory / "plan.json").write_text(dumps_plan(plan_to_json(plan, graph_id, regions, profile, correction)))
    report = render_report(plan, graph_id, regions, profile, correction, facts.eager_loss_bytes)
    report += render_symbolic_sizes(plan, facts, (fw.graph, bw.graph))
    if pareto_points > 0:
        curve = curve_for_graph(facts, 0, n_points=pareto_points)   # the index is remat.pareto's; named by graph_id
        png = plot_curve(curve, directory / "pareto.png", graph_id)
        report += "\n## Pareto curve\n\n" + render_table(curve, graph_id)
        report += f"\nPlot: `{png.name}`\n" if png else "\n(Install matplotlib, the `plot` extra, for pareto.png.)\n"
    (directory / "report.md").write_text(report)
    return str(directory)
