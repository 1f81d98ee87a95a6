"""Hardware profiles for the roofline time model.

A ``HardwareProfile`` holds peak FLOP/s per dtype, memory bandwidth (optionally
by working-set size: a CPU streams a 1 MiB tensor from cache several times faster
than a 100 MiB one) and a per-kernel launch floor.

- ``a100``, ``h100``, ``h200``: datasheet numbers (SXM, dense, no sparsity),
  labelled as such in ``source``.
- ``cpu``: measured once on this machine (matmuls per dtype, 3x3 convolutions
  forward and backward at 16 and 128 channels, copies at four working-set sizes, exp and rand for the
  special-function and random-number rates, a tiny op for the launch floor, one
  op per family of slow eager kernels, ``eager_ops.py``, and what Inductor's
  generated loops pay beyond the roofline, ``loop_costs.py``) and cached on disk under
  ``$REMAT_CACHE_DIR`` (default ``~/.cache/remat``), keyed by host, thread count
  and torch version. ``cuda``: the same measurement on the current CUDA device.
  A missing, corrupt or implausible cache file is measured again and rewritten;
  an unwritable cache directory only costs the caching.

``get_profile("auto", device)`` picks the datasheet profile of a recognised GPU,
the measured ``cuda`` profile of any other GPU, else ``cpu``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch

from .eager_ops import measure_eager_classes
from .loop_costs import check_loop_costs, measure_loop_costs

CACHE_ENV_VAR = "REMAT_CACHE_DIR"
CACHE_SCHEMA = 10
DATASHEET_NAMES = ("a100", "h100", "h200")
PROFILE_NAMES = ("auto", "cpu", "cuda") + DATASHEET_NAMES


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    flops_per_s: Mapping[str, float]          # dtype name -> peak FLOP/s ("tf32": fp32 matmuls on tensor cores)
    bandwidth_bytes_per_s: float              # main memory (DRAM / HBM)
    kernel_launch_s: float
    source: str                               # "datasheet ..." or "measured on <host> ..."
    extra: Mapping[str, str] = field(default_factory=dict)
    # (working-set bytes up to which it holds, bytes/s), ascending; beyond the last: bandwidth_bytes_per_s
    bandwidth_levels: tuple[tuple[int, float], ...] = ()
    transcendentals_per_s: float = 0.0        # fp32 exp/erf/tanh evaluations per second (0: not charged)
    random_values_per_s: float = 0.0          # fp32 uniform random numbers drawn per second (0: not charged)
    # (family, fixed s, s per element): eager ops that run far below the roofline (eager_ops.py); measured only
    eager_classes: tuple[tuple[str, float, float], ...] = ()
    # library op ("convolution@16": at 16 channels) -> fp32 FLOP/s its library kernel attains (measured only):
    # oneDNN's 3x3 convolutions run 1.2-2x "faster" than the matmul peak in counted FLOPs (Winograd-like
    # algorithms), more so the more channels
    library_flops_per_s: Mapping[str, float] = field(default_factory=dict)
    # cost name -> seconds per element that Inductor's generated CPU loops pay beyond the roofline (loop_costs.py)
    loop_costs_s: Mapping[str, float] = field(default_factory=dict)

    def library_rate(self, op: str, dtype: Optional[torch.dtype], channels: int = 0) -> Optional[float]:
        """The measured fp32 rate of ``op``'s library kernel, or None (then the dtype's peak applies).

        Rates measured at two widths ("op@16", "op@128") are interpolated in log2(channels),
        clamped to the two; a plain "op" rate holds at any width.
        """
        if dtype not in (None, torch.float32):
            return None
        ends = sorted((int(key.split("@")[1]), rate) for key, rate in self.library_flops_per_s.items()
                      if key.startswith(op + "@"))
        if len(ends) < 2:
            return self.library_flops_per_s.get(op)
        (low, low_rate), (high, high_rate) = ends[0], ends[-1]
        where = (math.log2(min(max(channels, low), high)) - math.log2(low)) / (math.log2(high) - math.log2(low))
        return low_rate + where * (high_rate - low_rate)

    def loop_cost_s(self, name: str, elements: int) -> float:
        """Seconds ``elements`` elements of cost ``name`` add to a generated loop (0 when not measured)."""
        return elements * self.loop_costs_s.get(name, 0.0) if elements else 0.0

    def peak_flops_per_s(self, dtype: Optional[torch.dtype], *, tensor_cores: bool = False) -> float:
        """Peak rate for ``dtype``; fp32 matmuls use the TF32 rate when ``tensor_cores`` and the profile has one."""
        key = str(dtype).replace("torch.", "") if dtype is not None else "float32"
        if key == "float32" and tensor_cores and "tf32" in self.flops_per_s:
            key = "tf32"
        return self.flops_per_s.get(key, self.flops_per_s["float32"])

    def special_ops_s(self, transcendentals: int, random_values: int) -> float:
        """Seconds to evaluate that many special functions and draw that many random numbers."""
        seconds = 0.0
        if transcendentals and self.transcendentals_per_s > 0:
            seconds += transcendentals / self.transcendentals_per_s
        if random_values and self.random_values_per_s > 0:
            seconds += random_values / self.random_values_per_s
        return seconds

    def bandwidth_for(self, working_set_bytes: int) -> float:
        """Bytes/s for a kernel that moves ``working_set_bytes`` in all."""
        for limit, rate in self.bandwidth_levels:
            if working_set_bytes <= limit:
                return rate
        return self.bandwidth_bytes_per_s


def _datasheet(name: str, fp32: float, tf32: float, bf16: float, bandwidth: float, sms: int,
               boost_hz: float) -> HardwareProfile:
    # Special functions run on the SFUs: 16 results per clock per SM on compute
    # capability 8.x/9.x (CUDA C++ Programming Guide, arithmetic instruction
    # throughput). Philox, which draws Inductor's and torch's random numbers,
    # takes about as many integer instructions per value (64/clock/SM) as that.
    sfu_rate = 16 * sms * boost_hz
    return HardwareProfile(
        name=name,
        flops_per_s={"float32": fp32, "tf32": tf32, "bfloat16": bf16, "float16": bf16, "float64": fp32 / 2},
        bandwidth_bytes_per_s=bandwidth,
        kernel_launch_s=4e-6,
        source="datasheet (SXM, dense, no sparsity; special functions and RNG from SM count x clock)",
        transcendentals_per_s=sfu_rate,
        random_values_per_s=sfu_rate,
    )


DATASHEET_PROFILES: dict[str, HardwareProfile] = {
    "a100": _datasheet("a100", 19.5e12, 156e12, 312e12, 2.039e12, sms=108, boost_hz=1.41e9),
    "h100": _datasheet("h100", 67e12, 495e12, 989e12, 3.35e12, sms=132, boost_hz=1.98e9),
    "h200": _datasheet("h200", 67e12, 495e12, 989e12, 4.8e12, sms=132, boost_hz=1.98e9),
}

# A measurement outside these bounds is a broken clock or a machine under
# another load, not hardware: it is measured again and never cached.
_MAX_FLOPS_PER_THREAD = 5e11   # 2x an AVX-512 core with two FMA units at 4 GHz
_MAX_BANDWIDTH = 2e13
_MAX_LAUNCH_S = 1e-3


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "remat")
    return Path(root)


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


def _measure_profile(device: torch.device) -> HardwareProfile:
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


def check_plausible(profile: HardwareProfile, threads: int = 1) -> None:
    """Raise ValueError naming the number when a profile cannot describe real hardware."""
    rates = {"bandwidth_bytes_per_s": profile.bandwidth_bytes_per_s, "kernel_launch_s": profile.kernel_launch_s}
    rates.update({f"flops_per_s[{k}]": v for k, v in profile.flops_per_s.items()})
    rates.update({f"bandwidth_levels[{i}]": rate for i, (_, rate) in enumerate(profile.bandwidth_levels)})
    for key, value in rates.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{key}={value!r} is not a positive finite number")
    for key in ("transcendentals_per_s", "random_values_per_s"):
        value = getattr(profile, key)
        if not (math.isfinite(value) and value >= 0):   # 0: not charged
            raise ValueError(f"{key}={value!r} is not a finite number >= 0")
    for name, fixed_s, per_element_s in profile.eager_classes:
        if not all(math.isfinite(v) and v >= 0 for v in (fixed_s, per_element_s)) or fixed_s > 1.0:
            raise ValueError(f"eager class {name!r}: fixed {fixed_s!r} s, {per_element_s!r} s per element")
    if "float32" not in profile.flops_per_s:
        raise ValueError("no float32 rate")
    for op, rate in profile.library_flops_per_s.items():
        # Winograd does fewer multiplications than the count: allow up to 4x the matmul peak, no more
        if not (math.isfinite(rate) and 0 < rate <= 4 * max(profile.flops_per_s.values())):
            raise ValueError(f"library_flops_per_s[{op!r}]={rate!r} is not a positive rate within 4x the peak")
    check_loop_costs(profile.loop_costs_s)
    if profile.name == "cpu" and profile.flops_per_s["float32"] > _MAX_FLOPS_PER_THREAD * threads:
        raise ValueError(f"float32 rate {profile.flops_per_s['float32']:.3g} FLOP/s is beyond any CPU with {threads} threads")
    if any(rate > _MAX_BANDWIDTH for _, rate in profile.bandwidth_levels) or profile.bandwidth_bytes_per_s > _MAX_BANDWIDTH:
        raise ValueError("bandwidth above 20 TB/s")
    if profile.name == "cpu" and 2 * 512**3 / profile.flops_per_s["float32"] < profile.kernel_launch_s:
        raise ValueError("a 512^3 matmul would take less than the launch floor of a 4-element add: "
                         "the matmul did not run (measured under a fake or meta mode?)")
    if profile.kernel_launch_s > _MAX_LAUNCH_S:
        raise ValueError(f"launch floor {profile.kernel_launch_s * 1e6:.0f} us is above 1 ms")


def profile_to_json(profile: HardwareProfile) -> dict:
    return {
        "schema": CACHE_SCHEMA,
        "name": profile.name,
        "flops_per_s": dict(profile.flops_per_s),
        "bandwidth_bytes_per_s": profile.bandwidth_bytes_per_s,
        "bandwidth_levels": [list(level) for level in profile.bandwidth_levels],
        "kernel_launch_s": profile.kernel_launch_s,
        "transcendentals_per_s": profile.transcendentals_per_s,
        "random_values_per_s": profile.random_values_per_s,
        "eager_classes": [list(entry) for entry in profile.eager_classes],
        "library_flops_per_s": dict(profile.library_flops_per_s),
        "loop_costs_s": dict(profile.loop_costs_s),
        "source": profile.source,
    }


def profile_from_json(data: Any, threads: int = 1) -> HardwareProfile:
    """Parse and check a cached profile; raises ValueError/KeyError/TypeError on anything off."""
    if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA:
        raise ValueError("not a profile of the current schema")
    profile = HardwareProfile(
        name=str(data["name"]),
        flops_per_s={str(k): float(v) for k, v in data["flops_per_s"].items()},
        bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]),
        kernel_launch_s=float(data["kernel_launch_s"]),
        source=str(data["source"]),
        bandwidth_levels=tuple((int(limit), float(rate)) for limit, rate in data["bandwidth_levels"]),
        transcendentals_per_s=float(data["transcendentals_per_s"]),
        random_values_per_s=float(data["random_values_per_s"]),
        eager_classes=tuple((str(name), float(fixed), float(per)) for name, fixed, per in data["eager_classes"]),
        library_flops_per_s={str(k): float(v) for k, v in data["library_flops_per_s"].items()},
        loop_costs_s={str(k): float(v) for k, v in data["loop_costs_s"].items()},
    )
    check_plausible(profile, threads)
    return profile


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)   # readers see the old file or the new one, never half of one
    finally:
        tmp.unlink(missing_ok=True)


def _profile_cache_path(device: torch.device) -> Path:
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_")
    else:
        what = f"{torch.get_num_threads()}threads"
    torch_version = torch.__version__.split("+")[0]
    return cache_dir() / f"profile_v{CACHE_SCHEMA}_{device.type}_{socket.gethostname()}_{what}_torch{torch_version}.json"


def measured_profile(device: Union[str, torch.device] = "cpu", cache_path: Optional[Path] = None,
                     measure: Callable[[torch.device], HardwareProfile] = _measure_profile) -> HardwareProfile:
    """The measured profile of ``device``, read from the on-disk cache or measured and cached."""
    device = torch.device(device)
    path = cache_path or _profile_cache_path(device)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    try:
        return profile_from_json(json.loads(path.read_text()), threads)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, corrupt or implausible: measure again
    profile = measure(device)
    try:
        check_plausible(profile, threads)
    except ValueError:
        profile = measure(device)   # one retry: a clock glitch or a burst of load
        check_plausible(profile, threads)
    try:
        write_atomically(path, json.dumps(profile_to_json(profile), indent=1))
    except OSError:
        pass  # an unwritable cache dir still gets a profile, just not a cached one
    return profile


def cpu_profile(cache_path: Optional[Path] = None) -> HardwareProfile:
    """The measured CPU profile (see ``measured_profile``)."""
    return measured_profile("cpu", cache_path)


def datasheet_name_for(device_name: str) -> Optional[str]:
    """"NVIDIA H100 80GB HBM3" -> "h100"; None for a GPU without a datasheet profile."""
    lowered = device_name.lower()
    for key in ("h200", "h100", "a100"):
        if key in lowered:
            return key
    return None


def get_profile(name: str = "auto", device: Optional[Union[str, torch.device]] = None) -> HardwareProfile:
    """Resolve a profile name: "auto", "cpu", "cuda" (measured), "a100", "h100", "h200" (datasheet).

    "auto" picks, for a CUDA ``device``, the datasheet profile of a recognised GPU
    or else a measured one; for any other device (or None), the measured CPU.
    """
    if name in DATASHEET_PROFILES:
        return DATASHEET_PROFILES[name]
    if name == "cpu":
        return cpu_profile()
    if name == "cuda":
        return measured_profile(torch.device("cuda"))
    if name != "auto":
        raise ValueError(f"unknown hardware profile {name!r}; use one of {', '.join(PROFILE_NAMES)}")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        known = datasheet_name_for(torch.cuda.get_device_name(device))
        return DATASHEET_PROFILES[known] if known else measured_profile(device)
    return cpu_profile()


__all__ = [
    "CACHE_ENV_VAR", "DATASHEET_PROFILES", "PROFILE_NAMES", "HardwareProfile", "cache_dir", "check_plausible",
    "clock_for", "cpu_profile", "datasheet_name_for", "get_profile", "measured_profile", "profile_from_json",
    "profile_to_json", "time_call",
]
