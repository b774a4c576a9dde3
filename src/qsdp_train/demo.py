"""``qsdp demo``: on this CPU machine, train ``cpu-tiny`` on the built-in corpus with ``"bf16"``
(uncompressed FSDP2) and ``"sdp4bit"`` side by side; print a table, write
``OUT/summary.json`` and ``OUT/demo.png`` (``OUT``: ``runs/demo-DATE-TIME`` by default, a folder
git ignores here, not the working tree)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .launch import _USER_ERRORS, TrainError, _describe, launch
from .metrics import read_metrics
from .trainer import TrainConfig

RECIPES = ("bf16", "sdp4bit")


def summarize(run: Path) -> dict:
    m = read_metrics(run)
    vals = [v for v in m["val_loss"] if v is not None]
    wire = [v for v in m["wire_bytes"] if v is not None][1:]  # step 0 may send a full sync
    tps = [v for v in m["tokens_per_s"] if v is not None][1:]
    return {
        "recipe": m.config["recipe"],
        "final_val_loss": vals[-1] if vals else None,
        "bytes_per_step": statistics.median(wire) if wire else None,
        "bf16_bytes_per_step": statistics.median(m["bf16_bytes"]),
        "tokens_per_s": statistics.median(tps) if tps else None,
        "steps": len(m),
    }


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="qsdp demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        help="directory for the runs (default: runs/demo-DATE-TIME under the working directory; "
        "this repository's .gitignore ignores runs/)",
    )
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--data", help="a text file instead of the built-in corpus")
    a = p.parse_args(argv)
    if a.steps < 5:
        raise SystemExit(f"qsdp demo: --steps={a.steps} must be >= 5")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else Path("runs") / f"demo-{stamp}"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"qsdp demo: {out} is not empty; pass --out to a new directory")
    print(f"qsdp demo: writing to {out}{'' if a.out else ' (--out DIR elsewhere)'}", flush=True)
    t0 = time.perf_counter()
    rows = []
    for name in RECIPES:
        print(f"== {name}: cpu-tiny, {a.steps} steps on {a.nproc} gloo processes", flush=True)
        cfg = TrainConfig(
            out=str(out / name),
            recipe=name,
            preset="cpu-tiny",
            data=a.data,
            steps=a.steps,
            eval_every=max(1, a.steps // 5),
            lr=3e-3,
        )
        try:
            launch(cfg, nproc=a.nproc)
        except KeyboardInterrupt as e:  # Ctrl-C: one line, as `qsdp train` prints it
            print(
                f"qsdp demo: {str(e) or 'interrupted'} (the demo does not resume)", file=sys.stderr
            )
            raise SystemExit(130) from None
        except TrainError as e:  # one line, as `qsdp train` prints it
            raise SystemExit(str(e).replace("qsdp train:", "qsdp demo:", 1)) from None
        except _USER_ERRORS as e:  # refused before any worker started
            raise SystemExit(f"qsdp demo: {_describe(e)}") from None
        rows.append(summarize(out / name))
    base = rows[0]
    for r in rows:
        r["ratio_vs_bf16"] = base["bytes_per_step"] / r["bytes_per_step"]
        r["val_loss_vs_bf16"] = r["final_val_loss"] / base["final_val_loss"] - 1
    from .plot import plot_runs

    png = plot_runs([out / n for n in RECIPES], out / "demo.png")
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu ({_cores()} cores usable, {a.nproc} gloo processes)",
        "torch": torch.__version__,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(meta | {"runs": rows}, indent=2))
    print(
        f"\n{'recipe':<10} {'val loss':>9} {'vs bf16':>8} {'bytes/step':>12} {'ratio':>7} "
        f"{'tokens/s':>9}"
    )
    for r in rows:
        print(
            f"{r['recipe']:<10} {r['final_val_loss']:9.4f} {r['val_loss_vs_bf16']:+8.2%} "
            f"{r['bytes_per_step']:12,.0f} {r['ratio_vs_bf16']:6.1f}x {r['tokens_per_s']:9.0f}"
        )
    print(f"\nwrote {out / 'summary.json'} and {png} in {time.perf_counter() - t0:.0f} s")
    return {"runs": rows}
