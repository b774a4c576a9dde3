"""``qsdp plot``: one PNG with loss curves and bytes on the wire; clear errors for bad run dirs."""

import json
import struct
import sys

import pytest

pytest.importorskip("matplotlib")

from qsdp_train.cli import main as cli_main  # noqa: E402
from qsdp_train.metrics import MetricsWriter, read_metrics  # noqa: E402
from qsdp_train.plot import build_figure, plot_runs, run_labels  # noqa: E402

COLUMNS = [
    "step",
    "tokens",
    "loss",
    "val_loss",
    "wire_bytes",
    "wire_bytes_all_gather",
    "wire_bytes_reduce_scatter",
    "bf16_bytes",
    "compression_ratio",
]
BF16 = 8 * 2**20  # bytes one step of a bf16 run sends


def fake_run(run_dir, recipe, *, ratio, steps=50, world_size=3):
    """A run dir as `qsdp train` leaves it: config.json and metrics.csv (val loss every 10)."""
    run_dir.mkdir(parents=True)
    cfg = {"recipe": recipe, "preset": "tiny", "tokenizer": "bytes", "world_size": world_size}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    ag, rs = BF16 / 2 / ratio, BF16 / 2 / ratio
    with MetricsWriter(run_dir, COLUMNS) as w:
        for s in range(1, steps + 1):
            w.log(
                s,
                tokens=s * 3 * 2048,
                loss=5.0 / s**0.3 + 0.05 * (-1) ** s,
                val_loss=5.1 / s**0.3 if s % 10 == 0 else None,
                wire_bytes=int(ag + rs),
                wire_bytes_all_gather=int(ag),
                wire_bytes_reduce_scatter=int(rs),
                bf16_bytes=BF16,
                compression_ratio=ratio,
            )
    return run_dir


@pytest.fixture
def two_runs(tmp_path):
    return [
        fake_run(tmp_path / "runs" / "bf16", "bf16", ratio=1.0),
        fake_run(tmp_path / "runs" / "sdp4bit", "sdp4bit", ratio=6.4),
    ]


def test_plot_runs_writes_a_png(two_runs, tmp_path):
    out = plot_runs(two_runs, tmp_path / "figs" / "cmp.png")
    assert out == tmp_path / "figs" / "cmp.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1320, 1080)  # figsize (11, 9) at 120 dpi
    assert 20_000 < len(data) < 2_000_000


def test_figure_has_loss_and_bytes_panels(two_runs):
    runs = [read_metrics(d) for d in two_runs]
    fig = build_figure(runs)
    ax_loss, ax_bytes = fig.axes
    labels = [line.get_label() for line in ax_loss.get_lines()]
    assert labels.count("bf16") == 1 and labels.count("sdp4bit") == 1  # one EMA line per run
    assert labels.count("_raw") == 2  # the faint raw curves
    val = [ln for ln in ax_loss.get_lines() if ln.get_label() == "sdp4bit val"]
    assert len(val) == 1 and list(val[0].get_xdata()) == [s * 6144 for s in (10, 20, 30, 40, 50)]
    ema = next(ln for ln in ax_loss.get_lines() if ln.get_label() == "bf16")
    raw_loss = runs[0]["loss"]
    assert ema.get_ydata()[0] == pytest.approx(raw_loss[0])  # debiased: starts at the data
    assert ema.get_ydata()[-1] == pytest.approx(sum(raw_loss[-20:]) / 20, abs=0.1)
    assert ax_loss.get_xlabel() == "tokens"
    assert ax_loss.get_title().startswith("training loss (EMA 0.9;")  # 50 rows: the floor
    low, high = ax_loss.get_ylim()
    assert high < max(raw_loss)  # the steep start runs off the top
    assert low < min(min(r["val_loss"], key=lambda v: v or 99) for r in runs)
    texts = sorted(t.get_text() for t in ax_bytes.texts)
    assert texts == ["x1.0", "x6.4"]
    legend = [t.get_text() for t in ax_bytes.get_legend().get_texts()]
    assert legend == ["all-gather", "reduce-scatter", "bf16 equivalent"]
    heights = [p.get_height() for p in ax_bytes.patches]  # in MiB
    assert heights[:2] == pytest.approx([4.0, 4.0 / 6.4], rel=1e-6)  # all-gather of each run
    assert ax_bytes.get_ylabel() == "MiB per step"
    assert fig.get_suptitle() == "preset tiny  ·  tokenizer bytes  ·  ranks 3"


