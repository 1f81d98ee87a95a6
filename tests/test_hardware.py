"""Hardware profiles: datasheet numbers, choice by name and device, the measured profile's disk cache."""

from __future__ import annotations

import json
import math

import pytest
import torch

from remat.cost_model import hardware, profile_measure
from remat.cost_model.loop_costs import LOOP_COST_NAMES
from remat.cost_model.hardware import (
    CACHE_ENV_VAR,
    DATASHEET_PROFILES,
    HardwareProfile,
    check_plausible,
    datasheet_name_for,
    get_profile,
    measured_profile,
    profile_from_json,
    profile_to_json,
)

DATASHEET = [
    # name, fp32, tf32, bf16 FLOP/s, HBM bytes/s (SXM, dense), special functions/s (16 per clock per SM)
    ("a100", 19.5e12, 156e12, 312e12, 2.039e12, 16 * 108 * 1.41e9),
    ("h100", 67e12, 495e12, 989e12, 3.35e12, 16 * 132 * 1.98e9),
    ("h200", 67e12, 495e12, 989e12, 4.8e12, 16 * 132 * 1.98e9),
]


@pytest.mark.parametrize("name,fp32,tf32,bf16,bandwidth,special", DATASHEET)
def test_datasheet_profiles(name, fp32, tf32, bf16, bandwidth, special):
    profile = get_profile(name)
    assert profile is DATASHEET_PROFILES[name]
    assert profile.peak_flops_per_s(torch.float32) == fp32
    assert profile.peak_flops_per_s(torch.float32, tensor_cores=True) == tf32
    assert profile.peak_flops_per_s(torch.bfloat16) == profile.peak_flops_per_s(torch.float16) == bf16
    assert profile.bandwidth_bytes_per_s == bandwidth
    assert profile.transcendentals_per_s == profile.random_values_per_s == pytest.approx(special)
    assert profile.source.startswith("datasheet")


@pytest.mark.parametrize("device_name,expected", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GeForce RTX 4090", None), ("Tesla V100-SXM2-16GB", None),
])
def test_datasheet_name_for_device(device_name, expected):
    assert datasheet_name_for(device_name) == expected


def test_unknown_profile_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'.*auto, cpu, cuda, a100, h100, h200"):
        get_profile("tpu")


def fake_profile(**overrides) -> HardwareProfile:
    fields = dict(name="cpu", flops_per_s={"float32": 1e11, "float64": 5e10}, bandwidth_bytes_per_s=2e10,
                  kernel_launch_s=2e-6, source="fake", bandwidth_levels=((1 << 20, 8e10),))
    fields.update(overrides)
    return HardwareProfile(**fields)


class Counting:
    """A stand-in for the real measurement: returns a fixed profile and counts calls."""

    def __init__(self, *profiles: HardwareProfile) -> None:
        self.profiles = list(profiles) or [fake_profile()]
        self.calls = 0

    def __call__(self, device):
        self.calls += 1
        return self.profiles[min(self.calls, len(self.profiles)) - 1]


def test_missing_cache_is_measured_then_read_back(tmp_path):
    path = tmp_path / "sub" / "profile.json"
    measure = Counting()
    first = measured_profile("cpu", path, measure=measure)
    second = measured_profile("cpu", path, measure=measure)
    assert measure.calls == 1 and first == second == fake_profile()
    assert json.loads(path.read_text())["schema"] == hardware.CACHE_SCHEMA


CORRUPT_FILES = [
    ("not json", "{{{ garbage"),
    ("binary", b"\x00\xff\xfe".decode("latin-1")),
    ("a list", "[1, 2, 3]"),
    ("old schema", json.dumps({**profile_to_json(fake_profile()), "schema": 1})),
    ("missing key", json.dumps({k: v for k, v in profile_to_json(fake_profile()).items() if k != "flops_per_s"})),
    ("nan bandwidth", json.dumps({**profile_to_json(fake_profile()), "bandwidth_bytes_per_s": float("nan")})),
    ("negative rate", json.dumps({**profile_to_json(fake_profile()), "flops_per_s": {"float32": -1.0}})),
    ("negative special rate", json.dumps({**profile_to_json(fake_profile()), "random_values_per_s": -1.0})),
    ("implausible: 1.45 TFLOP/s on one CPU thread",
     json.dumps({**profile_to_json(fake_profile()), "flops_per_s": {"float32": 1.45e13}})),
    ("implausible launch floor", json.dumps({**profile_to_json(fake_profile()), "kernel_launch_s": 0.17})),
    ("negative eager family cost",
     json.dumps({**profile_to_json(fake_profile()), "eager_classes": [["welford", 0.0, -1e-9]]})),
    ("eager family entry of the wrong shape",
     json.dumps({**profile_to_json(fake_profile()), "eager_classes": [["welford"]]})),
    # what a profile measured under AOTAutograd's fake mode looked like (two cores, found in a cache file)
    ("measured under a fake mode", json.dumps({**profile_to_json(fake_profile()), "flops_per_s": {"float32": 1.408e12},
                                               "bandwidth_bytes_per_s": 6.89e11, "kernel_launch_s": 1.95e-4})),
]


