"""Markdown tables for the README from the committed results (nothing is typed in by hand).

python benchmarks/summarize.py            # prints both tables
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def quant_table(path: Path) -> str:
    d = json.loads(path.read_text())
    rows = d["rows"]
    sizes = sorted({r["size_mib"] for r in rows})
    copy = {r["size_mib"]: r["gb_per_s"] for r in rows if r["op"] == "copy"}
    head = (
        f"Quantizer kernels, {d['device']}, torch {d['torch']}, triton {d['triton']}, "
        f"{d['date']}; bf16 input, absmax, group {d['group_size']}; bytes read + written per "
        "second as a fraction of a device-to-device copy in the same run "
        + ", ".join(f"({s} MiB copy: {copy[s]:.0f} GB/s)" for s in sizes)
        + ". `encode` is the kernel alone (NaN/Inf sent as NaN groups); `+check` is the default"
        " that raises on NaN/Inf, which reads the scales back (a host sync).\n"
    )
    cols = [(s, op) for s in sizes for op in ("encode", "encode+check", "decode")]
    out = [
        head,
        "| bits | Hadamard | rounding | " + " | ".join(f"{op} {s} MiB" for s, op in cols) + " |",
        "|---" * (3 + len(cols)) + "|",
    ]
    keys = sorted(
        {(r["bits"], r["hadamard"] or 0, r["rounding"]) for r in rows if r["op"] == "encode"},
        key=lambda k: (-k[0], k[1], k[2]),
    )
    for bits, had, rnd in keys:
        cells = []
        for s, op in cols:
            match = [
                r
                for r in rows
                if r["op"] == op
                and r["size_mib"] == s
                and r["bits"] == bits
                and (r["hadamard"] or 0) == had
                and r["rounding"] == rnd
            ]
            cells.append(f"{match[0]['frac_of_copy']:.2f}" if match else "")
        out.append(f"| {bits} | {had or '-'} | {rnd} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def collectives_table(paths: list[Path], size_mib: float, dtype: str) -> str:
    by_regime = {}
    meta = None
    for p in paths:
        d = json.loads(p.read_text())
        meta = d
        by_regime[d["regime"]] = d["rows"]
    regimes = [r for r in ("nvlink", "socket", "2x2") if r in by_regime]
    head = (
        f"Collectives on {meta['world_size']}x {meta['device']}, torch {meta['torch']}, "
        f"{meta['date'][:10]}: {size_mib:g} MiB {dtype} messages (the uncompressed tensor), "
        "time as a multiple of NCCL's speed (`nccl_ms / ms`, above 1 is faster) and effective "
        "bandwidth (uncompressed bytes / time)."
        + (f" Note: {meta['note']}." if meta.get("note") else "")
        + "\n"
    )
    out = [head, "| collective | " + " | ".join(regimes) + " |", "|---" * (1 + len(regimes)) + "|"]
    names = [
        r["variant"]
        for r in by_regime[regimes[0]]
        if r["size_mib"] == size_mib
        and r["dtype"] == dtype
        and not r["variant"].endswith("(rerun)")
    ]
    for name in names:
        cells = []
        for reg in regimes:
            m = [
                r
                for r in by_regime[reg]
                if r["variant"] == name and r["size_mib"] == size_mib and r["dtype"] == dtype
            ]
            cells.append(
                f"x{m[0]['ratio_vs_nccl']:.2f} ({m[0]['eff_gb_per_s']:.0f} GB/s)" if m else ""
            )
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def fsdp_table(paths: list[Path]) -> str:
    runs, stamps = {}, {}
    meta = None
    for p in paths:
        d = json.loads(p.read_text())
        if d["world_size"] != 4:
            continue  # scaling points: scaling_table
        meta = d
        runs[d["regime"]] = {r["variant"]: r for r in d["rows"]}
        stamps[d["regime"]] = d["date"][:16].replace("T", " ")
    regimes = [r for r in ("socket", "2x2", "nvlink") if r in runs]
    m = meta["model"]
    head = (
        f"FSDP2 training step, {meta['world_size']}x {meta['device']}, torch {meta['torch']}, "
        f"{meta['date'][:10]}: GPT {meta['params'] / 1e9:.2f} B ({m['layers']} layers, d "
        f"{m['d']}, seq {m['seq']}), micro-batch {meta['micro_batch']}, bf16 compute, AdamW; "
        "median seconds per step (x speed-up vs FSDP2 fp32-reduce / bf16-reduce), peak memory. "
        "Each regime is one run, its baselines measured in it: "
        + ", ".join(f"{r} {stamps[r]}" for r in regimes)
        + " (UTC).\n"
    )
    out = [
        head,
        "| variant | " + " | ".join(regimes) + " | peak GiB |",
        "|---" * (2 + len(regimes)) + "|",
    ]
    names = list(dict.fromkeys(n for reg in regimes for n in runs[reg]))
    for name in names:
        cells = []
        for reg in regimes:
            r = runs[reg].get(name)
            cells.append(
                f"{r['s_per_step']:.3f} s (x{r['ratio_vs_fp32_reduce']:.2f} / "
                f"x{r['ratio_vs_bf16_reduce']:.2f})"
                if r
                else ""
            )
        peak = next(runs[reg][name]["peak_mem_gib"] for reg in regimes if name in runs[reg])
        out.append(f"| {name} | " + " | ".join(cells) + f" | {peak:.1f} |")
    return "\n".join(out)


def scaling_table(paths: list[Path]) -> str:
    """Tokens/s per GPU by world size (1, 2, 4 GPUs of one host) and regime."""
    rows: dict[tuple[str, str], dict[int, float]] = {}
    for p in paths:
        d = json.loads(p.read_text())
        for r in d["rows"]:
            regime = "1 GPU" if d["world_size"] == 1 else d["regime"]
            rows.setdefault((regime, r["variant"]), {})[d["world_size"]] = (
                r["tokens_per_s"] / d["world_size"]
            )
    out = [
        "Tokens/s per GPU, GPT 1.42 B, micro-batch 8 (2x2 at 2 GPUs means 2 nodes x 1 GPU):",
        "",
        "| regime | variant | 1 GPU | 2 GPUs | 4 GPUs | 4 vs 2 |",
        "|---|---|---|---|---|---|",
    ]
    one = {v: t[1] for (reg, v), t in rows.items() if reg == "1 GPU"}
    for (reg, v), t in sorted(rows.items()):
        if reg in ("1 GPU", "nvlink"):
            continue
        keep = f"{t[4] / t[2]:.2f}" if 2 in t and 4 in t else ""
        cells = [f"{one.get(v, 0):.0f}", f"{t.get(2, 0):.0f}", f"{t.get(4, 0):.0f}"]
        out.append(f"| {reg} | {v} | " + " | ".join(cells) + f" | {keep} |")
    return "\n".join(out)


def main() -> None:
    quant = sorted(RESULTS.glob("quant_*.json"))
    coll = sorted(RESULTS.glob("collectives_*.json"))
    if not quant and not coll:
        sys.exit(f"no results under {RESULTS}")
    for q in quant:
        print(quant_table(q), end="\n\n")
    fsdp = sorted(RESULTS.glob("fsdp_step_*.json"))
    if fsdp:
        print(fsdp_table(fsdp), end="\n\n")
        print(scaling_table(fsdp), end="\n\n")
    if coll:
        for size, dtype in ((1024, "bfloat16"), (256, "bfloat16"), (1024, "float32")):
            print(collectives_table(coll, size, dtype), end="\n\n")


if __name__ == "__main__":
    main()
