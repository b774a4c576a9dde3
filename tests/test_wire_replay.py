"""benchmarks/wire_replay.py: a step's collectives read from a profile and replayed with no
compute (the wire-alone bound of bench_fsdp_step --bounds)."""

from __future__ import annotations

import torch

from qsdp.testing import run_distributed

from .bench_scripts import load


def _event(ts: int, name: str, seq: int | None, **args) -> dict:
    base = {"Collective name": name, "Process Group Name": "0", "Seq": seq}
    return {"name": "record_param_comms", "ts": ts, "args": base | args}


def _all_to_all(ts: int) -> dict:
    """A reduce-scatter's all-to-all with its splits (NCCL records it twice, same ``Seq``)."""
    return _event(
        ts,
        "all_to_allv",
        7,
        dtype="Byte",
        **{
            "In msg nelems": 10,
            "Out msg nelems": 10,
            "In split size": "[5, 5]",
            "Out split size": "[5, 5]",
            "Process Group Ranks": "[0, 1]",
        },
    )


# what NCCL records for one step of a 2-rank group: an all-gather of a 4-bit payload, the
# all-to-all of a reduce-scatter with its splits (recorded twice), a flag all-reduce, a barrier
EVENTS = [
    _all_to_all(30),
    _event(
        10,
        "_allgather_base",
        5,
        dtype="Byte",
        **{"In msg nelems": 6, "Out msg nelems": 12, "Process Group Ranks": "[0, 1]"},
    ),
    _all_to_all(31),
    _event(
        40,
        "allreduce",
        8,
        dtype="Int",
        **{"In msg nelems": 3, "Out msg nelems": 3, "Process Group Ranks": "[0, 1]"},
    ),
    _event(50, "barrier", 9, dtype="Byte", **{"Process Group Ranks": "[0, 1]"}),
    {"name": "aten::mm", "ts": 20, "args": {}},
]


def test_parse_reads_the_collectives_in_issue_order_once():
    wr = load("wire_replay")
    colls, skipped = wr.parse(EVENTS)
    assert [c.kind for c in colls] == ["all_gather", "all_to_all", "all_reduce"]
    assert skipped == ["barrier"]
    assert colls[1].in_splits == (5, 5) and colls[1].ranks == (0, 1)
    assert [c.phase for c in colls] == ["gather", "reduce", "reduce"]
    assert wr.summarize(colls) == {
        "all_gather_bytes": 6,
        "all_gather_calls": 1,
        "all_to_all_bytes": 10,
        "all_to_all_calls": 1,
        "all_reduce_bytes": 12,
        "all_reduce_calls": 1,
    }


def _replay(rank: int, world: int) -> list[float]:
    wr = load("wire_replay")
    colls, _ = wr.parse(EVENTS)
    replay = wr.Replayer(colls, torch.device("cpu"))
    times = [replay.time(concurrent=False, repeats=1), replay.time(concurrent=True, repeats=1)]
    replay.close()
    assert replay.groups == {} and replay.buffers == []
    return times


def test_every_rank_replays_the_same_collectives_serially_and_concurrently():
    times = run_distributed(_replay, 2)
    assert times[0] == times[1] and all(t > 0 for t in times[0])  # the slowest rank's time
