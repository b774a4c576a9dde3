"""Generated tables of the convergence study and of recipe ``auto`` (used by summarize.py).

Each reads committed results only: a convergence run is a directory holding the trainer's
``metrics.csv`` and ``config.json``; an ``auto`` matrix is bench_fsdp_step.py's and
bench_ddp_step.py's JSON, whose ``auto`` row records what it measured and chose.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

#: SDP4Bit (Jia et al., 2024) Table 1, GPT-125M, 80k steps on the Pile: final validation loss.
SDP4BIT_TABLE1_125M = {
    "bf16": 2.2939,
    "w4-direct": 2.5731,
    "qwd-only": 2.2927,
    "sdp4bit": 2.2959,
}


def _run(path: Path) -> dict:
    with open(path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    config = json.loads((path / "config.json").read_text())
    vals = [r for r in rows if r["val_loss"]]
    return {
        "name": path.name,
        "config": config,
        "val": float(vals[-1]["val_loss"]),
        "val_step": int(vals[-1]["step"]),
        "tokens": int(rows[-1]["tokens"]),
        "steps": len(rows),
        "wire": sum(float(r["wire_bytes"]) for r in rows),
        "step_s": sorted(float(r["step_s"]) for r in rows[1:])[(len(rows) - 1) // 2],
        "saved": next((r["grad_bytes_saved"] for r in reversed(rows) if r["grad_bytes_saved"]), ""),
    }


def _what(c: dict, name: str = "") -> str:
    parts = [c["parallel"].upper() if c["parallel"] != "fsdp" else "FSDP2"]
    if c.get("nodes") and c.get("world_size", 4) >= 2 * c["nodes"]:  # else: no two levels
        parts.append(f"{c['nodes']} nodes")
    if c.get("staleness"):  # runs before weight prediction existed have no "predict"
        how = {
            True: "weight prediction",  # (the first runs with it saved a bool)
            "last": "weight prediction",
            "local": "prediction from each rank's own gradient",
        }.get(c.get("predict"), "the delayed gradient as is")
        if c.get("predict") == "local" and "nodeavg" in name:  # runs of commit eab4760 on:
            # two-level reductions estimate from the node's average (the configs do not say)
            how = "prediction from the node's average gradient"
        if name.endswith("-lr"):  # runs of commit 0e56009 on (the configs do not say)
            how += ", each delayed gradient at its own step's learning rate"
        parts.append(f"staleness {c['staleness']}, {how}")
    if c.get("stale_after"):
        parts.append(f"synchronous before step {c['stale_after']}")
    if c.get("adaptive_every"):
        per = ", per parameter" if c.get("adaptive_per_parameter") else ""
        rel = ", relative errors" if c.get("adaptive_error") == "relative" else ""
        parts.append(f"adaptive every {c['adaptive_every']}{per}{rel}")
    if c.get("error_feedback"):
        # the tenth session's first run: its residual came from a second encode (fixed since)
        parts.append(
            "error feedback" + (" (defective: a second encode's)" if "defective" in name else "")
        )
    if c.get("grad_rounding"):
        parts.append(f"{c['grad_rounding']} rounding")
    if c.get("grad_group_size"):
        parts.append(f"groups of {c['grad_group_size']}")
    elif c.get("recipe") == "cgx":  # made before 2026-11-27, when cgx's default was 1024 (every
        # cgx run of run_convergence.sh since names its group size)
        parts.append("groups of 1024")
    if c.get("recipe") == "auto" and c.get("auto"):
        parts.append(f"auto chose `{c['auto']['recipe']}`")
    if c.get("seed"):
        parts.append(f"seed {c['seed']}")
    return ", ".join(parts)


def convergence_table(root: Path) -> str:
    """Final validation loss of every run under ``root`` against the uncompressed run of its
    kind (FSDP2 runs against ``bf16``, DDP runs against ``ddp-bf16``), with the bytes on the
    wire over the whole run against that run's."""
    runs = {p.name: _run(p) for p in sorted(root.iterdir()) if (p / "metrics.csv").exists()}
    first = runs["bf16"]["config"]
    gpus = first.get("world_size", 4)  # (the first study's configs say 4 GPUs in their device)
    val = first["eval_batches"] * gpus * first["micro_batch"] * first["block_size"]
    sharding = (
        "FSDP2 runs shard over 2 emulated nodes of 2 GPUs (`--nodes 2`)"
        if gpus == 4
        else f"FSDP2 runs shard over the {gpus} GPUs"
    )
    model = first.get("preset", "gpt-125m").upper()  # e.g. GPT-125M
    out = [
        f"{model}, one pass over `debian-docs` ({runs['bf16']['tokens'] / 1e6:.1f} M train "
        f"tokens, `--data-order pass`), {runs['bf16']['steps']} steps of {gpus} GPUs x "
        f"{first['micro_batch']} x {first['block_size']} tokens, AdamW {first['lr']:g} after "
        f"{first['warmup']} warm-up steps, cosine to {first['min_lr_ratio']:g}x; validation on "
        f"held-out pages ({first['eval_batches']} batches per rank, {val / 1e3:.0f} K tokens) "
        "at the last step; every run the same seed, data order and initial weights unless it "
        f"says. {sharding}; the transport is NVLink. "
        "`vs base`: against `bf16` (FSDP2) or `ddp-bf16` (DDP); `bytes`: all bytes the run "
        "handed to NCCL over the base run's; `s/step`: median, NVLink, not a speed figure.\n",
        "| run | what | device | final val loss | vs base | bytes | s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        base = runs["ddp-bf16" if r["config"]["parallel"] == "ddp" else "bf16"]
        rel = "" if r is base else f"{(r['val'] / base['val'] - 1) * 100:+.2f}%"
        device = r["config"].get("device", "?").replace("NVIDIA ", "").replace(" 80GB HBM3", "")
        out.append(
            f"| `{name}` | {_what(r['config'], name)} | {device} | {r['val']:.4f} | {rel} | "
            f"{r['wire'] / base['wire']:.2f}x | {r['step_s']:.3f} |"
        )
    return "\n".join(out)


def sdp4bit_table(root: Path) -> str:
    """Ours beside SDP4Bit's Table 1 (125M): relative final validation loss."""
    runs = {p.name: _run(p) for p in sorted(root.iterdir()) if (p / "metrics.csv").exists()}
    paper, base = SDP4BIT_TABLE1_125M, runs["bf16"]["val"]
    out = [
        "| recipe | SDP4Bit paper, 125M, 80k steps | vs baseline | qsdp, 125M, 356 steps "
        "(23.3 M tokens) | vs bf16 |",
        "|---|---|---|---|---|",
    ]
    for name, loss in paper.items():
        ours = runs.get(name)
        cells = (
            f"{ours['val']:.4f} | {(ours['val'] / base - 1) * 100:+.2f}%" if ours else "not run |"
        )
        rel = "" if name == "bf16" else f"{(loss / paper['bf16'] - 1) * 100:+.2f}%"
        out.append(f"| `{name}` | {loss:.4f} | {rel} | {cells} |")
    return "\n".join(out)


def auto_table(paths: list[Path]) -> str:
    """Each regime's ``auto`` row beside the baseline and the hand-picked recipes of its run."""
    out = [
        "| run | regime | device | baseline s/step | auto chose | auto s/step | best "
        "hand-picked | its s/step | auto vs baseline | auto vs best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in paths:
        d = json.loads(p.read_text())
        key = "s_per_step" if "s_per_step" in d["rows"][0] else "median_s"
        by = {r["variant"]: r for r in d["rows"]}
        if "auto" not in by:
            continue
        base_name = next(
            b for b in ("fsdp2-bf16-reduce", "bf16_compress_hook", "ddp-fp32") if b in by
        )
        picks = {
            v: r[key]
            for v, r in by.items()
            if v not in ("auto", base_name, "fsdp2-fp32-reduce", "ddp-fp32", "compute-alone")
        }
        picks[base_name] = by[base_name][key]
        best = min(picks, key=picks.get)
        auto = by["auto"]
        chose = auto["auto"]["recipe"]
        device = d["device"].replace("NVIDIA ", "").replace(" 80GB HBM3", "")
        out.append(
            f"| {p.parent.name} | {d['regime']} | {device} | {base_name} "
            f"{by[base_name][key]:.3f} | `{chose}` | {auto[key]:.3f} | `{best}` | "
            f"{picks[best]:.3f} | x{by[base_name][key] / auto[key]:.2f} | "
            f"x{picks[best] / auto[key]:.2f} |"
        )
    return "\n".join(out)


#: the recipes whose collectives the FSDP2 cost model predicts, as its (weights, gradients)
#: options (the bf16-reduce baseline is left out: the recorded predictions assumed fp32 reduce)
_MODEL_OPTIONS = {
    "fsdp2-fp32-reduce": ("none", "none"),
    "qsdp-w8g8": ("w8", "g8"),
    "sdp4bit": ("wd4", "g4"),
}


def model_check_table(auto_paths: list[Path], bounds_paths: list[Path]) -> str:
    """``auto``'s predicted communication per step against the serial wire time of the same
    recipes measured by ``bench_fsdp_step.py --bounds`` (their collectives replayed with no
    compute) on the same kind of machine: per regime, the last ``auto`` run's predictions."""
    predicted: dict[str, tuple[str, str, dict]] = {}
    for p in auto_paths:  # later runs replace earlier ones
        d = json.loads(p.read_text())
        row = next((r for r in d["rows"] if r["variant"] == "auto"), None)
        if row and "weights" in row["auto"]["predicted_s"]:
            # the whole wire counted (runs before 2026-11-27 counted it in predicted_s)
            pred = row["auto"].get("predicted_serial_s", row["auto"]["predicted_s"])
            predicted[d["regime"]] = (p.parent.name, d["device"], pred)
    out = [
        "| regime | recipe | predicted (`auto` run) | measured serial wire (`--bounds` run) | "
        "predicted / measured | measured step |",
        "|---|---|---|---|---|---|",
    ]
    for p in bounds_paths:
        d = json.loads(p.read_text())
        if d["regime"] not in predicted:
            continue
        run, device, pred = predicted[d["regime"]]
        if device != d["device"]:
            continue
        for r in d["rows"]:
            options = _MODEL_OPTIONS.get(r["variant"])
            if options is None or not r.get("wire_serial_s"):
                continue
            weights, grads = options
            if d["regime"] == "2x2" and grads == "g4":
                grads = "tl"  # sdp4bit on the 2x2 mesh: two levels
            s = pred["weights"][weights] + pred["grads"][grads]
            out.append(
                f"| {d['regime']} | `{r['variant']}` | {s:.3f} s ({run}) | "
                f"{r['wire_serial_s']:.3f} s | {s / r['wire_serial_s']:.2f} | "
                f"{r['s_per_step']:.3f} s |"
            )
    return "\n".join(out)
