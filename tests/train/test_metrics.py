"""metrics.csv writing, resume and reading back; TensorBoard opt-in; the progress display."""

import io
import json
import logging
import sys

import pytest

from qsdp_train.metrics import MetricsWriter, Progress, read_metrics

COLUMNS = ["step", "tokens", "loss", "val_loss", "wire_bytes", "compression_ratio"]


def _write_config(run_dir, recipe="sdp4bit"):
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"recipe": recipe, "preset": "tiny", "tokenizer": "bytes", "world_size": 3}
    (run_dir / "config.json").write_text(json.dumps(cfg))


def _log_steps(writer, steps):
    for s in steps:
        writer.log(
            s,
            tokens=s * 4096,
            loss=10.0 / s,
            val_loss=9.5 / s if s % 3 == 0 else None,
            wire_bytes=12_345_679,
        )


def test_round_trip_keeps_empty_cells(tmp_path):
    _write_config(tmp_path)
    with MetricsWriter(tmp_path, COLUMNS) as w:
        w.log(1, tokens=4096, loss=3.25, wire_bytes=100, compression_ratio=7.6)
        w.log(2, tokens=8192, loss=0.1 + 0.2, val_loss=2.5)
    text = (tmp_path / "metrics.csv").read_text()
    assert text == (
        "step,tokens,loss,val_loss,wire_bytes,compression_ratio\n"
        "1,4096,3.25,,100,7.6\n"
        "2,8192,0.30000000000000004,2.5,,\n"
    )
    m = read_metrics(tmp_path)
    assert m.columns == tuple(COLUMNS) and len(m) == 2
    assert m["step"] == [1.0, 2.0]
    assert m["loss"] == [3.25, 0.1 + 0.2]  # repr round-trips floats exactly
    assert m["val_loss"] == [None, 2.5]
    assert m["compression_ratio"] == [7.6, None]
    assert m.config["recipe"] == "sdp4bit" and m.config["world_size"] == 3
    assert m.has_values("val_loss") and not m.has_values("nope")
    with pytest.raises(KeyError, match="no column 'lr'"):
        m["lr"]


def test_each_row_is_flushed_before_close(tmp_path):
    w = MetricsWriter(tmp_path, COLUMNS)
    w.log(1, loss=2.0)
    assert (tmp_path / "metrics.csv").read_text().splitlines()[-1] == "1,,2.0,,,"
    w.close()
    w.close()  # a second close does nothing


def test_unknown_key_and_bad_values_raise(tmp_path):
    w = MetricsWriter(tmp_path, COLUMNS)
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['grad_nrom', 'lr'\]"):
        w.log(1, loss=1.0, grad_nrom=3.0, lr=1e-3)
    with pytest.raises(TypeError, match=r"loss='1\.0' \(str\) is not a number"):
        w.log(1, loss="1.0")
    w.log(5, loss=1.0)
    with pytest.raises(ValueError, match="step=5 is not after the last logged step 5"):
        w.log(5, val_loss=1.0)
    w.close()
    with pytest.raises(ValueError, match="after close"):
        w.log(6, loss=1.0)
    # nothing but the header and step 5 was written
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 2


@pytest.mark.parametrize(
    "columns, match",
    [
        (["loss", "step"], "must start with 'step'"),
        ([], "must start with 'step'"),
        (["step", "loss", "loss"], r"\['loss'\] appear more than once"),
        (["step", "val-loss"], r"\['val-loss'\] are not Python identifiers"),
    ],
)
def test_bad_columns_raise(tmp_path, columns, match):
    with pytest.raises(ValueError, match=match):
        MetricsWriter(tmp_path, columns)


def test_new_run_refuses_to_overwrite(tmp_path):
    MetricsWriter(tmp_path, COLUMNS).close()
    with pytest.raises(FileExistsError, match="resume_from_step=S"):
        MetricsWriter(tmp_path, COLUMNS)


def test_resume_keeps_earlier_rows_byte_identical_and_drops_later(tmp_path):
    with MetricsWriter(tmp_path, COLUMNS) as w:
        _log_steps(w, range(1, 11))
    before = (tmp_path / "metrics.csv").read_bytes()
    lines = before.split(b"\n")
    with MetricsWriter(tmp_path, COLUMNS, resume_from_step=6) as w:
        after = (tmp_path / "metrics.csv").read_bytes()
        assert after == b"\n".join(lines[:7]) + b"\n"  # header + steps 1..6
        assert before.startswith(after)
        with pytest.raises(ValueError, match="not after the last logged step 6"):
            w.log(6, loss=1.0)
        _log_steps(w, range(7, 11))  # the replayed steps
    assert (tmp_path / "metrics.csv").read_bytes() == before
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_drops_a_torn_last_row(tmp_path):
    with MetricsWriter(tmp_path, COLUMNS) as w:
        _log_steps(w, range(1, 5))
    kept = (tmp_path / "metrics.csv").read_bytes()
    with open(tmp_path / "metrics.csv", "ab") as f:
        f.write(b"5,20480,2.0")  # a crash in the middle of a row
    with MetricsWriter(tmp_path, COLUMNS, resume_from_step=4):
        pass
    assert (tmp_path / "metrics.csv").read_bytes() == kept


