"""remat under torch.distributed (issue 6): DDP and FSDP2 on CPU with gloo, 2 processes.

Each mode is one spawned run of two ranks (``python tests/test_distributed.py --worker``,
127.0.0.1, a free port, killed when the test's time is up). Per rank it compiles the zoo
GPT (4 layers, no dropout: the reference below cannot replay per-rank dropout masks) with
plain Inductor, measures that step's peak, then trains 3 steps with remat at 60% of the
larger rank's plain-Inductor peak (or at the smallest feasible budget the planner names,
recorded, as tests/test_e2e.py does). The parent process trains the same model for the
same 3 steps in one process, eagerly and without remat, on both ranks' batches (the mean of
the ranks' losses, which is what DDP's and FSDP2's gradient averaging computes), and the
tests compare parameters, per-rank peaks and the rewritten backwards.

A single-process test checks collectives directly: a joint graph with functional
all-gathers and reduce-scatters (a "fake" process group, no communication) planned at the
tightest budget never recomputes one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.units import format_gb_up

from remat.testing.distributed_setup import (
    CFG, STEPS, WORLD_SIZE, all_max, batches, make_model, run_ranks, worker_parser, wrap,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="torch.distributed with the gloo backend is not available in this build"),
]

LR = 0.1
BUDGET_FRACTION = 0.6
# Passed explicitly, so the tested budgets do not move with remat's default: the CPU
# simulator's peaks are within ~5% of measured ones (benchmarks/results/memory_accuracy-cpu.md),
# and what the ledger cannot see (the eager loss, FSDP2's eager root) must fit in it.
HEADROOM_FRACTION = 0.05
PARAM_REL_TOL = 1e-5
RUN_TIMEOUT_S = 200


def _fresh_model(name: str = "gpt") -> torch.nn.Module:
    return make_model(name)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- worker (one rank)

def _train(mode: str, backend: Any, measure_steps: tuple[int, ...], model_name: str = "gpt") -> dict[str, Any]:
    """Train STEPS steps of the wrapped, compiled GPT; measure the forward+backward peak of
    ``measure_steps`` (gradients None at their start: the budget covers them).

    The last step is the one measured: the first compiles, and in the second DDP rebuilds its
    gradient buckets in the forward (``Reducer._rebuild_buckets``, a one-time allocation of
    every gradient's bytes that then stays resident), which is no part of a steady step."""
    rank = torch.distributed.get_rank()
    torch._dynamo.reset()
    model = wrap(_fresh_model(model_name), mode)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    peaks, losses = [], []
    for step, ranks in enumerate(batches(model_name)):
        tokens, targets = ranks[rank]
        optimizer.zero_grad(set_to_none=True)

        def forward_backward() -> float:
            loss = _loss(compiled(tokens), targets)
            loss.backward()
            return loss.item()

        if step in measure_steps:
            measured = remat.measure_peak_bytes(forward_backward, "cpu")
            peaks.append(measured.peak_bytes)
            losses.append(measured.result)
        else:
            losses.append(forward_backward())
        optimizer.step()
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name.removeprefix("module.")] = full.detach().clone()
    return {"peaks": peaks, "losses": losses, "params": params}


def worker_main(argv: list[str]) -> None:
    parser = worker_parser()
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=args.rank, world_size=WORLD_SIZE)
    out = Path(args.out)
    times: dict[str, float] = {}
    try:
        start = time.perf_counter()
        plain = _train(args.mode, "inductor", measure_steps=(STEPS - 1,), model_name=args.model)
        times["plain_s"] = time.perf_counter() - start
        plain_peak = all_max(plain["peaks"][0])
        requested_gb = (args.fraction or BUDGET_FRACTION) * plain_peak / 1e9
        budget_gb, smallest_gb, named_gb = requested_gb, None, []
        dump_dir = out / f"dump_rank{args.rank}"
        start = time.perf_counter()
        for attempt in range(args.attempts):
            try:
                extra = {} if args.verify_peak is None else {"verify_peak": args.verify_peak}
                backend = remat.backend(budget_gb, dump_dir=str(dump_dir / f"attempt{attempt}"),
                                        headroom_fraction=HEADROOM_FRACTION, **extra)
                ours = _train(args.mode, backend, measure_steps=(STEPS - 1,), model_name=args.model)
                break
            except remat.BudgetInfeasibleError as error:
                # Both ranks plan the same graphs, so both get here: run at the smallest feasible
                # budget named (the larger rank's), which test_smallest_feasible_budget_fraction refuses.
                # A DDP piece names the budget its own share needs; a later piece can need more.
                print(f"remat refused {budget_gb} GB: {error}", flush=True)
                if attempt == args.attempts - 1:
                    raise
                smallest_gb = float(format_gb_up(all_max(error.min_budget_bytes)))
                budget_gb = smallest_gb
                named_gb.append(smallest_gb)
        times["remat_s"] = time.perf_counter() - start
        graphs = []
        for g in backend.compiled_graphs:
            dist_record = g.distributed
            graphs.append({
                "graph_id": g.graph_id,
                "predicted_peak_bytes": g.plan.predicted_peak_bytes,
                "target_bytes": g.plan.target_bytes,
                "recomputed": len(g.plan.recomputed),
                "dump_path": g.dump_path,
                "share": dist_record.share.to_json() if dist_record and dist_record.share else None,
                "collective_nodes": list(dist_record.collective_nodes) if dist_record else None,
                "recomputed_collectives": list(dist_record.recomputed_collectives) if dist_record else None,
                "region_nodes": [n for r in g.regions for n in r.nodes],
            })
        from torch._dynamo.utils import counters

        result = {
            "rank": args.rank, "mode": args.mode, "plain_peak_bytes": plain["peaks"][0], "plain_peak_max_bytes": plain_peak,
            "requested_budget_gb": requested_gb, "budget_gb": budget_gb, "smallest_feasible_gb": smallest_gb,
            "named_gb": named_gb, "model": args.model,
            "remat_peaks_bytes": ours["peaks"], "losses": ours["losses"], "plain_losses": plain["losses"],
            "graphs": graphs, "times": times, "graph_breaks": sum(counters["graph_break"].values()),
        }
        torch.save({"remat": ours["params"], "plain": plain["params"]}, out / f"params_rank{args.rank}.pt")
        (out / f"result_rank{args.rank}.json").write_text(json.dumps(result, indent=2))
    finally:
        torch.distributed.barrier()  # without it, a rank leaving early can hang the other in gloo
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- parent (pytest)

