"""What a profiled step's GPU streams did: busy time, the compute stream's waits, rank skew.

    python benchmarks/trace_summary.py DIR/2x2_cgx_rank0.txt.trace.json.gz [more ranks' traces]

Reads the Chrome traces that ``--profile DIR`` writes (``bench_fsdp_step.py --profile-all-ranks``
writes one per rank) and prints, per trace, each CUDA stream's busy time and its largest kernels;
the compute stream's idle gaps, each charged to the kernel on another stream that ended when the
gap ended (what the compute stream waited for); and, given two or more traces of one host (their
clocks agree), the start of each NCCL kernel of a stream on every rank: a collective's kernel
spins until its last peer arrives, so a kernel's busy time is often another rank's lateness.
``--timeline``: every NCCL kernel (stream, start, duration) and the time between the first and
the last when none ran (the link idle as this rank saw it: which stream each exchange ran on
shows two communicators that share one stream). ``--lateness`` (two or more ranks' traces): for
each collective (the n-th NCCL kernel of a stream on every rank), the time its early ranks' kernels
spun waiting for the last, charged to what held the last one back: the kernel before it on its
stream, its host launch, another stream's kernel it waited on, or none of these (its CTAs waited
for free SMs).
The compute stream is the one with the most kernels. Profiled steps run slower than measured
ones (the profiler's host overhead per op): read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from pathlib import Path

KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def _read(path: Path) -> list[dict]:
    """Every event of a Chrome trace (gzipped or not)."""
    with gzip.open(path) if str(path).endswith(".gz") else open(path) as f:
        return json.load(f)["traceEvents"]


def _device(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in KINDS]


def _launch_ends(events: list[dict]) -> dict[int, float]:
    return {
        e["args"]["correlation"]: e["ts"] + e["dur"]
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
    }


def load(path: Path) -> list[dict]:
    """The trace's device events (kernels, copies, sets) as dicts with ts/dur in microseconds."""
    return _device(_read(path))


def launches(path: Path) -> dict[int, float]:
    """When the host's launch call of each correlation id ended (us): kernels launched one by
    one, and a CUDA graph's kernels (their correlation is the graph launch's)."""
    return _launch_ends(_read(path))


def _short(name: str) -> str:
    return name.split("(")[0][:60]


def streams(events: list[dict], top: int = 4) -> list[dict]:
    """Per stream, busiest first: busy ms, kernel count, first and last ms, top kernels."""
    t0 = min(e["ts"] for e in events)
    by: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        by[e["tid"]].append(e)
    out = []
    for tid, es in by.items():
        names: collections.Counter = collections.Counter()
        for e in es:
            names[_short(e["name"])] += e["dur"]
        out.append(
            {
                "stream": tid,
                "busy_ms": sum(e["dur"] for e in es) / 1e3,
                "kernels": len(es),
                "from_ms": (min(e["ts"] for e in es) - t0) / 1e3,
                "to_ms": (max(e["ts"] + e["dur"] for e in es) - t0) / 1e3,
                "top": [(n, t / 1e3) for n, t in names.most_common(top)],
            }
        )
    return sorted(out, key=lambda s: -s["busy_ms"])


def compute_stream(events: list[dict]) -> int:
    """The stream with the most kernels (the forward's and backward's)."""
    return collections.Counter(e["tid"] for e in events).most_common(1)[0][0]


def waits(events: list[dict], min_gap_us: float = 200.0) -> tuple[float, list[tuple]]:
    """The compute stream's idle gaps of at least ``min_gap_us``: total ms, and per cause
    (stream, kernel ending within 30 us of the gap's end, or "host" when none did) the ms and
    the count, largest first."""
    tid = compute_stream(events)
    mine = sorted((e for e in events if e["tid"] == tid), key=lambda e: e["ts"])
    others = sorted((e for e in events if e["tid"] != tid), key=lambda e: e["ts"] + e["dur"])
    ends = [e["ts"] + e["dur"] for e in others]
    total, cause_ms, cause_n = 0.0, collections.Counter(), collections.Counter()
    for a, b in zip(mine, mine[1:], strict=False):
        start, end = a["ts"] + a["dur"], b["ts"]
        if end - start < min_gap_us:
            continue
        total += end - start
        i = bisect.bisect_right(ends, end - 30)  # the first to end within 30 us of the gap's end
        near = others[i] if i < len(ends) and ends[i] < end + 30 else None
        key = (near["tid"], _short(near["name"])) if near else ("host", "")
        cause_ms[key] += (end - start) / 1e3
        cause_n[key] += 1
    return total / 1e3, [(k, ms, cause_n[k]) for k, ms in cause_ms.most_common()]


