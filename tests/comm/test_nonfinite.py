"""NaN/Inf given to a compressed collective: every rank reaches the same outcome at once.

Before issue #10 the offending rank raised inside its encode and its peers waited in the
exchange until the process group's timeout; a NaN in a rank's own (never encoded) chunk passed
silently. Now every rank raises the same error before anything is exchanged (``"raise"``), or
the NaN travels (``"propagate"``)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import qsdp.comm as qc
from qsdp.quant import QuantSpec
from qsdp.testing import run_distributed

S8 = QuantSpec(bits=8, group_size=16, scheme="absmax", rounding="stochastic")
S4 = QuantSpec(bits=4, group_size=16, scheme="minmax", rounding="nearest")
M = 21  # elements per chunk: not a multiple of the group


def _call(kind: str, x: torch.Tensor, world: int, spec: QuantSpec) -> torch.Tensor:
    if kind == "reduce_scatter":
        out = torch.empty(M)
        qc.reduce_scatter(out, x, spec=spec)
    elif kind == "all_gather":
        out = torch.empty(world * x.numel())
        qc.all_gather(out, x, spec=spec)
    elif kind == "two_phase":
        out = x.clone()
        qc.two_phase_all_reduce(out, spec=spec)
    elif kind == "all_gather_diff":
        out = torch.empty(world * x.numel())
        qc.all_gather_diff(out, x, torch.zeros(world * x.numel()), spec=spec)
    else:  # the two-level reduce-scatter on a 2 x (world / 2) mesh
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("inter", "intra"))
        inter = dataclasses.replace(spec, bits=4, scheme="absmax")
        out = torch.empty(M)
        qc.hierarchical_reduce_scatter(
            out, x, mesh=mesh, intra_spec=spec, inter_spec=inter, pipeline=2
        )
    return out


# (collective, world sizes, where the bad value sits: "peer" chunk bound for rank 0, "own"
# chunk of the bad rank)
CASES = [
    ("reduce_scatter", "peer"),
    ("reduce_scatter", "own"),
    ("all_gather", "own"),
    ("two_phase", "peer"),
    ("two_phase", "own"),
    ("all_gather_diff", "own"),
    ("hierarchical", "peer"),
    ("hierarchical", "own"),
]


def _worker(rank: int, world: int, bad_value: float) -> dict:
    bad_rank = world - 1
    out = {}
    for kind, where in CASES:
        if kind == "hierarchical" and world % 2:
            continue
        for spec in (S8, S4):
            x = torch.randn(world * M, generator=torch.Generator().manual_seed(rank))
            if rank == bad_rank:
                x[bad_rank * M + 3 if where == "own" else 5] = bad_value
            start = time.monotonic()
            try:
                _call(kind, x, world, spec)
                verdict = "passed"
            except ValueError as e:
                verdict = str(e)
            out[(kind, where, spec.scheme.value)] = (verdict, time.monotonic() - start)
        # "propagate": no verdict, the NaN reaches the result (here: rank 0's chunk)
        if kind == "reduce_scatter" and where == "peer":
            got = _call(kind, x, world, dataclasses.replace(S8, nonfinite="propagate"))
            out["propagate"] = bool(torch.isnan(got).any()) if rank == 0 else None
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_nonfinite_raises_on_every_rank_at_once(world):
    results = run_distributed(_worker, world, float("nan"), pg_timeout_s=30)
    for key in results[0]:
        if key == "propagate":
            assert results[0][key], "propagate mode must deliver the NaN"
            continue
        verdicts = {r[key][0] for r in results}
        assert len(verdicts) == 1, f"{key}: ranks disagree: {verdicts}"
        msg = verdicts.pop()
        assert "NaN/Inf" in msg and f"ranks [{world - 1}]" in msg, f"{key}: {msg}"
        assert "nonfinite='propagate'" in msg
        assert max(r[key][1] for r in results) < 5.0, f"{key}: a rank waited"


def test_inf_raises_too():
    results = run_distributed(_worker, 2, float("-inf"), pg_timeout_s=30)
    for key in results[0]:
        if key != "propagate":
            assert all("NaN/Inf" in r[key][0] for r in results), key
