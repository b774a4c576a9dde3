"""Staleness 1 as the README ships it, in short runs on the CPU, against the seeds' noise.

    PYTHONPATH=src python benchmarks/staleness_short.py --out r.json [--steps 40] [--seeds 0 1 2]

Issue 34 asks that ``qsdp.compress_fsdp(model, recipe, schedule=qsdp.Schedule(staleness=1))``
with no further settings end within the bounds in short runs too: its held-out check (a small
GPT, 2 ranks, AdamW at 3e-3, 40 steps) must end within 5% of the uncompressed loss. This runs
that check as a user would, the README's loop and nothing else: the trainer's GPT (``cpu-tiny``,
4 blocks of 128, byte-level) on the built-in Shakespeare corpus, every block and the root
``fully_shard``-ed, 2 gloo processes (``--world``), AdamW (betas 0.9/0.95) at a constant
``--lr`` with no warm-up and no clipping (the README's loop has neither), ``--batch`` windows
of 64 bytes a rank a step, drawn as ``qsdp train`` draws them (``qsdp_train.batches``).
Variants, each over every seed (the seed sets the initial weights and the windows, the same for
every variant of a seed):

- ``plain``: FSDP2 without qsdp (the baseline);
- ``sdp4bit``: ``compress_fsdp(model, "sdp4bit")``;
- ``sdp4bit-stale``: ``compress_fsdp(model, "sdp4bit", schedule=Schedule(staleness=1))``, the
  loop skipping the step that applied nothing and draining after the last backward;
- ``sdp4bit-stale-0``: the same from the first step (``Schedule(staleness=1, start=0)``), the
  delayed schedule without the synchronous start.

Per run: the mean training loss of the last 5 steps and the validation loss (``--val-batches``
fixed batches of the held-out split, every rank the same) at the end. Printed per variant: the
mean over seeds and its ratio to ``plain``'s mean, beside ``plain``'s spread over seeds (the
noise band: its max over its min).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import qsdp
from qsdp.testing import run_distributed
from qsdp_train.batches import Batches
from qsdp_train.data import open_data, prepare_data
from qsdp_train.model import GPT, PRESETS

CTX = 64
VARIANTS = ("plain", "sdp4bit", "sdp4bit-stale", "sdp4bit-stale-0")


def _run(rank: int, world: int, variant: str, seed: int, a: argparse.Namespace, data: str) -> dict:
    d = open_data(Path(data))
    torch.manual_seed(seed)
    model = GPT(PRESETS["cpu-tiny"].with_vocab(d.vocab_size))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = None
    if variant != "plain":
        schedule = {
            "sdp4bit": None,
            "sdp4bit-stale": qsdp.Schedule(staleness=1),
            "sdp4bit-stale-0": qsdp.Schedule(staleness=1, start=0),
        }[variant]
        qsdp.compress_fsdp(model, "sdp4bit", schedule=schedule)
        state = qsdp.fsdp.comm_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95))
    batches = Batches(d)  # the trainer's windows: the same for every variant of a seed
    shape = dict(micro_batch=a.batch, block_size=CTX)
    losses = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        x, y = batches.train_batch(step, 0, rank=rank, world_size=world, seed=seed, **shape)
        _, loss = model(x, y)
        loss.backward()
        if state is None or not state.applied_nothing:
            opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if state is not None and state.in_flight:
        state.drain()  # the last step's gradient
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - t0
    val = 0.0
    with torch.no_grad():  # the same validation batches on every rank
        for x, y in batches.val_batches(a.val_batches, rank=0, world_size=1, **shape):
            val += float(model(x, y)[1]) / a.val_batches
    delayed = getattr(state, "delayed_since", None) if state is not None else None
    return {"losses": losses, "val": val, "delayed_since": delayed, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    a = p.parse_args()
    data = str(prepare_data(None, "byte"))  # the built-in corpus, from its pinned package
    runs = []
    for variant in a.variants:
        for seed in a.seeds:
            r = run_distributed(_run, a.world, variant, seed, a, data, timeout_s=1800)[0]
            final = statistics.fmean(r["losses"][-5:])
            runs.append({"variant": variant, "seed": seed, "final_train": final, **r})
            print(
                f"{variant:16s} seed {seed}: train {final:.4f} val {r['val']:.4f} "
                f"(delayed from {r['delayed_since']}) {r['seconds']:.1f} s",
                flush=True,
            )
    summary = {}
    for variant in a.variants:
        mine = [r for r in runs if r["variant"] == variant]
        summary[variant] = {
            "val_mean": statistics.fmean(r["val"] for r in mine),
            "val_min": min(r["val"] for r in mine),
            "val_max": max(r["val"] for r in mine),
            "train_mean": statistics.fmean(r["final_train"] for r in mine),
        }
    if "plain" in summary:
        base = summary["plain"]
        print(f"plain's band over seeds: val x{base['val_max'] / base['val_min']:.4f}")
        for variant, s in summary.items():
            s["val_vs_plain"] = s["val_mean"] / base["val_mean"] - 1
            s["train_vs_plain"] = s["train_mean"] / base["train_mean"] - 1
            print(
                f"{variant:16s} val {s['val_mean']:.4f} ({100 * s['val_vs_plain']:+.2f}%), "
                f"train {s['train_mean']:.4f} ({100 * s['train_vs_plain']:+.2f}%)"
            )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "staleness_short",
                "device": "cpu",
                "cpu": platform.machine(),
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "settings": {k: v for k, v in vars(a).items() if k != "out"},
                "summary": summary,
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