def skew(traces: list[list[dict]], tid: int, pattern: str) -> list[list[float]]:
    """Start ms (against the first trace's first event) of the kernels on stream ``tid`` whose
    name holds ``pattern``, in order, one list per trace (rows: the n-th kernel on each rank)."""
    t0 = min(e["ts"] for e in traces[0])
    cols = [
        sorted((e["ts"] - t0) / 1e3 for e in t if e["tid"] == tid and pattern in e["name"])
        for t in traces
    ]
    return [list(row) for row in zip(*cols, strict=False)]  # (the shortest)


def lateness(
    traces: list[list[dict]], launched: list[dict[int, float]], near_us: float = 30.0
) -> tuple[float, list[tuple]]:
    """Each collective's wait on its last rank, charged to what held that rank back.

    A collective is the n-th NCCL kernel of one stream on every rank (the same code creates the
    same streams in the same order). Its kernel spins on each rank from its start until the last
    rank's starts; those early ranks' summed spin is the collective's wait. What started the last
    rank's kernel is what ended within ``near_us`` before it: the previous device op on its own
    stream (``stream``), the host's launch call (``host``), a kernel on another stream it waited
    on through an event (``event``), or nothing (``sms``: it was ready and launched, yet its CTAs
    found no free SMs). Returns the total wait in ms and, per (cause, name), the ms and the count,
    largest first."""
    total, cause_ms, cause_n = 0.0, collections.Counter(), collections.Counter()
    per_rank = []
    for t in traces:
        by: dict[int, list[dict]] = collections.defaultdict(list)
        for e in sorted(t, key=lambda e: e["ts"]):
            by[e["tid"]].append(e)
        ends = sorted((e["ts"] + e["dur"], i, e) for i, e in enumerate(t))
        per_rank.append((by, ends))
    streams = {e["tid"] for e in traces[0] if e["name"].startswith("nccl")}
    for tid in sorted(streams):
        cols = []
        for by, _ in per_rank:
            es = by.get(tid, [])
            cols.append([(i, e) for i, e in enumerate(es) if e["name"].startswith("nccl")])
        for row in zip(*cols, strict=False):
            starts = [e["ts"] for _, e in row]
            last = max(range(len(row)), key=lambda r: starts[r])
            wait = sum(starts[last] - s for s in starts) / 1e3
            if wait <= 0:
                continue
            i, kern = row[last]
            by, ends = per_rank[last]
            start = kern["ts"]
            prev = by[tid][i - 1] if i > 0 else None
            host = launched[last].get(kern.get("args", {}).get("correlation", -1))
            if prev is not None and 0 <= start - (prev["ts"] + prev["dur"]) < near_us:
                key = ("stream", _short(prev["name"]))
            elif host is not None and 0 <= start - host < near_us:
                key = ("host", "")
            else:
                key = ("sms", "")
                j = bisect.bisect_right(ends, (start, float("inf"))) - 1
                while j >= 0 and start - ends[j][0] < near_us:
                    if ends[j][2]["tid"] != tid:
                        other = ends[j][2]
                        key = ("event", f"stream {other['tid']} {_short(other['name'])}")
                        break
                    j -= 1
            total += wait
            cause_ms[key] += wait
            cause_n[key] += 1
    return total, [(k, ms, cause_n[k]) for k, ms in cause_ms.most_common()]


