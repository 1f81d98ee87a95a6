"""Measuring a device's ``HardwareProfile``: matmuls per dtype, 3x3 convolutions forward and backward
at 16 and 128 channels (CPU), copies at four working-set sizes, exp and rand for the special-function
and random-number rates, a tiny op for the launch floor, one op per family of slow eager kernels
(``eager_ops.py``) and, on a CPU, what Inductor's generated loops pay beyond the roofline
(``loop_costs.py``). ``measure_profile`` is what ``profile_cache.measured_profile`` calls.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from .eager_ops import measure_eager_classes
from .loop_costs import measure_loop_costs
from .profiles import HardwareProfile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_for(device: torch.device) -> Callable[[], float]:
    """CPU time for a CPU running one torch thread, else wall-clock time.

    On a shared machine, a one-thread kernel's CPU time is what it costs; its wall
    time adds whatever the neighbours took (the best of seven wall-clock samples of a
    3x3 convolution still read 1.4x high at a load average of 4 on two cores). With
    several threads, or on a GPU, only the wall clock measures the span.
    """
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def time_call(fn: Callable[[], Any], device: torch.device, *, samples: int = 5, min_sample_s: float = 2e-3,
              max_total_s: float = 1.0, reduce: str = "median") -> float:
    """Seconds per call of ``fn``: the median (or ``reduce="min"``) of ``samples`` samples.

    Each sample loops ``fn`` long enough (``min_sample_s``) that clock resolution
    and one-off hiccups do not matter; the whole stays under about ``max_total_s``.
    Times are CPU time for a one-thread CPU, else wall clock (``clock_for``).
    """
    clock = clock_for(device)
    fn()
    _sync(device)
    t0 = clock()
    fn()
    _sync(device)
    once = max(clock() - t0, 1e-7)
    inner = max(1, min(int(min_sample_s / once), 10_000))
    samples = max(1, min(samples, int(max_total_s / (once * inner)) or 1))
    per_call = []
    for _ in range(samples):
        _sync(device)
        t0 = clock()
        for _ in range(inner):
            fn()
        _sync(device)
        per_call.append((clock() - t0) / inner)
    return min(per_call) if reduce == "min" else statistics.median(per_call)


def _measure_once(device: torch.device) -> HardwareProfile:
    """Matmuls per dtype (4096^3 on a GPU; 512^3, 256^3 for half types, on a CPU), copies at four sizes, a tiny op.

    Each is the best of seven samples: a roofline wants what the hardware can do,
    and on a shared machine the other samples measure the neighbours' load.
    """
    def best(fn: Callable[[], Any]) -> float:
        return time_call(fn, device, samples=7, min_sample_s=5e-3, reduce="min")

    flops: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        # CPUs without native half-precision matmul run it ~100x slower: a smaller one says as much
        n = 4096 if device.type == "cuda" else (512 if dtype in (torch.float32, torch.float64) else 256)
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        try:
            flops[str(dtype).replace("torch.", "")] = 2 * n**3 / best(lambda: torch.mm(a, b))
        except RuntimeError:  # a dtype this device has no matmul kernel for
            continue
    library = _measure_convolution(device, best) if device.type == "cpu" else {}
    levels = []
    for numel in (1 << 15, 1 << 18, 1 << 21, 1 << 24):   # 128 KiB, 1 MiB, 8 MiB, 64 MiB of fp32
        src = torch.randn(numel, device=device)
        dst = torch.empty_like(src)
        working_set = 2 * src.numel() * src.element_size()
        levels.append((working_set, working_set / best(lambda: dst.copy_(src))))
    # exp and rand over 64K fp32 (256 KiB, cache-resident): their compute rate, not memory's
    special = torch.randn(1 << 16, device=device)
    transcendentals_s = best(lambda: torch.exp(special))
    random_s = best(lambda: torch.rand(1 << 16, device=device))
    tiny = torch.ones(4, device=device)
    # the floor of one op called the way an FX graph calls it (an OpOverload), output allocation included
    launch_s = best(lambda: torch.ops.aten.add.Tensor(tiny, tiny))
    eager_classes = measure_eager_classes(device, best)
    return HardwareProfile(
        name=device.type,
        flops_per_s=flops,
        bandwidth_bytes_per_s=levels[-1][1],
        kernel_launch_s=launch_s,
        source="",
        bandwidth_levels=tuple(levels[:-1]),
        transcendentals_per_s=special.numel() / transcendentals_s,
        random_values_per_s=special.numel() / random_s,
        eager_classes=eager_classes,
        library_flops_per_s=library,
    )


# 3x3 convolutions at the two ends of a small CNN's widths, with working sets of 0.25-0.5 MiB:
# oneDNN's efficiency grows with the channel count (a GEMM with 16 output columns blocks poorly)
CONV_WIDTHS = (16, 128)
_CONV_PIXELS = {16: 32, 128: 8}   # height = width of the image at that channel count, batch 8


def _measure_convolution(device: torch.device, best: Callable[[Callable[[], Any]], float]) -> dict[str, float]:
    """FLOP/s (FlopCounterMode's count) of a 3x3 fp32 convolution's forward and backward at each of
    ``CONV_WIDTHS`` channels, keyed "convolution@16", "convolution_backward@128", ..."""
    aten = torch.ops.aten
    rates: dict[str, float] = {}
    for channels in CONV_WIDTHS:
        batch, pixels = 8, _CONV_PIXELS[channels]
        # channels-last, as Inductor lays out a CPU convolution's tensors (its layout optimisation);
        # contiguous NCHW at 16 channels ran 1.5-3x slower, and erratically
        last = torch.channels_last
        x = torch.randn(batch, channels, pixels, pixels, device=device).to(memory_format=last)
        weight = torch.randn(channels, channels, 3, 3, device=device).to(memory_format=last)
        bias = torch.randn(channels, device=device)
        grad = torch.randn(batch, channels, pixels, pixels, device=device).to(memory_format=last)
        forward_flops = 2 * batch * channels * pixels * pixels * channels * 9
        try:
            forward_s = best(lambda: aten.convolution.default(
                x, weight, bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
            backward_s = best(lambda: aten.convolution_backward.default(
                grad, x, weight, [channels], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]))
        except RuntimeError:   # no convolution kernel on this device: the peak applies
            return {}
        # the backward counts twice the forward: the input's and the weight's gradients (FlopCounterMode)
        rates[f"convolution@{channels}"] = forward_flops / forward_s
        rates[f"convolution_backward@{channels}"] = 2 * forward_flops / backward_s
    return rates


def _faster_of(a: HardwareProfile, b: HardwareProfile) -> HardwareProfile:
    """Per number, the faster of two measurements of the same device."""
    return replace(
        a,
        flops_per_s={k: max(a.flops_per_s.get(k, 0.0), b.flops_per_s.get(k, 0.0)) for k in a.flops_per_s | b.flops_per_s},
        bandwidth_bytes_per_s=max(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s),
        bandwidth_levels=tuple((size, max(ra, rb)) for (size, ra), (_, rb) in zip(a.bandwidth_levels, b.bandwidth_levels)),
        kernel_launch_s=min(a.kernel_launch_s, b.kernel_launch_s),
        transcendentals_per_s=max(a.transcendentals_per_s, b.transcendentals_per_s),
        random_values_per_s=max(a.random_values_per_s, b.random_values_per_s),
        eager_classes=_faster_classes(a.eager_classes, b.eager_classes),
        library_flops_per_s={k: max(a.library_flops_per_s.get(k, 0.0), b.library_flops_per_s.get(k, 0.0))
                             for k in a.library_flops_per_s | b.library_flops_per_s},
    )


def _faster_classes(a: tuple[tuple[str, float, float], ...], b: tuple[tuple[str, float, float], ...]
                    ) -> tuple[tuple[str, float, float], ...]:
    """Per family, the measurement with the smaller time at the larger size timed (the other's when one lacks it)."""
    by_name = {name: (fixed, per) for name, fixed, per in b}
    out = []
    for name, fixed, per in a:
        other = by_name.pop(name, None)
        if other is not None and other[0] + other[1] * 65536 < fixed + per * 65536:
            fixed, per = other
        out.append((name, fixed, per))
    out += [(name, fixed, per) for name, (fixed, per) in by_name.items()]
    return tuple(out)


def _monotone_levels(profile: HardwareProfile) -> HardwareProfile:
    """A smaller working set is never slower than a larger one: raise each level to the next one's rate."""
    levels, floor = [], profile.bandwidth_bytes_per_s
    for size, rate in reversed(profile.bandwidth_levels):
        floor = max(floor, rate)
        levels.append((size, floor))
    return replace(profile, bandwidth_levels=tuple(reversed(levels)))


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Run real kernels even when called under a FakeTensorMode or another dispatch mode.

    The partitioner that asks for a profile runs under AOTAutograd's fake mode: a
    matmul there returns at once and a profile measured there is fiction (1.4
    TFLOP/s and a 195 us launch floor on two CPU cores, seen in a cache file).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        probe = torch.empty(1)
        if type(probe) is not torch.Tensor:   # pragma: no cover - a mode that survived
            raise RuntimeError(f"cannot create real tensors here: got {type(probe).__name__}")
        yield


def measure_profile(device: torch.device) -> HardwareProfile:
    """Measure ``device``; on a CPU with several threads, also with one thread and keep the faster numbers.

    More threads never make a kernel slower on an idle machine, but on a busy one
    a multi-threaded kernel waits at every barrier for a thread the OS has put
    aside (a 3x3 convolution measured 32 ms with two threads and 3 ms with one on
    a loaded two-core VM); the single-thread numbers bound that error.
    """
    threads = torch.get_num_threads()
    with real_tensors():
        profile = _measure_once(device)
        if device.type == "cpu" and threads > 1:
            try:
                torch.set_num_threads(1)
                profile = _faster_of(profile, _measure_once(device))
            finally:
                torch.set_num_threads(threads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{threads} threads"
    source = f"measured on {socket.gethostname()} ({where}), torch {torch.__version__}"
    loop_costs: dict[str, float] = {}
    if device.type == "cpu":
        loop_costs, note = measure_loop_costs(threads)
        source += f"; {note}" if note else ""
    return replace(_monotone_levels(profile), source=source, loop_costs_s=loop_costs)