def test_x_step_and_repeated_recipes(tmp_path):
    dirs = [
        fake_run(tmp_path / "a" / "lr1e-3", "sdp4bit", ratio=6.4, world_size=2),
        fake_run(tmp_path / "a" / "lr3e-4", "sdp4bit", ratio=6.4, world_size=4),
        fake_run(tmp_path / "b" / "lr3e-4", "sdp4bit", ratio=6.4),
    ]
    runs = [read_metrics(d) for d in dirs]
    assert run_labels(runs) == [
        "sdp4bit (lr1e-3)",
        f"sdp4bit ({tmp_path / 'a' / 'lr3e-4'})",
        f"sdp4bit ({tmp_path / 'b' / 'lr3e-4'})",
    ]
    fig = build_figure(runs, x="step")
    assert fig.axes[0].get_xlabel() == "step"
    assert fig.get_suptitle().endswith("ranks 2 / 4 / 3")


def test_runs_without_per_collective_columns_get_one_bar(tmp_path):
    run = tmp_path / "ddp"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "global-qsgd"}))
    with MetricsWriter(run, ["step", "loss", "wire_bytes_all_reduce", "compression_ratio"]) as w:
        for s in range(1, 4):
            w.log(s, loss=1.0, wire_bytes_all_reduce=3 * 2**10, compression_ratio=8.0)
    fig = build_figure([read_metrics(run)], x="step")
    ax = fig.axes[1]
    assert [t.get_text() for t in ax.texts] == ["x8.0"]  # no bf16_bytes: the trainer's ratio
    assert ax.get_ylabel() == "KiB per step"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["all-reduce"]


def test_errors_name_the_problem(two_runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/metrics.csv not found"):
        plot_runs([two_runs[0], empty], tmp_path / "p.png")
    (empty / "config.json").write_text(json.dumps({"recipe": "bf16"}))
    MetricsWriter(empty, COLUMNS).close()
    with pytest.raises(ValueError, match=r"no rows to plot in \[.*empty'\]"):
        plot_runs([two_runs[0], empty], tmp_path / "p.png")
    with pytest.raises(ValueError, match="x='time' must be one of"):
        plot_runs(two_runs, tmp_path / "p.png", x="time")
    with pytest.raises(ValueError, match="no runs to plot"):
        build_figure([])
    with pytest.raises(ValueError, match=r"smoothing=1.0 must be in \[0, 1\)"):
        build_figure([read_metrics(two_runs[0])], smoothing=1.0)
    no_tokens = tmp_path / "no_tokens"
    no_tokens.mkdir()
    (no_tokens / "config.json").write_text("{}")
    with MetricsWriter(no_tokens, ["step", "loss"]) as w:
        w.log(1, loss=2.0)
    with pytest.raises(ValueError, match=r"no 'tokens' column; .*\(--x step\)"):
        plot_runs([no_tokens], tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_missing_matplotlib_says_how_to_install(two_runs, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'qsdp\[train\]'"):
        plot_runs(two_runs, tmp_path / "p.png")


def test_cli_writes_plot_png_in_the_current_directory(two_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli_main(["plot", *map(str, two_runs), "--x", "step"])
    assert capsys.readouterr().out.strip() == "wrote plot.png"
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    cli_main(["plot", str(two_runs[0]), "--out", str(tmp_path / "figs" / "one.png")])
    assert (tmp_path / "figs" / "one.png").is_file()


def test_cli_errors_exit_with_a_message(two_runs, tmp_path):
    out = str(tmp_path / "p.png")
    with pytest.raises(SystemExit, match=r"qsdp plot: .*nowhere/metrics.csv not found"):
        cli_main(["plot", str(tmp_path / "nowhere"), "--out", out])
    stray = tmp_path / "runs" / "notes.txt"  # what `qsdp plot runs/*` may pick up
    stray.write_text("hi")
    with pytest.raises(SystemExit, match=r"notes.txt is a file, not a run directory"):
        cli_main(["plot", str(two_runs[0]), str(stray), "--out", out])
    with pytest.raises(SystemExit):  # argparse: at least one RUN_DIR
        cli_main(["plot"])


@pytest.mark.parametrize(
    "device, label", [("cpu", "CPU processes 2"), ("NVIDIA H100", "GPUs 2"), (None, "ranks 2")]
)
def test_the_title_names_the_world_size_by_device(tmp_path, device, label):
    run = fake_run(tmp_path / "run", "bf16", ratio=1.0, steps=3, world_size=2)
    if device is not None:  # config.json records "cpu" or the GPU's name
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps(config | {"device": device}))
    title = build_figure([read_metrics(run)])._suptitle.get_text()
    assert title.endswith(label), title
    assert device == "NVIDIA H100" or "GPU" not in title, title
