"""The dump a person reads: forward.py, backward.py (regions fenced), plan.json, report.md.

Runs the backend's partition step directly on a captured joint graph: no Inductor codegen.
"""

from __future__ import annotations

import ast
import json

import torch

import remat
from joint_graphs import capture_joint

REQUIRED_PLAN_KEYS = {
    "budget_bytes", "predicted_peak_bytes", "no_remat_peak_bytes", "saved_bytes",
    "recompute_flops", "est_extra_time_s", "plan_time_s", "nodes",
}
REQUIRED_NODE_KEYS = {"name", "op", "flops", "bytes", "decision", "reason"}


def mlp(x, *ws):
    for w in ws[:-1]:
        x = torch.tanh(x @ w)
    return (x @ ws[-1]).sum()


def _partition(dump_dir, budget_gb, **options):
    torch.manual_seed(0)
    x = torch.randn(2048, 128)
    ws = [torch.randn(128, 128, requires_grad=True) for _ in range(6)]
    captured = capture_joint(mlp, x, *ws)
    backend = remat.backend(budget_gb, dump_dir=dump_dir, hardware="h100", headroom_fraction=0.0, **options)
    fw, bw = backend.partition(captured.graph_module, [], num_fwd_outputs=captured.num_fwd_outputs)
    return backend, fw, bw


def test_dump_holds_code_plan_and_report(tmp_path):
    backend, _, bw = _partition(tmp_path, 0.005, pareto_points=4)
    (record,) = backend.compiled_graphs
    directory = tmp_path / record.graph_id
    assert record.dump_path == str(directory)
    for name in ("forward.py", "backward.py", "plan.json", "report.md"):
        assert (directory / name).is_file(), name
    backward = (directory / "backward.py").read_text()
    ast.parse(backward)
    ast.parse((directory / "forward.py").read_text())
    assert record.regions, "a 5 MB budget (under the 6.4 MB peak of saving without recomputing) recomputes at least one region"
    for region in record.regions:
        assert f"# ---- recompute region {region.region}: rebuilds" in backward
        assert f"# ---- end of recompute region {region.region}" in backward
    assert "not saved:" in backward
    plan = json.loads((directory / "plan.json").read_text())
    assert REQUIRED_PLAN_KEYS <= plan.keys()
    assert plan["budget_bytes"] == 5_000_000
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    assert plan["nodes"] and all(REQUIRED_NODE_KEYS <= n.keys() for n in plan["nodes"])
    assert {n["decision"] for n in plan["nodes"]} <= {"save", "recompute", "none"}
    assert any(n["decision"] == "recompute" and n["reason"] for n in plan["nodes"])
    report = (directory / "report.md").read_text()
    assert report.startswith(f"# remat report: {record.graph_id}")
    assert "budget 5.00 MB | predicted peak" in report
    assert "## Pareto curve" in report and "knee" in report
    assert f"Pareto curve of {record.graph_id}: no-remat peak" in report   # was "graph 0" for every graph
    # The rewritten backward carries the region tags the dump shows.
    tagged = [n for n in bw.graph.nodes if "remat" in n.meta]
    assert len(tagged) == sum(len(r.nodes) for r in record.regions)


def test_no_dump_dir_writes_nothing(tmp_path):
    backend, _, _ = _partition(None, None)
    assert backend.compiled_graphs[0].dump_path is None
    assert not any(tmp_path.iterdir())


def test_profile_estimator_plans_with_measured_kernel_times(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    backend, _, _ = _partition(None, 0.009, estimator="profile")
    plan = backend.compiled_graphs[0].plan
    assert backend.options.estimator == "profile"
    assert plan.fits_budget and plan.predicted_peak_bytes <= 9_000_000
    assert list((tmp_path / "cache" / "calibration").glob("*.json")), "measured times are cached by graph hash"
