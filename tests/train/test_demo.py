"""``qsdp demo`` end to end on a small local text (the README's main command, shortened)."""

from __future__ import annotations

import json

import pytest

from qsdp_train.demo import main as demo

TEXT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 300


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    # the prepared token files go to the test's folder, not the user's data cache
    monkeypatch.setenv("QSDP_DATA_DIR", str(tmp_path / "cache"))


def test_demo_writes_the_table_summary_and_plot(tmp_path, capsys, monkeypatch):
    (tmp_path / "sonnet.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)  # the default --out: under runs/ (git-ignored), not the tree
    demo(["--steps", "10", "--data", str(tmp_path / "sonnet.txt")])
    [out] = (tmp_path / "runs").iterdir()
    assert out.name.startswith("demo-") and not (tmp_path / "qsdp-demo").exists()
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["recipe"]: r for r in summary["runs"]}
    assert set(runs) == {"bf16", "sdp4bit"}
    assert runs["bf16"]["ratio_vs_bf16"] == 1.0
    assert runs["sdp4bit"]["ratio_vs_bf16"] > 8  # 4-bit weight differences and gradients
    assert abs(runs["sdp4bit"]["val_loss_vs_bf16"]) < 0.05
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "sdp4bit" in table and "ratio" in table
    assert f"qsdp demo: writing to {out.relative_to(tmp_path)} (--out DIR elsewhere)" in table
    # a second run into the same directory is refused instead of mixing runs
    try:
        demo(["--out", str(out), "--steps", "10"])
    except SystemExit as e:
        assert "is not empty" in str(e.code)
    else:
        raise AssertionError("a non-empty --out was accepted")


def test_demo_failure_is_one_line(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(SystemExit) as e:
        demo(["--out", str(tmp_path / "d"), "--data", str(short), "--steps", "5"])
    message = str(e.value.code)
    assert message.startswith("qsdp demo: ") and "\n" not in message, message
    assert "too short" in message, message


def test_demo_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("qsdp_train.demo.launch", interrupted)
    with pytest.raises(SystemExit) as e:
        demo(["--out", str(tmp_path / "d"), "--steps", "5"])
    assert e.value.code == 130
    assert capsys.readouterr().err == "qsdp demo: interrupted (the demo does not resume)\n"
