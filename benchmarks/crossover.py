"""Where each recipe starts to pay: its speed-up over plain FSDP2 against the link's bandwidth.

    python benchmarks/crossover.py DIR [--svg docs/crossover.svg]

Reads what ``benchmarks/run_crossover.sh`` writes into DIR, per link setting ``TAG``:
``link_TAG.json`` (``bench_collectives.py``: NCCL's bf16 all-gather of 256 MiB, whose time gives
the link's bus bandwidth, ``bytes * (n - 1) / n / time``) and ``step_TAG.json``
(``bench_fsdp_step.py``: seconds per step of plain FSDP2 bf16-reduce and of each recipe, the rows
of one run). Writes ``crossover.csv`` (one row per setting and recipe) and ``crossover.md`` (the
table, and each recipe's crossover: the bandwidth where its speed-up crosses 1, interpolated
linearly in log bandwidth between the two settings around it; "above every setting" when it
pays everywhere, "below every setting" when it pays nowhere) into DIR, and an SVG plot (speed-up
against bandwidth, log scale) to ``--svg`` (default DIR/crossover.svg).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

PLAIN = "fsdp2-bf16-reduce"


def bus_gbps(link: dict) -> float:
    """The NCCL bf16 all-gather's bus bandwidth (GB/s) of a ``bench_collectives.py`` result."""
    rows = [r for r in link["rows"] if r["collective"] == "all_gather" and r["dtype"] == "bfloat16"]
    if not rows:
        raise ValueError(
            "no bf16 all_gather row in the link file: run bench_collectives.py with "
            "--dtypes bfloat16 --only 'all_gather w8'"
        )
    r = max(rows, key=lambda r: r["size_mib"])
    n = r["world_size"]
    nbytes = r["size_mib"] * 2**20
    return nbytes * (n - 1) / n / (r["nccl_ms"] * 1e-3) / 1e9


def load(folder: Path) -> list[dict]:
    """One row per (setting, variant): tag, bandwidth, seconds per step, speed-up over plain."""
    out = []
    for step_file in sorted(folder.glob("step_*.json")):
        tag = step_file.stem.removeprefix("step_")
        link_file = folder / f"link_{tag}.json"
        if not link_file.exists():
            raise FileNotFoundError(f"{link_file} is missing: every step_TAG.json needs its link")
        bw = bus_gbps(json.loads(link_file.read_text()))
        step = json.loads(step_file.read_text())
        rows = {r["variant"]: r["s_per_step"] for r in step["rows"]}
        if PLAIN not in rows:
            raise ValueError(f"{step_file} has no {PLAIN} row (run it with --baselines bf16)")
        for variant, s in rows.items():
            out.append(
                {
                    "setting": tag,
                    "device": step["device"],
                    "world_size": step["world_size"],
                    "date": step["date"],
                    "bus_gbps": round(bw, 3),
                    "variant": variant,
                    "s_per_step": s,
                    "speedup": round(rows[PLAIN] / s, 4),
                }
            )
    if not out:
        raise FileNotFoundError(f"no step_*.json in {folder}")
    return out


def crossover(points: list[tuple[float, float]]) -> float | str:
    """The bandwidth where the speed-up crosses 1 going up in bandwidth (log-linear between the
    two settings around it), or a sentence when it never crosses within the settings."""
    pts = sorted(points)
    if all(s >= 1 for _, s in pts):
        return "above every setting"
    if all(s < 1 for _, s in pts):
        return "below every setting"
    for (b0, s0), (b1, s1) in zip(pts, pts[1:], strict=False):
        if s0 >= 1 > s1:
            t = (s0 - 1) / (s0 - s1)
            return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
    return "not monotone: read the table"


def svg(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        if variant == PLAIN:
            continue
        pts = sorted((r["bus_gbps"], r["speedup"]) for r in rows if r["variant"] == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="plain FSDP2 bf16-reduce")
    ax.set_xscale("log")
    ax.set_xlabel("link bus bandwidth, NCCL bf16 all-gather (GB/s)")
    ax.set_ylabel("speed-up over plain FSDP2")
    first = rows[0]
    ax.set_title(f"1.42 B GPT, {first['world_size']}x {first['device']}, {first['date'][:10]}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--svg", type=Path, default=None)
    a = p.parse_args()
    rows = load(a.folder)
    with open(a.folder / "crossover.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    settings = sorted({(r["bus_gbps"], r["setting"]) for r in rows})
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != PLAIN]
    at = {(r["setting"], r["variant"]): r for r in rows}
    lines = [
        "| setting | bus GB/s | plain s/step | " + " | ".join(variants) + " |",
        "|---|---|---|" + "---|" * len(variants),
    ]
    for bw, tag in settings:
        cells = [f"{at[tag, v]['s_per_step']:.3f} (x{at[tag, v]['speedup']:.2f})" for v in variants]
        lines.append(
            f"| {tag} | {bw:.2f} | {at[tag, PLAIN]['s_per_step']:.3f} | " + " | ".join(cells) + " |"
        )
    lines.append("")
    for v in variants:
        c = crossover([(r["bus_gbps"], r["speedup"]) for r in rows if r["variant"] == v])
        where = f"{c:.1f} GB/s" if isinstance(c, float) else c
        lines.append(f"- `{v}` pays below {where}")
    (a.folder / "crossover.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    svg(rows, a.svg or a.folder / "crossover.svg")


if __name__ == "__main__":
    main()
