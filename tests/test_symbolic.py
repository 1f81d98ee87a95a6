"""Dynamic shapes: report.md shows the saved bytes and the peak as formulas in the shape symbols."""

from __future__ import annotations

import re

import pytest
import torch

import remat
from remat.testing.zoo import TwoLinear
from remat.pipeline import prepare_graph, trace_joint_facts
from remat.passes.plan import make_plan
from remat.report import render_symbolic_sizes
from remat.units import format_bytes


@pytest.fixture(scope="module")
def dynamic_report(tmp_path_factory) -> tuple[str, remat.Plan]:
    """Compile TwoLinear on x (6, 10, 256) with batch and sequence dynamic; the report and the plan."""
    torch.manual_seed(0)
    model, x = TwoLinear(), torch.randn(6, 10, 256)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    dump = tmp_path_factory.mktemp("dump")
    backend = remat.backend(None, dump_dir=dump)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    (record,) = backend.compiled_graphs
    return (dump / record.graph_id / "report.md").read_text(), record.plan


def test_report_names_each_symbol_and_where_it_came_from(dynamic_report):
    report, _ = dynamic_report
    assert "## Sizes as formulas (dynamic shapes)" in report
    assert re.search(r"- `s\d+` = `L\['x'\]\.size\(\)\[0\]`, traced at 6\n", report)
    assert re.search(r"- `s\d+` = `L\['x'\]\.size\(\)\[1\]`, traced at 10\n", report)


def test_saved_activations_formula(dynamic_report):
    report, plan = dynamic_report
    batch = re.search(r"`(s\d+)` = `L\['x'\]\.size\(\)\[0\]`", report).group(1)
    seq = re.search(r"`(s\d+)` = `L\['x'\]\.size\(\)\[1\]`", report).group(1)
    # the min-cut saves fc1's output: B·S·512 fp32 = 2048·B·S bytes = 122.88 kB at 6·10
    symbols = "·".join(sorted([batch, seq]))
    assert f"- saved activations = 2048·{symbols} bytes = 122.88 kB at the traced sizes\n" in report
    assert plan.saved_bytes == 2048 * 6 * 10


def test_peak_formula_evaluates_to_the_predicted_peak(dynamic_report):
    report, plan = dynamic_report
    line = next(l for l in report.splitlines() if l.startswith("- predicted peak (at "))
    assert "·" in line and "the plan counts" not in line and "without a formula" not in line
    assert line.endswith(f"= {format_bytes(plan.predicted_peak_bytes)} at the traced sizes")


def test_static_graphs_get_no_formula_section():
    torch.manual_seed(0)
    model = TwoLinear()
    (facts, joint) = trace_joint_facts(lambda x: model(x).sum(), (torch.randn(6, 10, 256),),
                                       read=lambda j, i, n: (prepare_graph(j, i, n, "cpu").facts, j.graph))[0]
    assert render_symbolic_sizes(make_plan(facts, None), facts, (joint,)) == ""
