"""Argument checks of the collectives, the byte counter, and the multi-process test helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import qsdp.comm as qc
from qsdp.comm import CommStats
from qsdp.comm._common import dist_all_gather
from qsdp.quant import QuantSpec
from qsdp.testing import count_dist_bytes, preload, run_distributed

S8 = QuantSpec(bits=8, group_size=32, scheme="absmax", rounding="nearest")
S4 = QuantSpec(bits=4, group_size=32, scheme="absmax", rounding="nearest")


def _bad_arguments(rank, ws):
    x, out = torch.randn(10), torch.empty(10 * ws)
    cases = [
        (TypeError, "QuantSpec", lambda: qc.all_gather(out, x, spec="int8")),
        (TypeError, "dtype", lambda: qc.all_gather(out, x.long(), spec=S8)),
        (ValueError, "world_size", lambda: qc.all_gather(torch.empty(7), x, spec=S8)),
        (
            ValueError,
            "contiguous",
            lambda: qc.all_gather(torch.empty(10 * ws, 2)[:, 0], x, spec=S8),
        ),
        (ValueError, "seed", lambda: qc.all_gather(out, x, spec=S8, seed=-1)),
        (ValueError, "bucket", lambda: qc.all_gather(out, x, spec=S8, bucket=2**32)),
        (
            ValueError,
            "pad it",
            lambda: qc.reduce_scatter(torch.empty(1), torch.randn(ws * 3 + 1), spec=S8),
        ),
        (
            ValueError,
            "output has",
            lambda: qc.reduce_scatter(torch.empty(4), torch.randn(ws * 3), spec=S8),
        ),
        (
            ValueError,
            "PREMUL_SUM",
            lambda: qc.reduce_scatter(
                torch.empty(3), torch.randn(ws * 3), spec=S8, op=dist.ReduceOp.MAX
            ),
        ),
        (ValueError, "op='max'", lambda: qc.two_phase_all_reduce(x, spec=S8, op="max")),
        (ValueError, "carrier", lambda: qc.integer_all_reduce(x, carrier="int16")),
        (ValueError, "rounding", lambda: qc.integer_all_reduce(x, rounding="up")),
        (TypeError, "CommStats", lambda: qc.all_gather(out, x, spec=S8, stats={})),
    ]
    mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("inter", "intra"))
    had8 = QuantSpec(bits=8, group_size=64, scheme="absmax", rounding="nearest", hadamard_block=32)
    cases += [
        (
            ValueError,
            "group_size",
            lambda: qc.hierarchical_reduce_scatter(
                torch.empty(3),
                torch.randn(3 * ws),
                mesh=mesh,
                intra_spec=S8,
                inter_spec=QuantSpec(bits=4, group_size=64, scheme="absmax", rounding="nearest"),
            ),
        ),
        (
            ValueError,
            "hadamard_block",
            lambda: qc.hierarchical_reduce_scatter(
                torch.empty(3),
                torch.randn(3 * ws),
                mesh=mesh,
                intra_spec=had8,
                inter_spec=QuantSpec(bits=4, group_size=64, scheme="absmax", rounding="nearest"),
            ),
        ),
        (
            ValueError,
            "pipeline",
            lambda: qc.hierarchical_reduce_scatter(
                torch.empty(3),
                torch.randn(3 * ws),
                mesh=mesh,
                intra_spec=S8,
                inter_spec=S4,
                pipeline=0,
            ),
        ),
        (
            TypeError,
            "DeviceMesh",
            lambda: qc.hierarchical_reduce_scatter(
                torch.empty(3), torch.randn(3 * ws), mesh=None, intra_spec=S8, inter_spec=S4
            ),
        ),
        (
            ValueError,
            "2-D",
            lambda: qc.hierarchical_reduce_scatter(
                torch.empty(3),
                torch.randn(3 * ws),
                mesh=init_device_mesh("cpu", (ws,)),
                intra_spec=S8,
                inter_spec=S4,
            ),
        ),
    ]
    stats = CommStats()
    with count_dist_bytes() as sent:
        for exc, match, call in cases:
            with pytest.raises(exc, match=match):
                call()
    # A rejected call sends nothing and counts nothing.
    assert sent.total_calls == 0 and stats.snapshot() == {}
    # A NaN: the ranks agree on it (one small all-reduce, counted as "nonfinite_check") and all
    # raise before the all-gather itself is issued.
    stats = CommStats()
    with count_dist_bytes() as sent, pytest.raises(ValueError, match="NaN"):
        qc.all_gather(out, torch.full((10,), float("nan")), spec=S8, stats=stats)
    assert sent.calls == {"all_reduce": 1}
    assert set(stats.snapshot()) == {"all_gather", "nonfinite_check"}
    assert stats["all_gather"].bytes == 0


def test_bad_arguments_raise_before_any_communication():
    run_distributed(_bad_arguments, 2)


def test_stats_counter():
    stats = CommStats()
    stats.count_call("x")
    stats.add_bytes("x", 10)
    stats.add_bytes("x", 5)
    stats.add_bytes("y", 1)
    assert stats["x"] == qc.CollectiveCounts(calls=1, bytes=15, dist_calls=2)
    assert stats["missing"] == qc.CollectiveCounts()
    assert stats.total_bytes == 16
    stats.reset()
    assert stats.snapshot() == {} and stats.total_bytes == 0


def test_noise_streams_are_distinct():
    from qsdp.comm._common import noise_stream

    keys = [(r, c, h, p) for r in range(16) for c in range(16) for h in (0, 1) for p in range(4)]
    streams = {noise_stream(r, c, hop=h, piece=p) for r, c, h, p in keys}
    assert len(streams) == len(keys)
    assert max(streams) < 0xFFFFFFF0  # the quantizer's reserved streams stay free


def _fails_on_rank_one(rank, ws):
    if rank == 1:
        raise KeyError("deliberate failure on rank one")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone
    return rank


def test_run_distributed_propagates_worker_tracebacks():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2") as info:
        run_distributed(_fails_on_rank_one, 2, pg_timeout_s=60)
    assert "deliberate failure on rank one" in str(info.value)
    assert "_fails_on_rank_one" in str(info.value)  # the worker's own traceback
    assert time.monotonic() - start < 30  # the stuck peer is killed, not waited for


def _dies_on_rank_one(rank, ws, how):
    if rank == 1:
        if how == "exit":
            os._exit(3)  # no report, no traceback: as a crash in native code would leave
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for the peer that is gone
    return rank


@pytest.mark.parametrize("how, code", [("exit", "exit code 3"), ("kill", "exit code -9 (SIGKILL)")])
def test_run_distributed_names_a_dead_worker_and_its_exit_code(how, code):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_dies_on_rank_one, 2, how, timeout_s=60, pg_timeout_s=60)
    message = str(info.value)
    assert f"rank 1 of 2 died with {code}" in message, message
    assert "did not finish" not in message and "failed on rank 0" not in message, message
    assert time.monotonic() - start < 15  # seen when it happens, not at the 60 s timeout


def _imported_first(rank, ws, name):
    """Whether module ``name`` is in this rank's ``sys.modules``, and imported before this test
    module (a module enters ``sys.modules`` as its import starts: one that this module had
    imported would come after it)."""
    names = list(sys.modules)
    return name in names and names.index(name) < names.index(__name__)


_PRELOADED = """
from qsdp.testing import preload, run_distributed
from tests.comm.test_api import _imported_first
preload("xml.dom.minidom", "no_such_module_here")
print(run_distributed(_imported_first, 1, "xml.dom.minidom"))
"""


def test_preload_imports_once_in_the_server_the_ranks_fork_from():
    # in a fresh interpreter: this process's server may have started already
    # (a name that does not import is skipped: the ranks still run)
    root = Path(__file__).resolve().parents[2]  # (where ``tests`` imports from)
    done = subprocess.run(
        [sys.executable, "-c", _PRELOADED], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[True]", done.stdout + done.stderr
    with pytest.raises(ValueError, match="'numpy; rm' is not a module name"):
        preload("numpy; rm")


def _returns(rank, ws, offset):
    return rank * 10 + ws + offset


def test_run_distributed_reports_a_group_it_cannot_join():
    """A failure to join the group (here a backend that does not exist) is reported as such,
    after one fresh start ([Note: joining again]), and fn never runs."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="joining the process group failed") as info:
        run_distributed(_returns, 2, 0, backend="no-such-backend", timeout_s=60)
    assert "_returns failed on rank" in str(info.value)
    assert time.monotonic() - start < 30