def test_resume_rejects_a_corrupt_kept_row(tmp_path):
    with MetricsWriter(tmp_path, COLUMNS) as w:
        _log_steps(w, range(1, 3))
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("3,1\nx,1,2,3,4,5\n")
    with pytest.raises(ValueError, match=r"metrics.csv:4: 2 cells, expected 6"):
        MetricsWriter(tmp_path, COLUMNS, resume_from_step=3)
    with pytest.raises(ValueError, match=r"metrics.csv:5: step b'x' is not an integer"):
        MetricsWriter(tmp_path, COLUMNS, resume_from_step=2)


def test_resume_header_mismatch_raises_and_leaves_file_alone(tmp_path):
    with MetricsWriter(tmp_path, COLUMNS) as w:
        _log_steps(w, range(1, 4))
    before = (tmp_path / "metrics.csv").read_bytes()
    with pytest.raises(ValueError, match=r"has columns .* but this run logs .*grad_norm"):
        MetricsWriter(tmp_path, [*COLUMNS, "grad_norm"], resume_from_step=2)
    assert (tmp_path / "metrics.csv").read_bytes() == before


def test_resume_without_a_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="resume_from_step=None"):
        MetricsWriter(tmp_path, COLUMNS, resume_from_step=3)


@pytest.fixture
def no_tensorboard(monkeypatch):
    # A None entry in sys.modules makes `import torch.utils.tensorboard` raise ImportError.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_tensorboard_requested_but_missing_raises_before_writing(tmp_path, no_tensorboard):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsWriter(tmp_path, COLUMNS, tensorboard=True)
    assert not (tmp_path / "metrics.csv").exists()


def test_tensorboard_auto_says_once_that_it_is_off(tmp_path, no_tensorboard, caplog):
    _write_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="qsdp_train.metrics"):
        with MetricsWriter(tmp_path, COLUMNS, tensorboard=None) as w:
            _log_steps(w, range(1, 4))
    assert [r.getMessage() for r in caplog.records] == [
        "TensorBoard logging off: `pip install tensorboard` to turn it on"
    ]
    assert w.tensorboard_dir is None and len(read_metrics(tmp_path)) == 3


def test_tensorboard_writes_scalars_and_purges_on_resume(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with caplog.at_level(logging.INFO, logger="qsdp_train.metrics"):
        with MetricsWriter(tmp_path, COLUMNS, tensorboard=None) as w:
            assert w.tensorboard_dir == tmp_path / "tb"
            _log_steps(w, range(1, 7))
    assert [r.getMessage() for r in caplog.records] == [f"TensorBoard logging on: {tmp_path}/tb"]
    with MetricsWriter(tmp_path, COLUMNS, resume_from_step=4, tensorboard=True) as w:
        w.log(5, loss=-1.0)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"tokens", "loss", "val_loss", "wire_bytes"} <= set(acc.Tags()["scalars"])
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert sorted(loss) == [1, 2, 3, 4, 5] and loss[5] == -1.0 and loss[2] == 5.0
    assert [e.step for e in acc.Scalars("val_loss")] == [3]


def test_read_metrics_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.csv not found"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.csv").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.csv").write_text("loss,step\n")
    with pytest.raises(ValueError, match="must start with 'step'"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,loss\n1,2.0\n2\n")
    with pytest.raises(ValueError, match=r"metrics.csv:3: 1 cells, expected 2"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,loss\n1,abc\n")
    with pytest.raises(ValueError, match=r"metrics.csv:2: loss='abc' is not a number"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,loss\n1,2.0\n")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        read_metrics(tmp_path)
    (tmp_path / "config.json").write_text("{recipe")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        read_metrics(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="holds a list"):
        read_metrics(tmp_path)


def test_header_only_file_reads_as_zero_rows(tmp_path):
    _write_config(tmp_path)
    MetricsWriter(tmp_path, COLUMNS).close()
    m = read_metrics(tmp_path)
    assert len(m) == 0 and m["loss"] == []


def test_progress_prints_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    with Progress(12, line_every=5, file=out) as p:
        for s in range(1, 13):
            val = 2.5 if s == 4 else None
            p.update(s, loss=3.0, tokens_per_s=1_234_567, compression_ratio=7.62, val_loss=val)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 3  # steps 5, 10 and the last
    assert lines[0].startswith(" 42%") and "5/12" in lines[0] and "10/12" in lines[1]
    assert "12/12" in lines[2]
    assert "loss 3.0000 | val 2.5000 | 1.23M tok/s | x7.6" in lines[0]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_a_bar_on_a_terminal_and_nothing_when_disabled():
    out = _Tty()
    with Progress(100, initial=50, file=out) as p:
        p.update(51, loss=1.5, compression_ratio=4.0)
    assert "\r" in out.getvalue() and "51/100" in out.getvalue()
    assert "loss 1.5000 | x4.0" in out.getvalue()
    quiet = _Tty()
    with Progress(100, disable=True, file=quiet) as p:
        p.update(1, loss=1.0)
    assert quiet.getvalue() == ""
