"""Host time of a whole FSDP2 training step, plain beside qsdp's recipes, without wire or kernels.

    PYTHONPATH=src python benchmarks/host_per_step.py --out r.json [--recipes qsdp-w8g8 ...]

What a compressed FSDP2 step adds on the CPU (issue 32: on NVLink the step is host-bound): a
stack of ``--blocks`` small residual MLP blocks (d ``--d``, a LayerNorm and two Linears each,
every block ``fully_shard``-ed, 1-D parameters sent raw by the recipes' policies), a forward and
backward per step on a ``fake`` process group of 4 ranks (collectives return at once) with every
quantizer kernel a no-op (``host_per_bucket.py``'s stubs), so neither wire nor kernel time is
counted: plain FSDP2's own Python and dispatch, and each recipe's on top. Recipes run with
``nonfinite="zero"`` (stubbed kernels leave garbage behind; the verdict still runs, its zeroing
on the device counted like the rest). Rows: median milliseconds per step over ``--steps``;
the torch ops the Python issued in one profiled step (not those inside other ops); qsdp's hook
calls and microseconds per call of each hook kind (the ``qsdp::`` profiler scopes; profiled,
so slower than the timed steps).
Runs on any machine; compare rows of one run.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import host_per_bucket  # benchmarks/, the script's own folder: the kernel stubs
import qsdp


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 3 * d)
        self.fc2 = nn.Linear(3 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


def build(recipe: str, blocks: int, d: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(d) for _ in range(blocks)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    if recipe != "plain":
        qsdp.compress_fsdp(model, qsdp.recipe(recipe, nonfinite="zero"))
    return model


def _in_aten(event) -> bool:
    """Whether a profiler event runs inside a torch op (not one the Python issued itself)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def measure(recipe: str, *, blocks: int, d: int, steps: int) -> dict:
    model = build(recipe, blocks, d)
    x = torch.randn(4, d)

    def step() -> None:
        model(x).pow(2).mean().backward()

    for _ in range(5):  # first-call work (plans, caches) out of the timing
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::") and not _in_aten(e))
    hooks: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.name.startswith("qsdp::"):
            kind = e.name.split(" (")[0]
            hooks[kind].append(e.cpu_time_total)
    return {
        "recipe": recipe,
        "ms_per_step": round(statistics.median(times) * 1e3, 3),
        "issued_ops": ops,
        "hook_calls": sum(len(v) for v in hooks.values()),
        "hooks": {
            k: {"calls": len(v), "us_per_call": round(statistics.mean(v), 1)}
            for k, v in sorted(hooks.items())
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipes", nargs="*", default=["qsdp-w8g8", "sdp4bit", "cgx"])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--label", default="", help="a name for this code version in the JSON")
    a = p.parse_args()
    host_per_bucket._stub_kernels()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    rows = [measure(r, blocks=a.blocks, d=a.d, steps=a.steps) for r in ["plain", *a.recipes]]
    plain = rows[0]["ms_per_step"]
    for r in rows:
        r["extra_ms_vs_plain"] = round(r["ms_per_step"] - plain, 3)
        kinds = ", ".join(
            f"{k} {v['calls']} x {v['us_per_call']:.0f} us" for k, v in r["hooks"].items()
        )
        print(
            f"{r['recipe']:10s} {r['ms_per_step']:7.2f} ms a step (+{r['extra_ms_vs_plain']:.2f}), "
            f"{r['issued_ops']} ops; {kinds or 'no qsdp hooks'}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "host_per_step",
                "label": a.label,
                "device": "cpu",
                "kernels": "stubbed",
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "world_size": 4,
                "blocks": a.blocks,
                "d": a.d,
                "rows": rows,
            },
            indent=2,
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
