"""One training step and gradient comparisons, shared by the tests and the benchmarks.

- ``run_step``: one training step (grads set to None, the output dotted with fixed random weights,
  backward), reseeding the global generator first so random ops draw the same numbers;
  ``compiled_loss_step``: a fresh model whose output is its loss, compiled, and its training step;
  ``prime_loss_weights`` creates those weights before a first step that is measured;
- ``grads_of`` / ``buffers_of``: copies to compare; ``assert_grads_close`` / ``assert_tensors_close``:
  every tensor within ``GRAD_REL_TOL`` relative error, with ``relative_error``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

STEP_SEED = 1234          # torch.manual_seed before every step, so dropout draws the same masks
GRAD_REL_TOL = 1e-4       # issue 2: gradients equal eager's within relative error 1e-4
# A gradient whose reference norm is below this fraction of the model's largest gradient norm
# is mathematically zero (a conv bias right before BatchNorm: ~1e-15 in float64, ~5e-6 in
# float32 next to a largest norm of ~20): its float32 value is rounding noise, which differs
# between eager and Inductor (plain Inductor and remat agree bit for bit on the zoo CNN), so
# its error is measured against the model's largest gradient norm instead of its own norm.
ZERO_GRAD_FRACTION = 1e-5
LOSS_SEED = 4321
# the feedback loop's actions on a step measured within its budget: judged so, or re-planned for what its eager loss
# held, less than remat reserves for one (``run_step``'s weighted sum holds the outputs' gradient where a
# cross-entropy holds three outputs' bytes: remat/eager_loss.py)
WITHIN_BUDGET_ACTIONS = ("within budget", "re-planned: its eager loss held less than reserved",
                         "within budget: its eager loss held less than reserved, stored for the next compile")
_LOSS_WEIGHTS: dict[tuple[int, ...], torch.Tensor] = {}


def zero_grads(model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)


def loss_weights(shape: torch.Size) -> torch.Tensor:
    """Fixed pseudo-random weights for the output (own generator: the global RNG is untouched)."""
    key = tuple(shape)
    if key not in _LOSS_WEIGHTS:
        generator = torch.Generator().manual_seed(LOSS_SEED)
        _LOSS_WEIGHTS[key] = torch.randn(key, generator=generator)
    return _LOSS_WEIGHTS[key]


def prime_loss_weights(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Create ``run_step``'s loss weights for ``model``'s output now, outside any measured step.

    ``run_step`` creates them on its first call per output shape, inside that step, and keeps them: a
    measured first step in a process would count them as the step's own allocation (an output-sized fp32
    tensor, e.g. 131,072 B on a 512x64 output) where every later step finds them resident. One eager forward
    in eval mode without autograd (no dropout drawn, no BatchNorm statistics updated) gives the shape."""
    was_training = model.training
    try:
        with torch.no_grad():
            out = model.eval()(*inputs)
    finally:
        model.train(was_training)
    return loss_weights(out.shape)


def run_step(compiled: Callable[..., torch.Tensor], model: torch.nn.Module, inputs: Sequence[torch.Tensor],
             seed: Optional[int] = STEP_SEED) -> torch.Tensor:
    """One forward + backward of ``compiled`` (the model or its compiled wrapper); returns the loss.

    The loss is ``(out.float() * w).sum()`` (as a dot product) with fixed random weights ``w``, not a plain
    ``sum()``: a plain sum sends the same gradient to every position of a channel, and
    BatchNorm's backward then subtracts nearly equal numbers, so the gradients of every
    layer below it are rounding noise that even plain Inductor does not match to 1e-4.
    Gradients are set to None first, so the backward allocates them inside the step (the
    budget covers them). ``seed`` reseeds the global generator so random ops draw the same
    numbers in every run that is compared.
    """
    zero_grads(model)
    if seed is not None:
        torch.manual_seed(seed)
    out = compiled(*inputs).float()
    # dot, not (out * w).sum(): no output-sized temporary outside the compiled graph
    loss = torch.dot(out.reshape(-1), loss_weights(out.shape).to(out.device).reshape(-1))
    del out
    loss.backward()
    return loss.detach()


def compiled_loss_step(make_model: Callable[[], torch.nn.Module], inputs: Sequence[torch.Tensor], backend: Any,
                       seed: int = 0) -> tuple[torch.nn.Module, Callable[[], None]]:
    """``make_model()`` built after ``torch.manual_seed(seed)`` (so every call makes the same parameters),
    compiled with ``backend`` after ``torch._dynamo.reset()``, and its training step: gradients set to None,
    then the model's output on ``inputs`` (its loss) backpropagated."""
    torch.manual_seed(seed)
    model = make_model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()
    return model, step


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by parameter name."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def buffers_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, floor) (absolute error if both are 0)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = max(expected.double().norm().item(), floor)
    return diff / scale if scale > 0 else diff


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                       rel_tol: float = GRAD_REL_TOL, what: str = "gradient") -> None:
    """Every parameter has a gradient in both, and each one's relative error is below ``rel_tol``."""
    assert actual.keys() == expected.keys(), (
        f"parameters with a {what}: only in actual {sorted(actual.keys() - expected.keys())}, "
        f"only in expected {sorted(expected.keys() - actual.keys())}"
    )
    assert expected, f"no parameter has a {what}"
    largest = max(t.double().norm().item() for t in expected.values())
    errors = {
        name: relative_error(actual[name], expected[name],
                             largest if expected[name].double().norm().item() < ZERO_GRAD_FRACTION * largest else 0.0)
        for name in expected
    }
    bad = {name: err for name, err in errors.items() if not err < rel_tol}
    assert not bad, f"{what} relative error >= {rel_tol:g} for {len(bad)}/{len(errors)} tensors: " + ", ".join(
        f"{name}={err:.3g}" for name, err in sorted(bad.items(), key=lambda kv: -kv[1])[:8]
    )


def assert_tensors_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         rel_tol: float = GRAD_REL_TOL, what: str = "buffer") -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        if expected[name].is_floating_point():
            err = relative_error(actual[name], expected[name])
            assert err < rel_tol, f"{what} {name}: relative error {err:.3g} >= {rel_tol:g}"
        else:
            assert torch.equal(actual[name], expected[name]), f"{what} {name}: {actual[name]} != {expected[name]}"
