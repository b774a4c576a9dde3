"""benchmarks/bench_fsdp_step.py --rounds: a variant's rounds merged into one measurement."""

from __future__ import annotations

import pytest

from .bench_scripts import load


def _round(bench, times, *, peak=1.0, recipe=None, bus=1.0):
    decision = None if recipe is None else {"recipe": recipe, "grads": "none", "bus_gb_per_s": bus}
    return bench.Measured(
        times=times,
        cpu_times=[t / 2 for t in times],
        losses=[3.0, 2.5],
        peak=peak,
        start=0.5,
        wire={"collectives": 3} if peak == 1.0 else {},
        decision=decision,
        round_medians=[sorted(times)[len(times) // 2]],
    )


def test_rounds_pool_their_steps_and_keep_each_median():
    bench = load("bench_fsdp_step", siblings=True)
    merged = bench.merge([_round(bench, [0.3, 0.1, 0.2]), _round(bench, [0.5, 0.4, 0.6], peak=2.0)])
    assert merged.times == [0.3, 0.1, 0.2, 0.5, 0.4, 0.6]
    assert merged.cpu_times == [0.15, 0.05, 0.1, 0.25, 0.2, 0.3]
    assert merged.round_medians == [0.2, 0.5]
    assert merged.peak == 2.0  # the highest round's
    assert merged.wire == {"collectives": 3} and merged.losses == [3.0, 2.5]  # the first round's


def test_auto_must_choose_the_same_program_every_round():
    bench = load("bench_fsdp_step", siblings=True)
    # measured numbers differ between rounds: the first round's are kept
    same = bench.merge(
        [_round(bench, [0.1], recipe="bf16", bus=1.0), _round(bench, [0.2], recipe="bf16", bus=2.0)]
    )
    assert same.decision["bus_gb_per_s"] == 1.0
    with pytest.raises(SystemExit, match="chose differently in different rounds"):
        bench.merge([_round(bench, [0.1], recipe="bf16"), _round(bench, [0.2], recipe="sdp4bit")])


def _ddp_merge(rank: int, world: int) -> tuple:
    bench = load("bench_ddp_step", siblings=True)
    import torch

    scale = rank + 1  # rank 1 is the slower: its medians are the step's
    rounds = [
        {
            "variant": "cgx",
            "times": [scale * t for t in ts],
            "compute": [0.01 * scale],
            "peak_gib": p,
            "loss_first": 3.0,
        }
        for ts, p in (([0.3, 0.1, 0.2], 1.0), ([0.5, 0.4, 0.6], 2.0))
    ]
    row = bench.merge_rounds(rounds, torch.device("cpu"))
    return row["median_s"], row["compute_s"], row["round_medians"], row["peak_gib"], "times" in row


def test_ddp_rounds_take_the_slowest_ranks_median_over_all_steps():
    from qsdp.testing import run_distributed

    for median, compute, per_round, peak, kept_times in run_distributed(_ddp_merge, 2):
        assert median == pytest.approx(2 * 0.35)  # the median of rank 1's six steps
        assert compute == pytest.approx(0.02)
        assert per_round == [pytest.approx(0.4), pytest.approx(1.0)]
        assert peak == 2.0 and not kept_times


def test_loop_clocks_pool_over_rounds_weighted_by_samples():
    bench = load("bench_fsdp_step", siblings=True)
    a = {"sm_mhz": 1980, "power_w": 400, "power_capped": 0.0, "samples": 10, "joules": 80.0}
    b = {"sm_mhz": 1680, "power_w": 700, "power_capped": 0.6, "samples": 30, "joules": 100.0}
    first, second = _round(bench, [0.1]), _round(bench, [0.2])
    first.loop_clocks, second.loop_clocks = [a], [b]
    merged = bench.merge([first, second])
    assert merged.loop_clocks == [a, b]
    assert bench._mean_clocks(merged.loop_clocks) == {
        "sm_mhz": 1755,
        "power_w": 625,
        "power_capped": 0.45,
        "samples": 40,
        "joules": 90.0,
    }
    assert bench._mean_clocks([a, {**b, "joules": None}])["joules"] is None
    assert (
        bench._mean_clocks(None) is None and bench.merge([_round(bench, [0.1])]).loop_clocks is None
    )


def test_clock_samples_summarised_and_none_off_cuda():
    import torch

    profiling = load("profiling")
    clocks = profiling.Clocks(torch.device("cpu"))
    with clocks:  # no NVML off CUDA: no thread, no samples
        pass
    assert clocks.summary is None
    # SM MHz, watts, NVML's clock-event reasons: 0x4 the software power cap, 0x80 the hardware
    # power brake, 0x1 idle (not a power cap)
    clocks.samples = [
        (1980, 300.0, 0x0),
        (1800, 690.0, 0x4),
        (1500, 700.0, 0x84),
        (1980, 120.0, 0x1),
    ]
    assert clocks.summary == {
        "joules": None,
        "sm_mhz": 1815,
        "power_w": 452,
        "power_capped": 0.5,
        "samples": 4,
    }
    clocks.joules = 12.345
    assert clocks.summary["joules"] == 12.3
