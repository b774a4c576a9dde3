"""SDP4Bit's weight-difference all-gather on real gloo processes."""

from __future__ import annotations

import torch

from qsdp.comm import CommStats, all_gather_diff, all_gather_diff_wire_bytes
from qsdp.comm._common import dist_all_gather
from qsdp.quant import QuantSpec
from qsdp.testing import assert_same_on_all_ranks, run_distributed

SPEC = QuantSpec(bits=4, group_size=256, scheme="absmax", rounding="stochastic")


def _walk(rank: int, world: int, m: int, steps: int, dtype) -> dict:
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(m, generator=g).to(dtype)
    recon = torch.empty(world * m, dtype=dtype)
    out = torch.empty(world * m, dtype=dtype)
    stats = CommStats()
    errs, moves = [], []
    for t in range(steps):
        exact = torch.empty(world * m, dtype=dtype)
        dist_all_gather()(exact, x)
        all_gather_diff(out, x, recon, spec=SPEC, exact=t == 0, step=t, stats=stats)
        assert torch.equal(out, recon)
        assert_same_on_all_ranks(recon)
        err = (recon.float() - exact.float()).abs().max()
        errs.append(float(err))
        step_x = 1e-2 * torch.randn(m, generator=g)  # an optimizer step
        moves.append(float(step_x.abs().max()))
        x = (x.float() + step_x).to(dtype)
    return {"errs": errs, "moves": moves, "bytes": stats["all_gather_diff"].bytes}


def test_reconstruction_tracks_the_weights_without_drift():
    world, m, steps = 3, 1000, 25
    res = run_distributed(_walk, world, m, steps, torch.float32)
    for r in res:
        assert r["errs"][0] == 0.0  # the first gather is exact
        # each later error is within one 4-bit step of that call's difference (|d| <= 7 steps
        # of the last move plus the fed-back error), and it does not grow with the steps
        assert max(r["errs"][1:]) < 0.25 * max(r["moves"])
        assert sum(r["errs"][-5:]) / 5 < 2 * sum(r["errs"][1:6]) / 5
    exact_bytes = m * 4  # the first call sends one fp32 shard
    diff_bytes = SPEC.payload_bytes(m)
    assert res[0]["bytes"] == exact_bytes + (steps - 1) * diff_bytes
    # the wire-bytes rule says what crossed (an odd shard, not a multiple of the group size)
    rule = all_gather_diff_wire_bytes(m, SPEC, exact=True) + (steps - 1) * (
        all_gather_diff_wire_bytes(m, SPEC)
    )
    assert res[0]["bytes"] == rule


def test_bf16_reconstruction():
    res = run_distributed(_walk, 2, 777, 10, torch.bfloat16)
    assert max(res[0]["errs"][1:]) < 0.5 * max(res[0]["moves"]) + 0.05
    # the exact gather sends bf16 (the reconstruction's dtype)
    exact = all_gather_diff_wire_bytes(777, SPEC, exact=True, element_size=2)
    assert res[0]["bytes"] == exact + 9 * all_gather_diff_wire_bytes(777, SPEC)
