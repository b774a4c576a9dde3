"""The wire alone: a training step's collectives replayed with no compute (``--bounds``).

A step's collectives are read from a profile of that step (every NCCL collective leaves a
``record_param_comms`` event with its name, dtype, element counts, splits and group ranks), in
the order this rank issued them. Every rank replays its own list, which is the same program on
every rank, so the collectives match:

- **serial**: one after another on one communicator per group, as a synchronous step whose
  compute took no time would send them;
- **concurrent**: the weight all-gathers on one communicator and the reductions (all-to-all,
  reduce-scatter, all-reduce) on a second one, from two streams at once, as staleness 1 lets them
  share a full-duplex link.

The buffers are uint8 of the same byte counts (the wire carries bytes; an all-reduce or
reduce-scatter keeps its dtype, since the backend reduces it). Each replay runs ``repeats`` times
after one warm-up and reports the median. ``summarize`` gives the byte totals by kind.
"""

from __future__ import annotations

import ast
import contextlib
import gzip
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_DTYPES = {
    "Float": torch.float32,
    "BFloat16": torch.bfloat16,
    "Half": torch.float16,
    "Byte": torch.uint8,
    "Char": torch.int8,
    "Int": torch.int32,
    "Long": torch.int64,
    "Double": torch.float64,
}
GATHER, REDUCE = "gather", "reduce"


@dataclass(frozen=True)
class Collective:
    kind: str
    """``all_gather``, ``all_to_all``, ``all_reduce`` or ``reduce_scatter``."""
    dtype: torch.dtype
    in_nelems: int
    out_nelems: int
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def phase(self) -> str:
        return GATHER if self.kind == "all_gather" else REDUCE

    @property
    def nbytes(self) -> int:
        """Bytes this rank hands over (qsdp's convention: the input)."""
        return self.in_nelems * self.dtype.itemsize


def _kind(name: str) -> str | None:
    n = name.lower().replace("_", "")
    if "allgather" in n:
        return "all_gather"
    if "alltoall" in n:
        return "all_to_all"
    if "reducescatter" in n:
        return "reduce_scatter"
    if "allreduce" in n:
        return "all_reduce"
    return None  # barrier, broadcast, send/recv: not part of a step's data path


def _ints(text: object) -> tuple[int, ...]:
    if text in (None, "", "[]"):
        return ()
    value = ast.literal_eval(text) if isinstance(text, str) else text
    return tuple(int(v) for v in value)


def parse(events: list[dict]) -> tuple[list[Collective], list[str]]:
    """The collectives of a Chrome trace's events in issue order, and the names skipped."""
    found, skipped, seen = [], [], set()
    for e in sorted(
        (e for e in events if e.get("name") == "record_param_comms"), key=lambda e: e["ts"]
    ):
        args = e.get("args", {})
        name = str(args.get("Collective name", ""))
        key = (args.get("Process Group Name"), args.get("Seq"), name)
        if args.get("Seq") is not None and key in seen:
            continue  # the same collective recorded twice (the c10d op and the backend)
        seen.add(key)
        kind = _kind(name)
        dtype = _DTYPES.get(str(args.get("dtype")))
        if kind is None or dtype is None:
            skipped.append(name)
            continue
        found.append(
            Collective(
                kind=kind,
                dtype=dtype,
                in_nelems=int(args.get("In msg nelems", 0)),
                out_nelems=int(args.get("Out msg nelems", 0)),
                in_splits=_ints(args.get("In split size")),
                out_splits=_ints(args.get("Out split size")),
                ranks=_ints(args.get("Process Group Ranks")),
            )
        )
    return found, skipped


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarize(colls: list[Collective]) -> dict[str, int]:
    """Bytes handed over per kind, and calls."""
    out: dict[str, int] = {}
    for c in colls:
        out[f"{c.kind}_bytes"] = out.get(f"{c.kind}_bytes", 0) + c.nbytes
        out[f"{c.kind}_calls"] = out.get(f"{c.kind}_calls", 0) + 1
    return out


class Replayer:
    """Two communicators for every group the collectives use (made collectively, in one order
    on every rank), and buffers for the replay."""

    def __init__(self, colls: list[Collective], device: torch.device) -> None:
        self.device = device
        mine = sorted({c.ranks for c in colls})
        everyone: list[list] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        self.groups: dict[tuple[int, ...], tuple] = {}
        for ranks in sorted({tuple(r) for lists in everyone for r in lists}):
            pair = (dist.new_group(list(ranks)), dist.new_group(list(ranks)))
            self.groups[ranks] = pair
        self.colls = colls
        self.buffers = [self._buffers(c) for c in colls]

    def _buffers(self, c: Collective) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = c.dtype if c.kind in ("all_reduce", "reduce_scatter") else torch.uint8
        scale = 1 if dtype is c.dtype else c.dtype.itemsize
        inp = torch.zeros(c.in_nelems * scale, dtype=dtype, device=self.device)
        out = (
            inp
            if c.kind == "all_reduce"
            else torch.empty(c.out_nelems * scale, dtype=dtype, device=self.device)
        )
        return inp, out

    def _issue(self, c: Collective, bufs, second: bool) -> dist.Work:
        group = self.groups[c.ranks][1 if second else 0]
        inp, out = bufs
        if c.kind == "all_gather":
            return dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
        if c.kind == "reduce_scatter":
            return dist.reduce_scatter_tensor(out, inp, group=group, async_op=True)
        if c.kind == "all_reduce":
            return dist.all_reduce(inp, group=group, async_op=True)
        scale = 1 if inp.dtype is c.dtype else c.dtype.itemsize
        return dist.all_to_all_single(
            out,
            inp,
            [s * scale for s in c.out_splits] or None,
            [s * scale for s in c.in_splits] or None,
            group=group,
            async_op=True,
        )

    def _sync(self, works: list[dist.Work]) -> None:
        # every work waited for (on CUDA: the stream waits), or c10d keeps it and its buffers
        for w in works:
            w.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Free the buffers and the communicators (NCCL holds buffers of its own per
        communicator). Call on every rank."""
        self.buffers = []
        for pair in self.groups.values():
            for group in pair:
                dist.destroy_process_group(group)
        self.groups = {}

    def _once(self, concurrent: bool) -> float:
        self._sync([])
        dist.barrier()
        t0 = time.perf_counter()
        works = []
        if not concurrent:
            for c, b in zip(self.colls, self.buffers, strict=True):
                works.append(self._issue(c, b, False))
        else:
            for phase in (GATHER, REDUCE):
                stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
                with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                    for c, b in zip(self.colls, self.buffers, strict=True):
                        if c.phase == phase:
                            works.append(self._issue(c, b, phase == REDUCE))
        self._sync(works)
        elapsed = torch.tensor([time.perf_counter() - t0], device=self.device, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    def time(self, *, concurrent: bool, repeats: int = 3) -> float:
        self._once(concurrent)  # warm-up: the communicators connect
        return statistics.median(self._once(concurrent) for _ in range(repeats))