@pytest.mark.parametrize("content", [c[1] for c in CORRUPT_FILES], ids=[c[0] for c in CORRUPT_FILES])
def test_corrupt_cache_is_rebuilt_not_fatal(tmp_path, content):
    path = tmp_path / "profile.json"
    path.write_text(content)
    measure = Counting()
    assert measured_profile("cpu", path, measure=measure) == fake_profile()
    assert measure.calls == 1
    assert profile_from_json(json.loads(path.read_text())) == fake_profile()   # rewritten, valid


def test_cache_path_that_is_a_directory_still_gives_a_profile(tmp_path):
    measure = Counting()
    assert measured_profile("cpu", tmp_path, measure=measure) == fake_profile()   # unreadable and unwritable
    assert measure.calls == 1
    assert list(tmp_path.parent.glob(f".{tmp_path.name}.*.tmp")) == []             # no temporary file left


def test_implausible_measurement_is_retried_once(tmp_path):
    measure = Counting(fake_profile(kernel_launch_s=5.0), fake_profile())
    assert measured_profile("cpu", tmp_path / "p.json", measure=measure) == fake_profile()
    assert measure.calls == 2


def test_two_implausible_measurements_fail_loudly(tmp_path):
    measure = Counting(fake_profile(kernel_launch_s=5.0))
    with pytest.raises(ValueError, match="launch floor"):
        measured_profile("cpu", tmp_path / "p.json", measure=measure)
    assert not (tmp_path / "p.json").exists()


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    path = hardware.profile_cache_path(torch.device("cpu"))
    assert path.parent == tmp_path
    assert f"{torch.get_num_threads()}threads" in path.name and f"v{hardware.CACHE_SCHEMA}" in path.name
    path.write_text(json.dumps(profile_to_json(fake_profile(source="from the env dir"))))
    assert get_profile("cpu").source == "from the env dir"
    assert get_profile("auto").source == "from the env dir"
    assert get_profile("auto", torch.device("cpu")).source == "from the env dir"


def test_bandwidth_levels_pick_the_first_that_holds_the_working_set():
    profile = fake_profile(bandwidth_levels=((1 << 20, 8e10), (1 << 24, 4e10)))
    assert profile.bandwidth_for(1000) == 8e10
    assert profile.bandwidth_for(1 << 20) == 8e10
    assert profile.bandwidth_for((1 << 20) + 1) == 4e10
    assert profile.bandwidth_for(1 << 30) == 2e10


def test_special_ops_time():
    profile = fake_profile(transcendentals_per_s=1e9, random_values_per_s=5e8)
    assert profile.special_ops_s(2_000, 1_000) == pytest.approx(2e-6 + 2e-6)
    assert fake_profile().special_ops_s(10**9, 10**9) == 0.0     # rates of 0: not charged


def test_cache_levels_are_made_monotone():
    measured = fake_profile(bandwidth_bytes_per_s=1e10, bandwidth_levels=((1 << 20, 5e9), (1 << 24, 4e10)))
    assert profile_measure._monotone_levels(measured).bandwidth_levels == ((1 << 20, 4e10), (1 << 24, 4e10))
    fine = fake_profile(bandwidth_levels=((1 << 20, 8e10), (1 << 24, 4e10)))
    assert profile_measure._monotone_levels(fine).bandwidth_levels == fine.bandwidth_levels


