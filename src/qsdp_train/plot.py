"""``qsdp plot``: loss curves and bytes on the wire of one or more runs, in one PNG.

Panel 1 is the loss against tokens (or steps): each run's training loss as a faint line, its
exponential moving average as a solid one, and its validation loss as markers. Panel 2 is the
bytes one step puts on the wire, one bar per run stacked by collective (all-gather,
reduce-scatter, all-reduce), beside an outline of what bf16 would have sent, with the ratio
``bf16 / wire`` written above. The loss axis spans the losses past each run's first tenth,
so the steep start runs off the top rather than flattening the rest. A step's bytes are the
median over the run's rows, so a warm-up step does not skew them; each ``wire_bytes*`` cell is
taken as the bytes of that one step.

matplotlib is needed (``pip install 'qsdp[train]'``); it is drawn with the Agg canvas, never a
display, and pyplot's global state is not touched.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .metrics import METRICS_FILE, RunMetrics, read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["COLLECTIVES", "build_figure", "main", "plot_runs", "run_labels"]

#: Per-collective byte columns of metrics.csv, and how the plot names them.
COLLECTIVES: dict[str, str] = {
    "wire_bytes_all_gather": "all-gather",
    "wire_bytes_reduce_scatter": "reduce-scatter",
    "wire_bytes_all_reduce": "all-reduce",
}
X_CHOICES = ("tokens", "step")
_HATCHES = ("", "//", "..")


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: pip install 'qsdp[train]'"
        ) from e
    return Figure, FigureCanvasAgg


def run_labels(runs: Sequence[RunMetrics]) -> list[str]:
    """Legend labels: the recipe, plus the directory name where recipes repeat.

    Args:
        runs: the runs, in plotting order.

    Returns:
        One label per run, all distinct.
    """
    recipes = [str(r.config.get("recipe", "?")) for r in runs]
    labels = [
        f"{rec} ({r.run_dir.name})" if recipes.count(rec) > 1 else rec
        for rec, r in zip(recipes, runs, strict=True)
    ]
    # Same recipe and same directory name (a/run, b/run): the full path tells them apart.
    return [
        f"{rec} ({r.run_dir})" if labels.count(lab) > 1 else lab
        for rec, lab, r in zip(recipes, labels, runs, strict=True)
    ]


def _ema(values: list[float], smoothing: float) -> list[float]:
    # Debiased like Adam's moments, so the curve starts at the data, not at zero.
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = smoothing * avg + (1 - smoothing) * v
        out.append(avg / (1 - smoothing**i))
    return out


def _pairs(run: RunMetrics, x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for a, b in zip(run[x], run.data.get(y, [None] * len(run)), strict=True):
        if a is not None and b is not None:
            xs.append(a)
            ys.append(b)
    return xs, ys


def _median(run: RunMetrics, column: str) -> float | None:
    vals = [v for v in run.data.get(column, ()) if v is not None]
    return statistics.median(vals) if vals else None


def _byte_unit(n: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return scale, unit
    return 1, "B"


def _title(runs: Sequence[RunMetrics]) -> str:
    parts = []
    for key, name in (("preset", "preset"), ("tokenizer", "tokenizer")):
        vals = list(dict.fromkeys(str(r.config[key]) for r in runs if key in r.config))
        if vals:
            parts.append(f"{name} {' / '.join(vals)}")
    sizes = list(
        dict.fromkeys(str(r.config["world_size"]) for r in runs if "world_size" in r.config)
    )
    if sizes:
        parts.append(f"{_rank_unit(runs)} {' / '.join(sizes)}")
    return "  ·  ".join(parts) or "qsdp runs"


def _rank_unit(runs: Sequence[RunMetrics]) -> str:
    # config.json's "device" is "cpu" or a GPU's name (older ones lack it): what a rank ran on
    devices = {r.config.get("device") for r in runs}
    if devices == {"cpu"}:
        return "CPU processes"
    if None not in devices and "cpu" not in devices:
        return "GPUs"
    return "ranks"


def _draw_loss(ax: Any, runs: Sequence[RunMetrics], labels: list[str], x: str, smoothing: float):
    settled: list[float] = []  # smoothed losses past each run's first tenth: the y range
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        color = f"C{i}"
        xs, ys = _pairs(run, x, "loss")
        if xs:
            ema = _ema(ys, smoothing)
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8, label="_raw")
            ax.plot(xs, ema, color=color, linewidth=1.8, label=label)
            settled += ema[len(ema) // 10 :]
        vx, vy = _pairs(run, x, "val_loss")
        settled += vy
        if vx:
            ax.plot(
                vx,
                vy,
                "o",
                color=color,
                markersize=5,
                markeredgecolor="black",
                markeredgewidth=0.5,
                label=f"{label} val",
            )
    ax.set_xlabel("tokens" if x == "tokens" else "step")
    ax.set_ylabel("loss")
    ax.set_title(f"training loss (EMA {smoothing:.3g}; faint: raw) and validation loss (markers)")
    finite = [v for v in settled if math.isfinite(v)]
    if finite:
        # The first steps' loss (ln(vocab) and falling fast) would squash the curves that matter
        # into a flat band; they run off the top instead.
        low, high = min(finite), max(finite)
        pad = 0.05 * (high - low) or 0.05 * abs(high) or 0.1
        ax.set_ylim(low - pad, high + pad)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if x == "tokens":
        from matplotlib.ticker import EngFormatter

        ax.xaxis.set_major_formatter(EngFormatter())


def _draw_bytes(ax: Any, runs: Sequence[RunMetrics], labels: list[str]) -> None:
    per_coll = [{c: _median(r, c) for c in COLLECTIVES} for r in runs]
    present = [c for c in COLLECTIVES if any(pc[c] is not None for pc in per_coll)]
    totals = [
        _median(r, "wire_bytes") or sum(pc[c] or 0.0 for c in present) or None
        for r, pc in zip(runs, per_coll, strict=True)
    ]
    bf16 = [_median(r, "bf16_bytes") for r in runs]
    ax.set_title("bytes on the wire per step (median), ratio vs bf16 above")
    if all(t is None for t in totals):
        ax.text(
            0.5,
            0.5,
            "no wire_bytes columns in these runs",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return
    scale, unit = _byte_unit(max(v for v in totals + bf16 if v is not None))
    xs = range(len(runs))
    bottoms = [0.0] * len(runs)
    for k, coll in enumerate(present):
        heights = [(pc[coll] or 0.0) / scale for pc in per_coll]
        ax.bar(
            xs,
            heights,
            0.6,
            bottom=bottoms,
            color=[f"C{i}" for i in xs],
            hatch=_HATCHES[k],
            edgecolor="black",
            linewidth=0.5,
        )
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    if not present:  # only a total column: one plain bar per run
        bottoms = [(t or 0.0) / scale for t in totals]
        ax.bar(
            xs,
            bottoms,
            0.6,
            color=[f"C{i}" for i in xs],
            edgecolor="black",
            linewidth=0.5,
        )
    if any(b is not None for b in bf16):
        ax.bar(
            xs,
            [(b or 0.0) / scale for b in bf16],
            0.8,
            fill=False,
            edgecolor="gray",
            linestyle="--",
        )
    for i, run in enumerate(runs):
        ratio = _ratio(bf16[i], totals[i], run)
        if ratio is not None:
            top = max(bottoms[i], (bf16[i] or 0.0) / scale)
            ax.annotate(
                f"x{ratio:.1f}",
                (i, top),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontweight="bold",
            )
    ax.set_xticks(list(xs), labels, rotation=15 if len(runs) > 3 else 0)
    ax.set_ylabel(f"{unit} per step")
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    # Bars are coloured by run (as in the loss panel); the legend explains hatches, in gray.
    from matplotlib.patches import Patch

    names = [COLLECTIVES[c] for c in present] or ["all collectives"]
    handles = [
        Patch(facecolor="lightgray", edgecolor="black", hatch=h, label=n)
        for h, n in zip(_HATCHES, names, strict=False)
    ]
    if any(b is not None for b in bf16):
        handles.append(Patch(fill=False, edgecolor="gray", linestyle="--", label="bf16 equivalent"))
    ax.legend(handles=handles, fontsize="small")


def _ratio(bf16: float | None, wire: float | None, run: RunMetrics) -> float | None:
    if bf16 is not None and wire:
        return bf16 / wire
    # Without bf16_bytes, the trainer's own per-step ratio is the only source.
    return _median(run, "compression_ratio")


def build_figure(
    runs: Sequence[RunMetrics], *, x: str = "tokens", smoothing: float | None = None
) -> Figure:
    """Draw the two panels of :func:`plot_runs` (for tests and notebooks).

    Args:
        runs: runs as read by :func:`~qsdp_train.metrics.read_metrics`.
        x: ``"tokens"`` or ``"step"``, the loss panel's x axis.
        smoothing: EMA factor of the training loss, in [0, 1); ``None`` averages over about
            a fiftieth of the longest run, at least 10 steps (0.9 for short runs).

    Returns:
        A matplotlib ``Figure`` with an Agg canvas; axes[0] is the loss, axes[1] the bytes.
    """
    if x not in X_CHOICES:
        raise ValueError(f"x={x!r} must be one of {X_CHOICES}")
    if not runs:
        raise ValueError("no runs to plot; pass at least one run directory")
    if smoothing is None:
        smoothing = 1 - 1 / max(10, max(len(r) for r in runs) // 50)
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing={smoothing} must be in [0, 1); try 0.9")
    for run in runs:
        if x not in run.columns:
            raise ValueError(
                f"{run.run_dir / METRICS_FILE} has no {x!r} column; plot against the other "
                f"x axis (--x {'step' if x == 'tokens' else 'tokens'})"
            )
    empty = [str(r.run_dir) for r in runs if len(r) == 0]
    if empty:
        raise ValueError(f"no rows to plot in {empty}: those runs logged no step yet")
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=(11, 9), layout="constrained")
    canvas_cls(fig)
    ax_loss, ax_bytes = fig.subplots(2, 1, height_ratios=(3, 2))
    labels = run_labels(runs)
    _draw_loss(ax_loss, runs, labels, x, smoothing)
    _draw_bytes(ax_bytes, runs, labels)
    fig.suptitle(_title(runs))
    return fig


def plot_runs(run_dirs: list[Path], out: Path, *, x: str = "tokens") -> Path:
    """Plot the runs in ``run_dirs`` into one PNG.

    Args:
        run_dirs: directories written by ``qsdp train`` (each with metrics.csv and config.json).
        out: the PNG to write; its folder is created if missing.
        x: ``"tokens"`` or ``"step"``, the loss panel's x axis.

    Returns:
        ``out``.
    """
    runs = [read_metrics(Path(d)) for d in run_dirs]
    fig = build_figure(runs, x=x)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    return out


def main(argv: list[str] | None = None) -> Path:
    """``qsdp plot RUN_DIR... [--out FILE.png] [--x tokens|step]``; returns the PNG written."""
    parser = argparse.ArgumentParser(
        prog="qsdp plot",
        description="Plot loss and bytes on the wire of qsdp training runs into one PNG.",
    )
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run directory of qsdp train"
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="FILE.png",
        default=Path("plot.png"),
        help="PNG to write (default: plot.png in the current directory, not beside the runs, "
        "so that `qsdp plot runs/*` globs only run directories)",
    )
    parser.add_argument("--x", choices=X_CHOICES, default="tokens", help="loss panel x axis")
    args = parser.parse_args(argv)
    try:
        written = plot_runs(args.run_dirs, args.out, x=args.x)
    except (OSError, ValueError, ImportError) as e:
        sys.exit(f"qsdp plot: {e}")
    print(f"wrote {written}")
    return written


if __name__ == "__main__":
    main()