def _spawn(mode: str, out: Path, extra: tuple[str, ...] = (), timeout_s: float = RUN_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run both ranks; kill both if either fails or the time is up. Returns each rank's result."""
    codes = run_ranks(__file__, ["--mode", mode, "--out", str(out), *extra],
                      [out / f"log_rank{r}.txt" for r in range(WORLD_SIZE)], timeout_s)
    logs = "\n".join(f"--- rank {r} (exit {code}) ---\n" + (out / f"log_rank{r}.txt").read_text()[-4000:]
                     for r, code in enumerate(codes))
    if any(code != 0 for code in codes):
        pytest.fail(f"{mode} run failed or timed out after {timeout_s} s:\n{logs}")
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def _reference_params(model_name: str = "gpt") -> dict[str, torch.Tensor]:
    """The same 3 steps in one process, eager, no remat: the mean of both ranks' losses."""
    model = _fresh_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for ranks in batches(model_name):
        optimizer.zero_grad(set_to_none=True)
        loss = sum(_loss(model(tokens), targets) for tokens, targets in ranks) / WORLD_SIZE
        loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


_RUNS: dict[str, Any] = {}


def _spawned_once(key: str, mode: str, tmp_path_factory: pytest.TempPathFactory, describe: Callable[[dict[str, Any]], str],
                  extra: tuple[str, ...] = (), timeout_s: float = RUN_TIMEOUT_S) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The spawned run of ``mode`` (with ``extra`` arguments), made once per session under ``key``:
    (per-rank results, per-rank params); ``describe(result)`` is printed per rank. A run that failed
    raises its error again in every test that asks for it."""
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"dist_{key}")
        try:
            results = _spawn(mode, out, extra, timeout_s)
            _RUNS[key] = (results, [torch.load(out / f"params_rank{r}.pt") for r in range(WORLD_SIZE)])
            for r in results:
                print(f"{key} rank {r['rank']}: {describe(r)}")
        except BaseException as error:  # noqa: BLE001 - re-raised by every test of this run
            _RUNS[key] = error
    run = _RUNS[key]
    if isinstance(run, BaseException):
        raise run
    return run


def _run(mode: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The spawned run of ``mode``, made once per session: (per-rank results, per-rank params)."""
    return _spawned_once(mode, mode, tmp_path_factory, lambda r: (
        f"plain peak {r['plain_peak_bytes'] / 1e6:.2f} MB, budget {r['budget_gb'] * 1e3:.3f} MB (requested "
        f"{r['requested_budget_gb'] * 1e3:.3f} MB"
        + (f", smallest feasible {r['smallest_feasible_gb'] * 1e3:.3f} MB" if r["smallest_feasible_gb"] else "")
        + f"), measured {[round(p / 1e6, 2) for p in r['remat_peaks_bytes']]} MB, graphs {len(r['graphs'])}, "
        f"times {r['times']}"))


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_parameters_match_single_process_training(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    _, params = _run(mode, tmp_path_factory)
    reference = _reference_params()
    for rank, rank_params in enumerate(params):
        assert rank_params["remat"].keys() == reference.keys()
        errors = {name: _rel_err(rank_params["remat"][name], ref) for name, ref in reference.items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] < PARAM_REL_TOL, f"{mode} rank {rank}: {worst} relative error {errors[worst]:.3g}"


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_measured_peak_per_rank_within_budget(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    results, _ = _run(mode, tmp_path_factory)
    for r in results:
        budget_bytes = r["budget_gb"] * 1e9
        assert r["remat_peaks_bytes"], "no peak was measured"
        for peak in r["remat_peaks_bytes"]:
            assert peak <= budget_bytes, (
                f"{mode} rank {r['rank']}: measured peak {peak / 1e6:.3f} MB > budget {budget_bytes / 1e6:.3f} MB "
                f"(plain Inductor {r['plain_peak_bytes'] / 1e6:.3f} MB)")
        # remat recomputed, and the step peaks lower than plain Inductor's, under a budget below it.
        assert any(g["recomputed"] > 0 for g in r["graphs"])
        assert max(r["remat_peaks_bytes"]) < r["plain_peak_bytes"]
        assert budget_bytes < r["plain_peak_bytes"]


# The per-rank budget each mode runs at, as a fraction of plain Inductor's peak: both run at the
# 60% the issue asks for (5% headroom, the saved-bytes cap). On a 2-layer GPT FSDP2 stopped at
# 65-68%: its own gathered parameters and buffers were a third of the budget (README).
SMALLEST_FRACTION_BOUND = {"ddp": 0.60, "fsdp2": 0.60}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_smallest_feasible_budget_fraction(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The budget the run used (60% of plain Inductor's peak, or the smallest feasible one the
    planner named when 60% was refused) stays within the mode's recorded bound."""
    results, _ = _run(mode, tmp_path_factory)
    for r in results:
        fraction = r["budget_gb"] * 1e9 / r["plain_peak_max_bytes"]
        # 60% itself, not a smallest budget named after refusing it
        assert r["smallest_feasible_gb"] is None, f"{mode} refused 60%, named {r['smallest_feasible_gb']} GB"
        assert fraction <= SMALLEST_FRACTION_BOUND[mode] + 1e-3, (
            f"{mode} rank {r['rank']}: smallest feasible budget {r['budget_gb'] * 1e3:.3f} MB is {fraction:.1%} of plain "
            f"Inductor's peak {r['plain_peak_max_bytes'] / 1e6:.3f} MB (bound {SMALLEST_FRACTION_BOUND[mode]:.0%})")
        if r["smallest_feasible_gb"] is None:
            assert r["budget_gb"] == r["requested_budget_gb"]


def test_ddp_budget_split_across_pieces(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The DDP optimizer split the step into pieces; each got a share, written to its dump."""
    results, _ = _run("ddp", tmp_path_factory)
    for r in results:
        shares = [g["share"] for g in r["graphs"]]
        assert len(shares) >= 2 and all(s is not None and s["kind"] == "ddp" for s in shares)
        assert [s["index"] for s in shares] == list(range(len(shares)))
        assert all(s["count"] == len(shares) for s in shares)
        step_target = shares[0]["step_target_bytes"]
        for s, g in zip(shares, r["graphs"]):
            assert g["target_bytes"] == max(s["target_bytes"], 1) and 0 < s["target_bytes"] < step_target
            assert g["predicted_peak_bytes"] <= g["target_bytes"]
            # What earlier pieces hold is on the ledger: only the first piece starts from none.
            assert (s["held_before_bytes"] == 0) == (s["index"] == 0)
            report = Path(g["dump_path"], "report.md").read_text()
            assert "## Distributed budget split" in report and f"DDP piece {s['index'] + 1} of {s['count']}" in report
            assert json.loads(Path(g["dump_path"], "plan.json").read_text())["distributed"] == s


def test_fsdp2_unit_graph_shared_by_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """On torch 2.13 FSDP2's hooks are dynamo-disabled: each block compiles as one graph that
    every block runs; its target divides the room by the number of blocks."""
    results, _ = _run("fsdp2", tmp_path_factory)
    for r in results:
        shares = [g["share"] for g in r["graphs"]]
        assert shares and all(s is not None and s["kind"] == "fsdp2" and s["repeats"] == CFG.n_layers for s in shares)
        # FSDP2's memory read from its state: a block's unsharded parameters (fp32) are what
        # is prefetched and reduce-scattered from; each rank keeps half of them as gradients.
        block_bytes = 4 * sum(p.numel() for p in _fresh_model().blocks[0].parameters())
        for s in shares:
            assert s["prefetch_bytes"] == s["rs_buffer_bytes"] == block_bytes and s["rs_buffers"] == 1
            assert s["later_run_bytes"] == block_bytes // WORLD_SIZE  # every dim 0 of a block is even: no padding
            assert s["outside_bytes"] > 2 * block_bytes and s["first_prefetch_bytes"] == 0


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_no_collective_recomputed(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    results, _ = _run(mode, tmp_path_factory)
    for r in results:
        for g in r["graphs"]:
            assert g["recomputed_collectives"] == []
            # On torch 2.13 DDP's all-reduces (C++ reducer hooks) and FSDP2's all-gathers and
            # reduce-scatters (dynamo-disabled hooks) all run outside the compiled graphs.
            assert g["collective_nodes"] == []


# ---------------------------------------------------------------- a model that is not the zoo GPT

# PostLNTiedLM (3 post-LN blocks, hand-written attention, a head tied to the embedding) under DDP at
# 60% of plain Inductor's peak and under FSDP2 (each block and the model sharded) at 45%: refused,
# the run retries once, at the first budget named, as a user would, with remat's defaults (the
# feedback loop on). Measured: DDP named 73% of plain Inductor's peak, FSDP2 68% (70% itself is
# accepted under FSDP2 and measures 56%); FSDP2's step measures under 70% of plain's.
POSTLN_ARGS = {"ddp": ("--model", "postln", "--fraction", "0.6", "--attempts", "2"),
               "fsdp2": ("--model", "postln", "--fraction", "0.45", "--attempts", "2")}
POSTLN_MEASURED_BOUND = {"fsdp2": 0.70}   # the step peak measured, as a fraction of plain Inductor's
POSTLN_TIMEOUT_S = 900


def _postln_run(mode: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The spawned run of PostLNTiedLM under ``mode`` (POSTLN_ARGS), made once per session."""
    return _spawned_once(f"postln-{mode}", mode, tmp_path_factory, lambda r: (
        f"plain {r['plain_peak_bytes']} B, requested {r['requested_budget_gb']} GB, named {r['named_gb']}, "
        f"measured {r['remat_peaks_bytes']} B at {r['budget_gb']} GB, times {r['times']}"),
        POSTLN_ARGS[mode], POSTLN_TIMEOUT_S)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_postln_tied_lm_first_named_budget_is_accepted(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The budget (a fraction of plain Inductor's peak) is refused (a piece or unit names its
    budget) or accepted; retried at the first budget named, every graph is accepted, and training
    matches one process's."""
    results, params = _postln_run(mode, tmp_path_factory)
    for r in results:
        assert len(r["named_gb"]) <= 1, f"the first budget named was refused: {r['named_gb']}"
        assert r["graphs"] and all(g["share"] and g["share"]["kind"] == mode for g in r["graphs"])
        if mode == "ddp":
            assert len(r["graphs"]) >= 2
        else:   # one graph for the block class, run by each of the 3 blocks
            assert all(g["share"]["repeats"] == len(_fresh_model("postln").blocks) for g in r["graphs"])
        assert r["remat_peaks_bytes"] and r["budget_gb"] * 1e9 < r["plain_peak_bytes"]
        assert any(g["recomputed"] > 0 for g in r["graphs"])
    reference = _reference_params("postln")
    for rank_params in params:
        errors = {name: _rel_err(rank_params["remat"][name], ref) for name, ref in reference.items()}
        assert max(errors.values()) < PARAM_REL_TOL, errors


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_postln_tied_lm_measures_within_the_budget(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    results, _ = _postln_run(mode, tmp_path_factory)
    for r in results:
        for peak in r["remat_peaks_bytes"]:
            assert peak <= r["budget_gb"] * 1e9, (
                f"{mode} rank {r['rank']}: measured {peak} B over the budget {r['budget_gb']} GB (plans predicted "
                f"{[g['predicted_peak_bytes'] for g in r['graphs']]} B)")
            bound = POSTLN_MEASURED_BOUND.get(mode)
            assert bound is None or peak <= bound * r["plain_peak_max_bytes"], (
                f"{mode} rank {r['rank']}: measured {peak} B, over {bound:.0%} of plain Inductor's "
                f"{r['plain_peak_max_bytes']} B")


# ---------------------------------------------------------------- the split, on plain numbers

MB = 1_000_000


def _same(budget_bytes: int) -> int:
    """The budget-to-step-target rule with no headroom: the step target is the budget."""
    return budget_bytes


def test_split_shares_are_proportional_and_never_exceed_the_room() -> None:
    from remat.distributed import split_shares

    assert split_shares(9 * MB, (3, 2, 1)) == (4_500_000, 3_000_000, 1_500_000)
    assert split_shares(10, (0, 0)) == (5, 5)
    assert split_shares(-5, (1, 1)) == (0, 0)
    assert sum(split_shares(10, (1, 1, 1))) <= 10


def test_piece_target_from_the_ledger() -> None:
    from remat.distributed import piece_target

    # T = 10 MB, parameter gradients G = 1 MB (0.3 MB of them this piece's), needs 3:2:1 of the
    # 9 MB left: later pieces reserve 3 + 1.5 MB; room = 10 - 0.001 (input) - 0.7 (later grads).
    first = piece_target(step_target_bytes=10 * MB, index=0, needs=(3, 2, 1), held_before_bytes=0,
                         input_activation_bytes=1000, total_grad_bytes=MB, grads_so_far_bytes=300_000)
    assert (first.reserved_later_bytes, first.later_grad_bytes) == (4_500_000, 700_000)
    assert first.target_bytes == 10 * MB - 1000 - 700_000 - 4_500_000
    # The second piece: what the first holds is on the ledger.
    second = piece_target(step_target_bytes=10 * MB, index=1, needs=(3, 2, 1), held_before_bytes=2 * MB,
                          input_activation_bytes=MB, total_grad_bytes=MB, grads_so_far_bytes=600_000)
    assert second.target_bytes == 10 * MB - 2 * MB - MB - 400_000 - 1_500_000
    # A graph run 4 times per step stacks what each run holds: r * (p + a) <= room + a.
    unit = piece_target(step_target_bytes=10 * MB, index=0, needs=(1,), held_before_bytes=0, input_activation_bytes=MB // 4,
                        total_grad_bytes=0, grads_so_far_bytes=0, outside_bytes=2 * MB, repeats=4, kind="fsdp2")
    assert unit.target_bytes == (10 * MB - 2 * MB) // 4 - MB // 4
    with pytest.raises(ValueError, match="outside the 3 pieces"):
        piece_target(step_target_bytes=MB, index=3, needs=(1, 1, 1), held_before_bytes=0, input_activation_bytes=0,
                     total_grad_bytes=0, grads_so_far_bytes=0)


def test_a_parameter_two_pieces_read_counts_as_a_later_gradient_until_the_first_piece() -> None:
    """A tied embedding and head (pieces 0 and 2): the head's part of the gradient is made in piece 2's
    backward and held by the autograd engine until piece 0's adds to it, so it is a later gradient for
    pieces 0 and 1; a parameter only piece 1 reads is one for piece 0 only."""
    from torch import fx

    from remat._torch_distributed import later_param_bytes

    tied, own = torch.nn.Parameter(torch.zeros(10, 4)), torch.nn.Parameter(torch.zeros(3))
    frozen = torch.nn.Parameter(torch.zeros(100), requires_grad=False)
    graph = fx.Graph()
    x, w, b, f = (graph.placeholder(name) for name in ("x", "w", "b", "f"))
    w.meta["example_value"], b.meta["example_value"], f.meta["example_value"] = tied, own, frozen
    h = graph.call_module("submod_0", (x, w, f))
    h = graph.call_module("submod_1", (h, b))
    graph.output(graph.call_module("submod_2", (h, w)))
    pieces = [(f"submod_{k}", torch.nn.Identity()) for k in range(3)]
    split = fx.GraphModule(dict(pieces), graph)
    assert later_param_bytes(split, pieces) == (160 + 12, 160, 0)
    # pieces already compiled are renamed, in the graph and in the module alike
    renamed = [("compiled_submod_0", torch.nn.Identity())] + pieces[1:]
    for node in graph.find_nodes(op="call_module"):
        node.target = "compiled_" + node.target if node.target == "submod_0" else node.target
    assert later_param_bytes(fx.GraphModule(dict(renamed), graph), renamed) == (160 + 12, 160, 0)


def test_admits_checks_own_runs_and_the_later_pieces_reserve() -> None:
    from remat.distributed import piece_target

    share = piece_target(step_target_bytes=10 * MB, index=0, needs=(1, 1), held_before_bytes=0, input_activation_bytes=0,
                         total_grad_bytes=0, grads_so_far_bytes=0)
    assert share.reserved_later_bytes == 5 * MB and share.loose_target_bytes == 10 * MB
    assert share.admits(held_bytes=5 * MB, peak_bytes=10 * MB)
    assert not share.admits(held_bytes=5 * MB + 1, peak_bytes=6 * MB)   # leaves the later piece too little
    assert not share.admits(held_bytes=MB, peak_bytes=10 * MB + 1)      # its own peak is over
    # The safe target admits every plan that meets it (what a plan holds is live at its peak).
    assert share.admits(held_bytes=share.target_bytes, peak_bytes=share.target_bytes)
    unit = piece_target(step_target_bytes=10 * MB, index=0, needs=(1,), held_before_bytes=0, input_activation_bytes=0,
                        total_grad_bytes=0, grads_so_far_bytes=0, repeats=3, kind="fsdp2")
    assert unit.admits(held_bytes=2 * MB, peak_bytes=6 * MB) and not unit.admits(held_bytes=2 * MB, peak_bytes=6 * MB + 1)


def test_fsdp2_runs_stack_held_bytes_forward_and_leftovers_of_later_runs_backward() -> None:
    """Run k of r peaks next to k earlier runs' held bytes and r-1-k later runs' sharded
    gradients plus at most ``rs_buffers`` reduce-scatter buffers: the worst run decides."""
    from remat.distributed import piece_target

    unit = piece_target(step_target_bytes=10 * MB, index=0, needs=(1,), held_before_bytes=0, input_activation_bytes=MB // 10,
                        total_grad_bytes=0, grads_so_far_bytes=0, outside_bytes=2 * MB, repeats=3, kind="fsdp2",
                        later_run_bytes=MB // 2, rs_buffer_bytes=MB, rs_buffers=1, prefetch_bytes=MB // 4)
    assert [unit.later_runs_bytes(j) for j in range(3)] == [0, 1_500_000, 2 * MB]
    # Holding little, the first run is the worst (it peaks next to two later runs' leftovers,
    # and nothing is prefetched before it): 0.1 input + 5.9 peak + 2 leftovers + 2 outside = 10 MB.
    assert unit.runs_peak_bytes(held_bytes=100_000, peak_bytes=5_900_000) == 8 * MB
    assert unit.admits(held_bytes=100_000, peak_bytes=5_900_000)
    assert not unit.admits(held_bytes=100_000, peak_bytes=5_900_001)
    # Holding much, the last run is: 2 held + input + peak + the unit prefetched before it.
    assert unit.runs_peak_bytes(held_bytes=2 * MB, peak_bytes=3 * MB) == 4 * MB + 100_000 + 3 * MB + MB // 4
    # The safe target admits every plan meeting it with held <= input + peak, at every run.
    t = unit.target_bytes
    assert unit.admits(held_bytes=t + MB // 10, peak_bytes=t) and not unit.admits(held_bytes=t + MB // 10, peak_bytes=t + 3)
    # Nothing held, the loose target leaves room for the input and the leftovers only.
    assert unit.loose_target_bytes == 10 * MB - 2 * MB - MB // 10 - 2 * MB
    # A unit of another class may be prefetched during the first run's backward.
    other = piece_target(step_target_bytes=10 * MB, index=0, needs=(1,), held_before_bytes=0, input_activation_bytes=0,
                         total_grad_bytes=0, grads_so_far_bytes=0, repeats=1, kind="fsdp2", first_prefetch_bytes=MB)
    assert other.target_bytes == 9 * MB and other.runs_peak_bytes(0, MB) == 2 * MB


def test_fit_plan_takes_the_largest_admitted_target_and_restates_infeasibility() -> None:
    from types import SimpleNamespace

    from remat.distributed import piece_target
    from remat.distributed_fit import FIT_ROUNDS, fit_plan

    share = piece_target(step_target_bytes=10 * MB, index=0, needs=(1, 1), held_before_bytes=0, input_activation_bytes=0,
                         total_grad_bytes=0, grads_so_far_bytes=0)

    def planner(budget_bytes):
        def plan_at(target):  # a plan that peaks at its target and holds 60% of it, feasible from 2 MB
            if target < 2 * MB:  # the planner names its smallest peak, as make_plan does
                raise remat.BudgetInfeasibleError("x", budget_bytes=budget_bytes, min_feasible_bytes=2 * MB,
                                                  min_budget_bytes=2 * MB * budget_bytes // target, reasons=("r",))
            return SimpleNamespace(predicted_peak_bytes=target, held=int(0.6 * target))
        return plan_at

    plan, fitted = fit_plan(share, lambda p: p.held, planner(10 * MB), budget_bytes=10 * MB, target_for_budget=_same,
                           calibrate=False)
    # Holding 60% of its peak, the first piece may peak up to 5 / 0.6 = 8.33 MB; FIT_ROUNDS halvings
    # of [5, 10] MB land within 5 MB / 2**FIT_ROUNDS below it.
    assert share.target_bytes == 5 * MB < fitted.target_bytes <= 8_333_333
    assert fitted.target_bytes >= 8_333_333 - 5 * MB // 2**FIT_ROUNDS and share.admits(plan.held, plan.predicted_peak_bytes)
    tight = piece_target(step_target_bytes=MB, index=0, needs=(1, 1), held_before_bytes=0, input_activation_bytes=0,
                         total_grad_bytes=0, grads_so_far_bytes=0)
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        fit_plan(tight, lambda p: p.held, planner(MB), budget_bytes=MB, target_for_budget=_same, calibrate=False)
    # The smallest-peak plan (2 MB, holding 1.2 MB) fits its own peak from a 2 MB step, but what
    # it holds next to the later piece's half of the step needs 1.2 + T / 2 <= T: a 2.4 MB step.
    assert abs(info.value.min_budget_bytes - 2_400_000) <= 1 and "holds 1.20 MB" in str(info.value)
    assert info.value.min_feasible_bytes == 2 * MB   # the smallest peak, next to the budget to pass

    def planner_from_3_5_mb(target):  # feasible from 3.5 MB only, holding 60% of its peak
        if target < 3_500_000:
            raise remat.BudgetInfeasibleError("x", budget_bytes=4 * MB, min_feasible_bytes=3_500_000,
                                              min_budget_bytes=3_500_000 * 4 * MB // target, reasons=("r",))
        return SimpleNamespace(predicted_peak_bytes=target, held=int(0.6 * target))

    def planner_from_8_3_mb(target):  # feasible from 8.3 MB only: admitted between 8.3 and 8.33 MB
        if target < 8_300_000:
            raise remat.BudgetInfeasibleError("x", budget_bytes=10 * MB, min_feasible_bytes=8_300_000,
                                              min_budget_bytes=8_300_000 * 10 * MB // target, reasons=("r",))
        return SimpleNamespace(predicted_peak_bytes=target, held=int(0.6 * target))

    # The bisection steps over that window; the smallest-peak plan is in it and is taken.
    plan, fitted = fit_plan(share, lambda p: p.held, planner_from_8_3_mb, budget_bytes=10 * MB, target_for_budget=_same,
                            calibrate=False)
    assert 8_300_000 <= plan.predicted_peak_bytes <= 8_333_333 and share.admits(plan.held, plan.predicted_peak_bytes)

    # At 4 MB (half reserved for the later piece) no plan is admitted next to the reserve: the
    # smallest-peak plan (3.5 MB, holding 2.1 MB) needs held + T / 2 <= T, a 4.2 MB step. The
    # reserve is an estimate, not a condition: its own run fits, so it is taken, and says so.
    squeezed = piece_target(step_target_bytes=4 * MB, index=0, needs=(1, 1), held_before_bytes=0, input_activation_bytes=0,
                            total_grad_bytes=0, grads_so_far_bytes=0)
    plan, fitted = fit_plan(squeezed, lambda p: p.held, planner_from_3_5_mb, budget_bytes=4 * MB,
                            target_for_budget=_same, calibrate=False)
    assert plan.predicted_peak_bytes == 3_500_000 and not squeezed.admits(plan.held, plan.predicted_peak_bytes)
    assert fitted.reserve_met is False and "the plan near the smallest peak that holds least" in fitted.explain()
    # At 3 MB its own run does not fit: refused, naming the step the reserve admits it at (its
    # smallest plan next to the later piece's estimated half), 4.2 MB.
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        fit_plan(piece_target(step_target_bytes=3 * MB, index=0, needs=(1, 1), held_before_bytes=0,
                              input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0),
                 lambda p: p.held, planner_from_3_5_mb, budget_bytes=3 * MB, target_for_budget=_same, calibrate=False)
    assert abs(info.value.min_budget_bytes - 4_200_000) <= 1 and "holds 2.10 MB" in str(info.value)  # shares round down


def test_a_budget_named_at_the_loose_target_is_accepted_when_the_planner_is_not_monotone() -> None:
    """The planner is a heuristic: asked for a target it can fail while a plan made for a higher
    target peaks under it (GPT-2's body: refused at a 5.00 MB loose target, while the plan made for
    5.38 MB peaked at exactly 5.00 MB). The refusal names the budget from those near-smallest plans;
    retried there, the same plans are admitted, though the loose target still does not plan."""
    from types import SimpleNamespace

    from remat.distributed import piece_target
    from remat.distributed_fit import fit_plan

    def plan_at(target):  # nothing under 5.2 MB; the plans from 5.2 MB on peak at 5 MB (or their target from 6 MB)
        if target < 5_200_000:
            raise remat.BudgetInfeasibleError("x", budget_bytes=target, min_feasible_bytes=5 * MB,
                                              min_budget_bytes=5 * MB, reasons=("r",))
        return SimpleNamespace(predicted_peak_bytes=5 * MB if target < 6 * MB else target, held=MB)

    def share_at(step_target_bytes):  # alone in its step: the loose target is the whole step target
        return piece_target(step_target_bytes=step_target_bytes, index=0, needs=(1,), held_before_bytes=0,
                            input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0)

    with pytest.raises(remat.BudgetInfeasibleError) as info:
        fit_plan(share_at(4 * MB), lambda p: p.held, plan_at, budget_bytes=4 * MB, target_for_budget=_same,
                 calibrate=False)
    named = info.value.min_budget_bytes
    assert named == 5 * MB and share_at(named).loose_target_bytes < 5_200_000   # the loose target does not plan
    plan, fitted = fit_plan(share_at(named), lambda p: p.held, plan_at, budget_bytes=named, target_for_budget=_same,
                            calibrate=False)
    assert plan.predicted_peak_bytes == 5 * MB and fitted.reserve_met


def test_fit_plan_asks_for_a_plan_holding_less_when_the_share_refuses_what_one_holds() -> None:
    from types import SimpleNamespace

    from remat.distributed import piece_target
    from remat.distributed_fit import fit_plan

    share = piece_target(step_target_bytes=10 * MB, index=0, needs=(1, 1), held_before_bytes=0, input_activation_bytes=0,
                         total_grad_bytes=0, grads_so_far_bytes=0)
    # Half the step is reserved for the later piece: whatever peaks at 9 MB may hold at most 5 MB.
    assert share.largest_held_bytes(9 * MB) == 5 * MB and share.admits(5 * MB, 9 * MB)
    assert not share.admits(5 * MB + 1, 9 * MB) and share.largest_held_bytes(11 * MB) == -1
    asked = []

    def plan_at(target, saved_cap_bytes=None):  # peaks at its target; holds 90% of it unless capped
        held = int(0.9 * target) if saved_cap_bytes is None else min(int(0.9 * target), saved_cap_bytes)
        asked.append(saved_cap_bytes)
        return SimpleNamespace(predicted_peak_bytes=target, held=held, saved_bytes=held)

    loose = share.loose_target_bytes
    plan, fitted = fit_plan(share, lambda p: p.held, plan_at, budget_bytes=10 * MB, target_for_budget=_same,
                            calibrate=False, plan_capped=plan_at)
    # The loose target's plan holds 9 MB, refused; the same target capped at 5 MB is admitted.
    assert fitted.target_bytes == loose and plan.predicted_peak_bytes == loose
    assert asked == [None, share.largest_held_bytes(loose)] and share.admits(plan.held, plan.predicted_peak_bytes)
    # Without plan_capped the bisection has to lower the peak until 90% of it is under 5 MB.
    plan, fitted = fit_plan(share, lambda p: p.held, plan_at, budget_bytes=10 * MB, target_for_budget=_same, calibrate=False)
    assert plan.predicted_peak_bytes <= 5 * MB / 0.9 + 1


def test_calibrate_reserve_scales_later_needs_by_this_pieces_smallest_peak() -> None:
    from remat.distributed import piece_target
    from remat.distributed_fit import calibrate_reserve

    # Needs 4 MB and 12 MB of forward tensors; this piece's smallest peak is 2 MB (half its
    # need), so the later piece is estimated at 6 MB: the reserve drops from 7.5 to 6 MB.
    share = piece_target(step_target_bytes=10 * MB, index=0, needs=(4 * MB, 12 * MB), held_before_bytes=0,
                         input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0)

    def plan_at(target):
        raise remat.BudgetInfeasibleError("x", budget_bytes=10 * MB, min_feasible_bytes=2 * MB,
                                          min_budget_bytes=2 * MB * 10 * MB // target, reasons=())

    assert share.reserved_later_bytes == 7_500_000
    calibrated = calibrate_reserve(share, plan_at, budget_bytes=10 * MB)
    assert calibrated.later_estimate_bytes == 6 * MB and calibrated.own_floor_bytes == 2 * MB
    # The reserve: the estimate, plus the later piece's part (12 of 16) of what is left once both
    # floors are met (10 - 2 - 6 MB). One shrink ratio for every piece gives the proportional split.
    assert calibrated.reserved_later_bytes == 6 * MB + 2 * MB * 12 // 16 == share.reserved_later_bytes
    # The estimate is absolute bytes: at 20 MB the surplus is 12 MB, 9 of it reserved.
    assert calibrated.at(20 * MB).reserved_later_bytes == 6 * MB + 9 * MB
    assert calibrate_reserve(calibrated.at(20 * MB), plan_at, 10 * MB).later_estimate_bytes == 6 * MB
    last = piece_target(step_target_bytes=10 * MB, index=1, needs=(4 * MB, 12 * MB), held_before_bytes=MB,
                        input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0)
    assert calibrate_reserve(last, plan_at, 10 * MB) is last

    # Three pieces of need 4, 4 and 8 MB; this one's smallest-peak plan peaks at 2 MB and holds
    # 1 MB (ratios 1/2 and 1/4). Piece 3 is estimated to peak at 4 MB next to piece 2's 1 MB
    # held: a 5 MB reserve (the proportional shares reserved 2 + 4 MB).
    three = piece_target(step_target_bytes=8 * MB, index=0, needs=(4 * MB, 4 * MB, 8 * MB), held_before_bytes=0,
                         input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0)
    from types import SimpleNamespace

    def plan_at_with_held(target):
        if target < 2 * MB:
            raise remat.BudgetInfeasibleError("x", budget_bytes=8 * MB, min_feasible_bytes=2 * MB,
                                              min_budget_bytes=2 * MB * 8 * MB // target, reasons=())
        return SimpleNamespace(predicted_peak_bytes=2 * MB, held=MB, no_remat_peak_bytes=2 * MB)

    assert three.reserved_later_bytes == 6 * MB
    estimated = calibrate_reserve(three, plan_at_with_held, 8 * MB, held_of=lambda p: p.held)
    # ... plus 12/16 of the 8 - 2 - 5 MB left: 5.75 MB (the proportional shares reserved 6 MB).
    assert estimated.later_estimate_bytes == 5 * MB and estimated.reserved_later_bytes == 5_750_000
    # Without what it holds, the held ratio is bounded by the peak's: 4 + 2 = 6 MB, nothing left.
    assert calibrate_reserve(three, plan_at_with_held, 8 * MB).reserved_later_bytes == 6 * MB


def test_reserve_stops_growing_at_the_later_pieces_ceiling() -> None:
    """Past the later pieces' estimated demand with no recomputation, a larger budget goes to this piece."""
    from types import SimpleNamespace

    from remat.distributed import piece_target
    from remat.distributed_fit import calibrate_reserve

    # Needs 2 and 12 MB; the smallest plan peaks at 1 MB (ratio 1/2: the later piece estimated at
    # 6 MB) and holds 0.5 MB; without recomputation it peaks at 2 MB (ratio 1: a 12 MB ceiling).
    def plan_at(target):
        if target < MB:
            raise remat.BudgetInfeasibleError("x", budget_bytes=10 * MB, min_feasible_bytes=MB,
                                              min_budget_bytes=MB, reasons=())
        return SimpleNamespace(predicted_peak_bytes=MB, held=MB // 2, no_remat_peak_bytes=2 * MB)

    def share_at(step_target_bytes):
        return piece_target(step_target_bytes=step_target_bytes, index=0, needs=(2 * MB, 12 * MB), held_before_bytes=0,
                            input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0)

    calibrated = calibrate_reserve(share_at(10 * MB), plan_at, 10 * MB, held_of=lambda p: p.held)
    assert calibrated.later_estimate_bytes == 6 * MB and calibrated.later_ceiling_bytes == 12 * MB
    # 10 MB: the estimate plus 12/14 of the 10 - 1 - 6 MB left over
    assert calibrated.reserved_later_bytes == 6 * MB + 3 * MB * 12 // 14
    # 40 MB: 6 + 12/14 * 33 MB would be reserved; the ceiling stops it at 12 MB
    assert calibrated.at(40 * MB).reserved_later_bytes == 12 * MB and calibrated.at(40 * MB).target_bytes == 28 * MB
    recalibrated = calibrate_reserve(share_at(40 * MB), plan_at, 40 * MB, held_of=lambda p: p.held)
    assert recalibrated.reserved_later_bytes == 12 * MB


def test_a_refused_piece_names_the_budget_at_which_the_earlier_pieces_replanned_admit_it() -> None:
    """Piece 1 of 2 is refused at a 4 MB step: piece 0 holds half of whatever it peaks at, and it
    peaks at what it is given. Named from what piece 0 holds now (2 MB), 5 MB would be refused
    again (piece 0 then holds 2.5 MB: issue 12's chain of four refusals); replaying piece 0 at
    each budget tried names 6 MB, and retrying there, as a user would, admits both pieces."""
    from types import SimpleNamespace

    from remat.distributed import StepLedger, piece_target
    from remat.distributed_fit import REPLAY_STEP, fit_plan

    def first_piece(target):      # any target from 1 MB: peaks at it, holds half of it
        if target < MB:
            raise remat.BudgetInfeasibleError("x", budget_bytes=MB, min_feasible_bytes=MB, min_budget_bytes=MB,
                                              reasons=())
        return SimpleNamespace(predicted_peak_bytes=target, held=target // 2)

    def last_piece(target):       # 3 MB or nothing, holding nothing
        if target < 3 * MB:
            raise remat.BudgetInfeasibleError("x", budget_bytes=MB, min_feasible_bytes=3 * MB, min_budget_bytes=3 * MB,
                                              reasons=("r",))
        return SimpleNamespace(predicted_peak_bytes=3 * MB, held=0)

    def step(budget, ledger):
        first, _ = fit_plan(piece_target(step_target_bytes=budget, index=0, needs=(1, 1), held_before_bytes=0,
                                         input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0),
                            lambda p: p.held, first_piece, budget, _same, calibrate=False, ledger=ledger)
        last_share = piece_target(step_target_bytes=budget, index=1, needs=(1, 1), held_before_bytes=first.held,
                                  input_activation_bytes=0, total_grad_bytes=0, grads_so_far_bytes=0)
        return first, fit_plan(last_share, lambda p: p.held, last_piece, budget, _same, calibrate=False, ledger=ledger)

    with pytest.raises(remat.BudgetInfeasibleError) as info:
        step(4 * MB, StepLedger())
    named = info.value.min_budget_bytes
    assert 6 * MB <= named <= 6 * MB + 2 * (6 * MB // REPLAY_STEP), named
    assert "earlier piece(s) plan at larger targets and hold more" in str(info.value)
    with pytest.raises(remat.BudgetInfeasibleError):   # named from what piece 0 holds at 4 MB
        step(5 * MB, StepLedger())
    first, (last, _) = step(named, StepLedger())
    assert first.held + last.predicted_peak_bytes <= named


# ---------------------------------------------------------------- single process: collectives in the graph

@pytest.fixture
def fake_process_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


class _GatheringMLP(torch.nn.Module):
    """Linear layers with a differentiable all-gather after every other one (its backward is
    a reduce-scatter): the joint graph holds functional collectives and their waits."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        for i, layer in enumerate(self.layers):
            x = F.gelu(layer(x))
            if i % 2 == 0:
                gathered = funcol.all_gather_tensor_autograd(x, 0, self.group)
                # silu's backward reads the gathered tensor itself: recomputing it from x
                # (half its size) is what an unconstrained planner would pick at a tight budget
                x = F.silu(gathered).view(WORLD_SIZE, -1, 256).sum(0)
        return x


def test_collectives_in_the_joint_graph_are_never_recomputed(fake_process_group: Any) -> None:
    from remat.pipeline import trace_joint_facts
    from remat.passes.joint_graph import is_collective

    torch.manual_seed(0)
    model, x = _GatheringMLP(fake_process_group), torch.randn(512, 256)
    # The smallest-peak plan remat finds (best effort at a 1-byte budget): it recomputes all it can.
    backend = remat.backend(1e-9, best_effort=True)

    def plan_and_rewrite(joint, joint_inputs, num_fwd_outputs):
        collectives = [n.name for n in joint.graph.nodes if is_collective(n)]
        with pytest.warns(UserWarning, match="cannot be met"):
            fw, bw = backend.partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs)
        return collectives, fw, bw

    (collectives, fw, bw), = trace_joint_facts(model, (x,), read=plan_and_rewrite)
    ops = {str(n.target) for n in list(fw.graph.nodes) + list(bw.graph.nodes) if is_collective(n)}
    assert {"_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.reduce_scatter_tensor.default",
            "_c10d_functional.wait_tensor.default"} <= ops
    (record,) = backend.compiled_graphs
    plan = record.plan
    assert plan.recomputed, "the plan recomputes nothing: the test would not exercise the ban"
    assert not set(collectives) & set(plan.recomputed)
    assert record.distributed is not None and record.distributed.recomputed_collectives == ()
    from remat.passes.rewrite import REMAT_KEY

    region_nodes = [n for n in bw.graph.nodes if REMAT_KEY in n.meta]
    assert region_nodes and not any(is_collective(n) for n in region_nodes)


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.argv.remove("--worker")
    worker_main(sys.argv[1:])