def test_several_threads_also_measure_one_and_keep_the_faster_numbers(monkeypatch):
    """On a loaded machine a 2-thread kernel waits for a descheduled thread; 1 thread bounds that."""
    contended = fake_profile(flops_per_s={"float32": 1e10}, bandwidth_bytes_per_s=3e10, kernel_launch_s=9e-6,
                             bandwidth_levels=((1 << 20, 1e8),), transcendentals_per_s=5e6)
    single = fake_profile(flops_per_s={"float32": 7e10}, bandwidth_bytes_per_s=1e10, kernel_launch_s=3e-6,
                          bandwidth_levels=((1 << 20, 6e10),), transcendentals_per_s=5e8)
    monkeypatch.setattr(profile_measure, "_measure_once", lambda device: single if torch.get_num_threads() == 1 else contended)
    probed = []

    def probe(threads):
        probed.append(threads)
        return {"bool_load": 1e-9}, ""

    monkeypatch.setattr(profile_measure, "measure_loop_costs", probe)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        profile = profile_measure.measure_profile(torch.device("cpu"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert profile.flops_per_s["float32"] == 7e10 and profile.bandwidth_bytes_per_s == 3e10
    assert profile.bandwidth_levels == ((1 << 20, 6e10),) and profile.kernel_launch_s == 3e-6
    assert profile.transcendentals_per_s == 5e8 and "2 threads" in profile.source
    # Inductor's loops are probed once, with the threads the compiled code will run with
    assert probed == [2] and profile.loop_costs_s == {"bool_load": 1e-9}


def test_a_loop_probe_that_cannot_run_is_not_fatal(monkeypatch):
    """No Python to run the probe (or no C++ compiler): no loop costs, and the profile says why."""
    from remat.cost_model import loop_costs

    monkeypatch.setattr(loop_costs.sys, "executable", "/nonexistent/python")
    costs, note = loop_costs.measure_loop_costs(1)
    assert costs == {} and note.startswith("generated-loop costs not measured: FileNotFoundError")
    monkeypatch.setattr(profile_measure, "_measure_once", lambda device: fake_profile())
    profile = profile_measure.measure_profile(torch.device("cpu"))
    assert profile.loop_costs_s == {} and "generated-loop costs not measured" in profile.source


@pytest.mark.parametrize("channels,rate", [(8, 1e12), (16, 1e12), (64, 3e12), (128, 4e12), (512, 4e12)])
def test_convolution_rate_is_interpolated_in_log2_channels_between_the_two_widths(channels, rate):
    profile = fake_profile(library_flops_per_s={"convolution@16": 1e12, "convolution@128": 4e12})
    assert profile.library_rate("convolution", torch.float32, channels) == pytest.approx(rate)
    assert profile.library_rate("convolution_backward", torch.float32, channels) is None   # not measured
    assert profile.library_rate("convolution", torch.float16, channels) is None            # fp32 only


def test_loop_costs_and_library_rates_round_trip_through_the_cache(tmp_path):
    profile = fake_profile(library_flops_per_s={"convolution": 2e11},
                           loop_costs_s={"random_value": 7e-9, "bool_store": 6e-9, "kernel_call": 1.3e-6})
    assert profile_from_json(json.loads(json.dumps(profile_to_json(profile)))) == profile


@pytest.mark.parametrize("bad,match", [
    (dict(loop_costs_s={"random_value": 0.5}), r"random_value=0.5 s per element is not in \[0, 1e-06 s\]"),
    (dict(loop_costs_s={"graph_call": -1.0}), r"graph_call=-1.0 s per call"),
    (dict(loop_costs_s={"warp_drive": 1e-9}), "unknown generated-loop cost 'warp_drive'"),
    (dict(library_flops_per_s={"convolution": 1e13}),
     r"library_flops_per_s\['convolution'\]=10000000000000.0 is not a positive rate within 4x"),
])
def test_check_plausible_refuses_impossible_loop_costs_and_library_rates(bad, match):
    with pytest.raises(ValueError, match=match):
        check_plausible(fake_profile(**bad))


def test_check_plausible_names_the_bad_number():
    with pytest.raises(ValueError, match=r"flops_per_s\[float32\]=nan"):
        check_plausible(fake_profile(flops_per_s={"float32": math.nan}))


def test_real_cpu_measurement_is_plausible_even_under_a_fake_mode(tmp_path):
    """One real measurement (a few seconds), made where the backend makes it: inside the
    partitioner, under AOTAutograd's FakeTensorMode. Every rate is within what a CPU can do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        profile = measured_profile("cpu", tmp_path / "real.json")
    check_plausible(profile, torch.get_num_threads())
    assert {"float32", "float64"} <= set(profile.flops_per_s)
    assert len(profile.bandwidth_levels) == 3 and profile.kernel_launch_s < 1e-3
    assert profile.transcendentals_per_s > 0 and profile.random_values_per_s > 0
    assert profile.source.startswith("measured on")
    families = {name: (fixed, per) for name, fixed, per in profile.eager_classes}
    assert set(families) == {"welford", "compare", "select", "bool_reduction", "convert", "factory", "python_prim"}
    # a Welford reduction costs more per element than a copy moves one (8 bytes at the DRAM bandwidth)
    assert families["welford"][1] > 8 / profile.bandwidth_bytes_per_s
    # the probes of Inductor's loops ran in their subprocess (the fake mode does not reach it) and all measured
    assert set(profile.loop_costs_s) == set(LOOP_COST_NAMES), profile.source
    assert set(profile.library_flops_per_s) == {f"{op}@{width}" for op in ("convolution", "convolution_backward")
                                                for width in hardware.CONV_WIDTHS}


def test_eager_families_round_trip_through_the_cache(tmp_path):
    profile = fake_profile(eager_classes=(("welford", 0.0, 5e-9), ("python_prim", 1e-5, 0.0)))
    assert profile_from_json(json.loads(json.dumps(profile_to_json(profile)))) == profile


def test_faster_of_keeps_each_familys_faster_fit():
    slow = fake_profile(eager_classes=(("welford", 1e-6, 9e-9), ("select", 0.0, 1e-9)))
    fast = fake_profile(eager_classes=(("welford", 2e-6, 4e-9), ("convert", 2e-5, 1e-9)))
    merged = dict((n, (f, p)) for n, f, p in profile_measure._faster_of(slow, fast).eager_classes)
    assert merged == {"welford": (2e-6, 4e-9), "select": (0.0, 1e-9), "convert": (2e-5, 1e-9)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_cuda_picks_the_datasheet_or_a_measured_profile(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    profile = get_profile("auto", torch.device("cuda"))
    known = datasheet_name_for(torch.cuda.get_device_name())
    assert profile.name == (known or "cuda")


def test_graph_device_is_the_accelerator_even_after_cpu_inputs():
    """A GPU graph can take CPU tensors first (RNG seeds, scalars): the profile must follow the
    accelerator ("meta" stands in for cuda here), and a CPU-only graph stays on the CPU."""
    from remat.devices import device_of

    seed = torch.zeros((), dtype=torch.int64)
    on_device = torch.empty(4, device="meta")
    assert device_of([seed, on_device]) == torch.device("meta")
    assert device_of([seed, 3, torch.zeros(2)]) == torch.device("cpu")
    assert device_of([]) == torch.device("cpu")


def test_a_new_machine_plans_with_its_familys_default_until_measured(tmp_path, monkeypatch):
    """Issue 16: no profile cached, an x86-64 CPU: the first compile takes the family's default and
    measures nothing; ``measure_cpu_profile`` (or REMAT_MEASURE_HARDWARE=1) measures and caches."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(hardware, "cpu_family", lambda: "x86_64")
    measure = Counting(fake_profile(source="measured here"))
    monkeypatch.setattr(profile_measure, "_measure_once", lambda device: pytest.fail("measured"))
    assert get_profile("cpu") is get_profile("auto") is hardware.DEFAULT_CPU_PROFILES["x86_64"]
    check_plausible(hardware.DEFAULT_CPU_PROFILES["x86_64"], 1)
    monkeypatch.setattr(hardware, "measured_profile", lambda device, path=None: measure(device))
    monkeypatch.setenv(hardware.MEASURE_ENV_VAR, "1")
    assert get_profile("cpu").source == "measured here" and measure.calls == 1


def test_measured_profile_replaces_the_default_once_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(hardware, "cpu_family", lambda: "x86_64")
    monkeypatch.setattr(hardware, "measured_profile",
                        lambda device, path=None: measured_profile(device, path, measure=lambda d: fake_profile()))
    assert hardware.measure_cpu_profile() == fake_profile()
    assert get_profile("cpu") == fake_profile() and hardware.profile_cache_path(torch.device("cpu")).exists()


def test_a_family_without_a_default_is_measured_at_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(hardware, "cpu_family", lambda: "riscv64")
    monkeypatch.setattr(hardware, "measured_profile", lambda device, path=None: fake_profile(source="measured"))
    assert get_profile("cpu").source == "measured"
