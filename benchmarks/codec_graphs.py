"""What a CUDA graph would save one FSDP2 reduce-scatter hook: its call eager against replayed.

    PYTHONPATH=src python benchmarks/codec_graphs.py --out r.json     # one GPU

Issue 32 asks to weigh CUDA graphs for the codec segments: on NVLink the compressed FSDP2 step
is host-bound, and a reduce-scatter hook is most of qsdp's host share (a profiled `sdp4bit`
hook: ~1.7 ms of host, 37 torch ops, 10 launches). This times the plan's ``reduce_scatter`` of
one GPT block (d 2048, 12 parameters, 50.4 M elements; the 1-D ones raw by the recipe's policy)
as FSDP2 hands it over at ``--world`` ranks (a ``[world, m]`` bf16 input of this rank's shard
layout), on a ``fake`` process group (its collective returns at once, moving nothing: the wire
is not timed), with the real Triton kernels, three ways:

- ``eager``: the call as the hook makes it;
- ``graph``: the same call captured once in a ``torch.cuda.CUDAGraph`` and replayed (its
  buffers, its input's address and its stochastic-rounding key fixed at the capture);
- ``graph + copy-in``: the replay after copying the new gradient into the captured input
  (FSDP2 allocates its reduce-scatter input anew each step: a graph must read a fixed address);
- ``replayed``: the library's own replay (``reduce_scatter(graphs=qsdp.comm.CodecGraphs())``,
  what ``Schedule(graphs=True)`` runs): the input copied in, the step written to device
  memory (each call a new step), the encode replayed, the exchange, the decode replayed, the
  output copied out.

Per row: the host's microseconds a call (``--calls`` calls issued back to back, no
synchronisation) and the device's milliseconds a call (CUDA events around them). What a graph
would cost besides: its noise key is a launch argument frozen at the capture (the kernels would
have to read the step from device memory), a capture per input shape, and the copy-in.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import profiling  # benchmarks/, the script's own folder: the timing of every row
import qsdp
from qsdp import comm as qc

D = 2048
#: A GPT block's parameters in FSDP2's order (name, elements, shape).
LAYOUT = [
    ("ln1.weight", (D,)),
    ("ln1.bias", (D,)),
    ("attn.qkv.weight", (3 * D, D)),
    ("attn.qkv.bias", (3 * D,)),
    ("attn.proj.weight", (D, D)),
    ("attn.proj.bias", (D,)),
    ("ln2.weight", (D,)),
    ("ln2.bias", (D,)),
    ("mlp.fc1.weight", (4 * D, D)),
    ("mlp.fc1.bias", (4 * D,)),
    ("mlp.fc2.weight", (D, 4 * D)),
    ("mlp.fc2.bias", (D,)),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipes", nargs="*", default=["sdp4bit", "qsdp-w8g8", "cgx"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("codec_graphs.py captures CUDA graphs: it needs a GPU")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.world)
    device = torch.device("cuda")
    shards = [(name, -(-torch.Size(s).numel() // a.world), s) for name, s in LAYOUT]
    chunk = sum(n for _, n, _ in shards)
    results = []
    for name in a.recipes:
        config = qsdp.recipe(name)
        plan = config.grads.plan()
        shapes = [(n, k, s if len(s) == 1 else (k // s[1], s[1])) for n, k, s in shards]
        split = config.policy.split(shapes) if config.policy else None
        rows = torch.randn(a.world, chunk, device=device, dtype=torch.bfloat16)
        fresh = torch.randn_like(rows)
        out = torch.empty(chunk, device=device, dtype=torch.bfloat16)
        stats = qc.CommStats()

        def call(rows=rows, out=out, plan=plan, split=split, stats=stats) -> None:
            plan.reduce_scatter(
                out, rows, None, op="avg", split=split, seed=0, step=0, bucket=0, stats=stats
            )

        row = {"recipe": name, "world": a.world, "elements": chunk * a.world}
        row["eager"] = profiling.host_and_device(call, a.calls, a.rounds)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (capture needs its warm-up off the default stream)
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                call()
        except Exception as e:  # a host sync or an uncapturable op: what stops a graph
            row["graph"] = row["graph + copy-in"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        else:
            row["graph"] = profiling.host_and_device(graph.replay, a.calls, a.rounds)

            def copied(rows=rows, fresh=fresh, graph=graph) -> None:
                rows.copy_(fresh)
                graph.replay()

            row["graph + copy-in"] = profiling.host_and_device(copied, a.calls, a.rounds)
        graphs, steps = qc.CodecGraphs(), itertools.count()

        def replayed(
            rows=rows, out=out, plan=plan, split=split, stats=stats, graphs=graphs, steps=steps
        ) -> None:
            plan.reduce_scatter(
                out,
                rows,
                None,
                op="avg",
                split=split,
                seed=0,
                step=next(steps),
                bucket=0,
                stats=stats,
                graphs=graphs,
            )

        row["replayed"] = profiling.host_and_device(replayed, a.calls, a.rounds)
        results.append(row)
        for kind in ("eager", "graph", "graph + copy-in", "replayed"):
            r = row[kind]
            text = r.get("error") or f"host {r['host_us']:7.1f} us  device {r['device_ms']:.3f} ms"
            print(f"{name:10s} {kind:16s} {text}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "codec_graphs",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "rows": results,
            },
            indent=2,
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
