"""benchmarks/global_qsgd_scaling.py: its simulated Global-QSGD mean is the real collective's,
never overflows the carrier, is unbiased, and its error scales with the level count."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from qsdp.comm import integer_all_reduce
from qsdp.quant import CARRIERS, global_int_levels
from qsdp.testing import run_distributed

from ..bench_scripts import load

bench = load("global_qsgd_scaling")
G = bench.QUICK.group_size
# Few enough levels that float32 scaling is negligible against the rounding noise; int32 (2^24
# levels) sits at float32 precision, where x * s / M loses the fraction the noise must round
# (integer_all_reduce's documented float32 term), so its error is neither predicted nor unbiased.
SMALL = [c for c in CARRIERS if CARRIERS[c][1] <= 2**11]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return bench.measure(bench.QUICK, log=lambda *a, **k: None)


def _series(rows, dist, carrier):
    return sorted(
        (r for r in rows if r["dist"] == dist and r["carrier"] == carrier),
        key=lambda r: r["world_size"],
    )


def test_quick_covers_every_carrier(rows):
    got = {(r["dist"], r["carrier"], r["world_size"]) for r in rows}
    q = bench.QUICK
    assert got == {(d, c, n) for d in q.dists for c in (*CARRIERS, "fp32") for n in q.world_sizes}
    assert q.numel % G, "quick mode keeps a short last group"


def test_levels_never_overflow_the_carrier(rows):
    for r in rows:
        if r["carrier"] == "fp32":
            continue
        n, limit = r["world_size"], CARRIERS[r["carrier"]][1]
        assert r["supported"], r
        assert r["levels"] == global_int_levels(r["carrier"], n)
        assert r["levels"] * n <= limit, r
        assert r["max_abs_sum"] <= r["levels"] * n, r


def test_int8_past_127_ranks_is_reported_not_wrapped():
    cfg = replace(
        bench.QUICK, world_sizes=(127, 128), carriers=("int8",), dists=("normal",), numel=300
    )
    int8 = [r for r in bench.measure(cfg, log=lambda *a, **k: None) if r["carrier"] == "int8"]
    assert [(r["world_size"], r["supported"]) for r in int8] == [(127, True), (128, False)]
    assert int8[0]["levels"] == 1 and int8[0]["max_abs_sum"] <= 127
    assert "leave no quantization level" in int8[1]["note"]


def test_error_scales_with_levels(rows):
    for dist in bench.QUICK.dists:
        for carrier in CARRIERS:
            s = _series(rows, dist, carrier)
            for a, b in zip(s, s[1:], strict=False):
                if b["levels"] < a["levels"]:  # coarser codes: the error must grow
                    assert b["rel_err_mean"] > 1.2 * a["rel_err_mean"], (dist, carrier, a, b)
                else:  # the same levels averaged over more ranks: no growth
                    assert b["rel_err_mean"] <= 1.1 * a["rel_err_mean"], (dist, carrier, a, b)
            if carrier in SMALL:  # and it is the exact stochastic-rounding variance
                for r in s:
                    assert r["rel_err_mean"] == pytest.approx(r["rel_err_pred"], rel=0.05), r
            else:
                assert all(r["rel_err_mean"] < 1e-6 for r in s), s


def test_unbiased(rows):
    for r in rows:
        if r["carrier"] in SMALL:
            assert abs(r["bias_z"]) < 5, r
            assert r["rms_bias_bound"] < 0.25, r


def test_bias_check_catches_nearest_rounding():
    xs, _ = bench.rank_gradients("normal", 4, 1000, data_seed=3)
    exact = xs.double().mean(0)

    def errs(rounding):
        return torch.stack(
            [
                bench.simulate_all_reduce(xs, "int8", group_size=G, seed=s, rounding=rounding)[0]
                - exact
                for s in range(4)
            ]
        )

    assert math.isinf(bench.bias_stats(errs("nearest"))[0])
    assert abs(bench.bias_stats(errs("stochastic"))[0]) < 5


def _reduce_on_rank(rank: int, ws: int, xs: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    out = {}
    for carrier in CARRIERS:
        t = xs[rank].clone()
        integer_all_reduce(t, carrier=carrier, group_size=G, seed=seed)
        out[carrier] = t
    return out


@pytest.mark.parametrize("ws", [3])
def test_simulation_is_the_collective(ws):
    xs, _ = bench.rank_gradients("student-t3", ws, 1000 + 3, data_seed=5)
    results = run_distributed(_reduce_on_rank, ws, xs, 7)
    for carrier in CARRIERS:
        want, _ = bench.simulate_all_reduce(xs, carrier, group_size=G, seed=7)
        for rank, got in enumerate(results):
            assert torch.equal(got[carrier], want), (carrier, rank)