def nccl_timeline(events: list[dict]) -> list[tuple[int, float, float, str]]:
    """Every NCCL kernel as (stream, start ms, duration ms, short name), in start order (ms
    against the trace's first device event)."""
    t0 = min(e["ts"] for e in events)
    nccl = sorted((e for e in events if e["name"].startswith("nccl")), key=lambda e: e["ts"])
    return [(e["tid"], (e["ts"] - t0) / 1e3, e["dur"] / 1e3, _short(e["name"])) for e in nccl]


def wire_idle(events: list[dict], pattern: str = "nccl") -> tuple[float, float]:
    """From the first start to the last end of the kernels whose name holds ``pattern`` (every
    NCCL kernel by default; ``"Sum_u8"``: integer codes' SUMs): that span in ms, and the ms in
    it when none of them ran on any stream (the link idle between them, as this rank saw it)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if pattern in e["name"])
    if not spans:
        return 0.0, 0.0
    idle, reach = 0.0, spans[0][1]
    for start, end in spans[1:]:
        idle += max(0.0, start - reach)
        reach = max(reach, end)
    return (reach - spans[0][0]) / 1e3, idle / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--skew-pattern", default="AllGather", help="NCCL kernel name for --skew")
    p.add_argument("--skew-stream", type=int, help="the stream (tid) whose kernels to line up")
    p.add_argument(
        "--timeline", action="store_true", help="every NCCL kernel, and the wire's idle time"
    )
    p.add_argument(
        "--wire-pattern", default="nccl", help="--timeline: the kernels the idle time is between"
    )
    p.add_argument(
        "--lateness",
        action="store_true",
        help="(2+ traces) each collective's wait for its last rank, charged to what held it",
    )
    a = p.parse_args()
    loaded, launched = [], []
    for t in a.traces:  # each trace parsed once (tens of MB of JSON), its events not kept
        events = _read(t)
        loaded.append(_device(events))
        launched.append(_launch_ends(events) if a.lateness else {})
    for path, events in zip(a.traces, loaded, strict=True):
        span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
        print(f"== {path.name}: GPU span {span:.1f} ms, {len(events)} device events")
        for s in streams(events):
            print(
                f"  stream {s['stream']}: busy {s['busy_ms']:.1f} ms, {s['kernels']} kernels, "
                f"{s['from_ms']:.1f}-{s['to_ms']:.1f} ms"
            )
            for name, ms in s["top"]:
                print(f"      {ms:8.2f} ms  {name}")
        total, causes = waits(events)
        print(f"  compute stream {compute_stream(events)} idle {total:.1f} ms in gaps > 0.2 ms:")
        for (tid, name), ms, n in causes[:6]:
            print(f"      {ms:8.1f} ms  {n:3d}x  waiting for stream {tid} {name}")
        if a.timeline:
            span, idle = wire_idle(events, a.wire_pattern)
            print(
                f"  kernels holding {a.wire_pattern!r} over {span:.1f} ms, none running for "
                f"{idle:.1f} ms of it; every NCCL kernel:"
            )
            for tid, start, dur, name in nccl_timeline(events):
                print(f"      stream {tid:4d} {start:8.1f} +{dur:7.1f} ms  {name}")
    if len(loaded) > 1 and a.lateness:
        total, causes = lateness(loaded, launched)
        resident = sum(e["dur"] for t in loaded for e in t if e["name"].startswith("nccl"))
        print(
            f"== NCCL kernels resident {resident / 1e3:.1f} ms summed over the traces, of which "
            f"{total:.1f} ms spinning for a later rank; what held the last rank back:"
        )
        for (cause, name), ms, n in causes[:12]:
            print(f"      {ms:8.1f} ms  {n:4d}x  {cause} {name}")
    if len(loaded) > 1 and a.skew_stream is not None:
        rows = skew(loaded, a.skew_stream, a.skew_pattern)
        print(f"== stream {a.skew_stream} {a.skew_pattern!r} starts (ms), one column per trace")
        for row in rows:
            print(
                "  " + "  ".join(f"{x:8.1f}" for x in row) + f"   spread {max(row) - min(row):5.1f}"
            )


if __name__ == "__main__":
    main()
