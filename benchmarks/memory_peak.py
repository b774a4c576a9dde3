"""Who holds the memory at a CUDA peak: the caching allocator's trace replayed to its highest
point, its live blocks grouped by where they were allocated.

``torch.cuda.max_memory_allocated`` says how high a step went, not what was there. This records
the allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks), replays
its alloc / free events to the moment the allocated bytes were highest and sums the blocks live
then by the line that allocated them: the innermost qsdp line of the stack, else the innermost
FSDP2 line, else the innermost line outside torch (the model, the benchmark), so that a
gradient held for a delayed reduction is told from FSDP2's own buffers and the optimizer's
state. A block that Python freed but the allocator still holds for another stream
(``record_stream``: its free is requested, not completed) counts as allocated, as
``max_memory_allocated`` counts it, and is marked ``[freed, held for a stream]``.

Used by ``bench_fsdp_step.py --mem-peak DIR`` (rank 0, one file per variant):
:func:`start` before the model is built, :func:`write` after the steps. Blocks allocated before
:func:`start` are one row (``(before recording)``), less what of them was freed since.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["Peak", "at_peak", "start", "where", "write"]

MAX_ENTRIES = 4_000_000
BEFORE = "(before recording)"


def start(*, max_entries: int = MAX_ENTRIES) -> int:
    """Start recording the allocator's history on CUDA; returns the bytes allocated now (the
    blocks the trace will not show being allocated)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    return torch.cuda.memory_allocated()


def where(frames: list[dict]) -> str:
    """The line a block is charged to, from its allocation's frames (innermost first)."""

    def line(f: dict) -> str:
        path = f["filename"]
        for root in ("/qsdp/", "/torch/", "/benchmarks/", "/qsdp_train/"):
            if root in path:
                path = root.strip("/") + "/" + path.split(root, 1)[1]
                break
        return f"{path}:{f['line']} {f['name']}"

    for test in (
        lambda p: "/qsdp/" in p,
        lambda p: "/torch/distributed/fsdp/" in p,
        lambda p: "/torch/" not in p and "<" not in p,
    ):
        for f in frames:
            if test(f["filename"]):
                return line(f)
    return line(frames[0]) if frames else "(no stack)"


@dataclass
class Peak:
    """The highest allocated bytes of a trace and who held them."""

    bytes: int = 0
    index: int = -1
    """The trace entry at which it was reached (-1: before the first)."""
    held: dict[str, tuple[int, int]] = field(default_factory=dict)
    """By :func:`where` label: (bytes, blocks) live at the peak."""
    entries: int = 0

    def table(self, *, top: int = 30) -> str:
        rows = sorted(self.held.items(), key=lambda kv: -kv[1][0])
        shown = rows[:top]
        rest = sum(b for _, (b, _) in rows[top:])
        out = [f"peak {self.bytes / 2**30:.3f} GiB at trace entry {self.index} of {self.entries}"]
        out += [f"{b / 2**30:9.3f} GiB {n:6d} blocks  {label}" for label, (b, n) in shown]
        if rest:
            out.append(f"{rest / 2**30:9.3f} GiB in {len(rows) - top} more lines")
        return "\n".join(out)


def at_peak(trace: list[dict], *, before: int = 0) -> Peak:
    """Replay ``trace`` (one device's entries of ``torch.cuda.memory._snapshot()``) from
    ``before`` bytes already allocated: the highest point and the blocks live at it."""
    cur, best, best_i = before, before, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            cur += e["size"]
            if cur > best:
                best, best_i = cur, i
        elif e["action"] == "free_completed":
            cur -= e["size"]
    live: dict[int, tuple[int, str]] = {}
    requested: set[int] = set()
    old = before
    for e in trace[: best_i + 1]:
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            requested.discard(e["addr"])
        elif a == "free_requested":
            requested.add(e["addr"])
        elif a == "free_completed":
            if e["addr"] in live:
                del live[e["addr"]]
            else:  # allocated before recording started
                old -= e["size"]
            requested.discard(e["addr"])
    held: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    if old:
        held[BEFORE] = [old, 0]
    for addr, (size, label) in live.items():
        if addr in requested:
            label += "  [freed, held for a stream]"
        held[label][0] += size
        held[label][1] += 1
    return Peak(
        bytes=best,
        index=best_i,
        held={k: (v[0], v[1]) for k, v in held.items()},
        entries=len(trace),
    )


def write(path: Path, device: torch.device, *, before: int, top: int = 30) -> Peak:
    """Stop recording and write the table of ``device``'s peak to ``path``; returns it."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][device.index or 0]
    peak = at_peak(trace, before=before)
    note = ""
    if len(trace) >= MAX_ENTRIES:
        note = f"\nthe trace is full ({len(trace)} entries): its first events were dropped"
    path.parent.mkdir(parents=True, exist_ok=True)
    most = torch.cuda.max_memory_allocated(device) / 2**30
    path.write_text(f"{peak.table(top=top)}\nmax_memory_allocated {most:.3f} GiB{note}\n")
    return peak