def test_run_distributed_returns_per_rank_values():
    assert run_distributed(_returns, 3, 5) == [8, 18, 28]


def _counts_bytes(rank, ws):
    with count_dist_bytes() as sent:
        dist.all_reduce(torch.ones(3))
        dist.all_to_all_single(
            torch.empty(2 * ws, dtype=torch.uint8), torch.zeros(2 * ws, dtype=torch.uint8)
        )
        dist_all_gather()(torch.empty(ws * 5, dtype=torch.int8), torch.zeros(5, dtype=torch.int8))
    name = dist_all_gather().__name__
    assert sent.bytes == {"all_reduce": 12, "all_to_all_single": 2 * ws, name: 5}
    assert sent.total_calls == 3
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13: the old name calls the new one
        with warnings.catch_warnings(), count_dist_bytes() as sent:
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(torch.empty(ws * 5), torch.zeros(5))
        assert sent.bytes == {"all_gather_into_tensor": 20}  # counted once, not twice


def test_count_dist_bytes():
    run_distributed(_counts_bytes, 2)


def _tensor_result(rank, ws):
    return {"rank": rank, "t": torch.arange(1000, dtype=torch.float32) * (rank + 1)}


def test_run_distributed_returns_tensors_by_value_after_the_workers_exit():
    """Results travel by value: a tensor sent as a shared-memory handle had to be fetched from
    its worker, which may have exited first (a 'connection reset by peer' flake in CI)."""
    out = run_distributed(_tensor_result, 3)
    assert [o["rank"] for o in out] == [0, 1, 2]
    for r, o in enumerate(out):
        assert torch.equal(o["t"], torch.arange(1000, dtype=torch.float32) * (r + 1))
