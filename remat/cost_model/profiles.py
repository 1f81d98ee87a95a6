"""Hardware profiles: the record the roofline time model reads, the datasheet and default profiles,
the plausibility check and the JSON form a measured profile is cached in.

A ``HardwareProfile`` holds peak FLOP/s per dtype, memory bandwidth (optionally
by working-set size: a CPU streams a 1 MiB tensor from cache several times faster
than a 100 MiB one) and a per-kernel launch floor.

- ``a100``, ``h100``, ``h200``: datasheet numbers (SXM, dense, no sparsity),
  labelled as such in ``source``.
- ``DEFAULT_CPU_PROFILES``: a profile per CPU family, used until this machine's own is measured
  (``remat/cost_model/hardware.py``); each is a real measurement of one machine of that family,
  labelled with it in ``source``.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from .loop_costs import check_loop_costs

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



def datasheet_name_for(device_name: str) -> Optional[str]:
    """"NVIDIA H100 80GB HBM3" -> "h100"; None for a GPU without a datasheet profile."""
    lowered = device_name.lower()
    for key in ("h200", "h100", "a100"):
        if key in lowered:
            return key
    return None


# Used until this machine's CPU is measured (remat/cost_model/hardware.py): one measurement per CPU
# family, of a real machine of it, rounded to 4 digits. Another machine of the family differs by its
# core count, clock and caches; ``python -m remat.caches measure`` replaces it with this
# machine's own numbers (docs/caches.md says what the default costs the cost model).
DEFAULT_CPU_PROFILES: dict[str, HardwareProfile] = {
    "x86_64": HardwareProfile(
        name="cpu",
        flops_per_s={"float32": 2.042e+11, "bfloat16": 5.344e+11, "float16": 1.661e+11, "float64": 7.853e+10},
        bandwidth_bytes_per_s=2.712e+10,
        kernel_launch_s=6.543e-06,
        source="default for x86-64 CPUs: measured on a 2-core x86-64 cloud VM (host vm, 2 torch threads), "
               "torch 2.13.0; not this machine's own numbers",
        bandwidth_levels=((262144, 8.196e+10), (2097152, 8.196e+10), (16777216, 4.173e+10)),
        transcendentals_per_s=3.832e+09,
        random_values_per_s=2.575e+08,
        eager_classes=(
            ("welford", 1.883e-05, 6.075e-09),
            ("compare", 1.758e-05, 7.431e-10),
            ("select", 8.578e-06, 1.146e-09),
            ("bool_reduction", 1.109e-05, 5.277e-10),
            ("convert", 0.0001591, 1.092e-09),
            ("factory", 2.026e-05, 1.51e-10),
            ("python_prim", 3.191e-05, 4.515e-10),
        ),
        library_flops_per_s={"convolution@16": 1.301e+11, "convolution_backward@16": 1.2e+11,
                             "convolution@128": 1.757e+11, "convolution_backward@128": 1.576e+11},
        loop_costs_s={
            "kernel_call": 8.263e-06,
            "graph_call": 9.88e-05,
            "graph_input": 2.494e-06,
            "random_value": 6.62e-09,
            "bool_store": 5.925e-09,
            "bool_load": 7.004e-10,
            "welford_long": 1.5e-10,
        },
    ),
}


def cpu_family() -> str:
    """This machine's CPU family as ``DEFAULT_CPU_PROFILES`` keys it: "x86_64", "aarch64", ..."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
