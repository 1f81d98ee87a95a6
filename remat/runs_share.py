"""The share of a graph alone in its step that runs several times before its backwards, or next to gradients
earlier backwards of the step left (``StepAccount.share_for``; the feedback loop measures both:
``window_runs.py``, ``accumulated_grads.py``), and the peak its runs are predicted to stack to."""

from __future__ import annotations

from .distributed import GraphShare, piece_target


def runs_share(step_target_bytes: int, input_activation_bytes: int, param_grad_bytes: int, need_bytes: int,
               runs: int, accumulated_grad_bytes: int = 0) -> GraphShare:
    """The share of a graph alone in its step that runs ``runs`` times before their backwards (the same module
    called several times in a step; one compiled block run once per layer), kind "runs": ``piece_target`` with
    ``repeats=runs``, each later run (its backward ran first) keeping its parameters' gradients. Run k peaks
    next to the k earlier runs' held bytes: ``GraphShare.runs_peak_bytes``. Shared parameters (one module
    called twice) keep one set of gradients where this counts one per later run: conservative there.
    ``accumulated_grad_bytes``: gradients earlier backwards of the step left in the parameters, held through
    the whole run (gradient accumulation, ``accumulated_grads.py``): memory outside the graph (kind
    "accumulated" for a graph run once, whose inputs are the batch, resident at the step's start as a graph's
    alone in its step with no share are)."""
    return piece_target(step_target_bytes=step_target_bytes, index=0, needs=(need_bytes,), held_before_bytes=0,
                        input_activation_bytes=input_activation_bytes if runs > 1 else 0,
                        total_grad_bytes=param_grad_bytes,
                        grads_so_far_bytes=param_grad_bytes, repeats=runs, kind="runs" if runs > 1 else "accumulated",
                        later_run_bytes=param_grad_bytes, own_grad_bytes=param_grad_bytes,
                        outside_bytes=accumulated_grad_bytes)


def stacked_peak_bytes(held_bytes: int, input_activation_bytes: int, param_grad_bytes: int, peak_bytes: int,
                       runs: int) -> int:
    """The predicted peak of ``runs`` runs of one plan stacked in a step (``runs_share``'s rule): the plan's
    simulated ``peak_bytes`` alone for one run."""
    if runs <= 1:
        return peak_bytes
    share = runs_share(max(peak_bytes, 1), input_activation_bytes, param_grad_bytes, 0, runs)
    return share.runs_peak_bytes(held_bytes, peak_bytes)


__all__ = ["runs_share", "stacked_peak_bytes"]
