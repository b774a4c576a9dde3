"""benchmarks/host_per_step.py: the host's work of a compressed FSDP2 step with the kernels
stubbed, on a fake process group. Its timings are not asserted (benchmarks measure, tests
check); what it counts is: hook calls per step, the ops the Python issued, the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .bench_scripts import ROOT

ENV = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def _run(out: Path, *args: str) -> dict:
    cmd = [sys.executable, "benchmarks/host_per_step.py", "--out", str(out), "--steps", "2", *args]
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> tuple[dict, str]:
    """One run of 3 MLP blocks, two recipes, cProfile on: the JSON and the profile's text."""
    root = tmp_path_factory.mktemp("host_per_step")
    prof = root / "mlp.txt"
    d = _run(root / "mlp.json", "--blocks", "3", "--recipes", "qsdp-w8g8", "cgx",
             "--cprofile", str(prof))  # fmt: skip
    return d, prof.read_text()


def test_counts_every_hook_of_a_step(mlp):
    d, _ = mlp
    assert d["kernels"] == "stubbed" and d["world_size"] == 4 and d["blocks"] == 3
    rows = {r["recipe"]: r for r in d["rows"]}
    assert list(rows) == ["plain", "qsdp-w8g8", "cgx"]
    assert rows["plain"]["hook_calls"] == 0 and rows["plain"]["extra_ms_vs_plain"] == 0
    assert rows["plain"]["x_plain"] == 1.0 and len(rows["cgx"]["x_plain_by_round"]) == 1
    w8 = rows["qsdp-w8g8"]["hooks"]
    # each block gathered for the forward and again for the backward, reduced once, one verdict
    assert w8["qsdp::all-gather"]["calls"] == 6
    assert w8["qsdp::reduce-scatter"]["calls"] == 3
    assert w8["qsdp::nonfinite verdict"]["calls"] == 1
    assert "qsdp::all-gather" not in rows["cgx"]["hooks"]  # gradients only
    assert rows["cgx"]["hooks"]["qsdp::reduce-scatter"]["calls"] == 3
    for r in rows.values():
        assert r["ms_per_step"] > 0
    # the compressed steps issue more ops than plain FSDP2's, weights and gradients the most
    assert rows["plain"]["issued_ops"] < rows["cgx"]["issued_ops"] < rows["qsdp-w8g8"]["issued_ops"]


def test_gpt_blocks_and_cprofile(mlp, tmp_path):
    """``--block gpt``: 12 parameters a block (the hooks' count unchanged, more ops than the
    6-parameter block's); ``--cprofile``: one section per variant, the hooks' functions in it;
    ``--mesh``: ``sdp4bit``'s reduce-scatter over 2 nodes x 2 (two levels), the others' as
    ever."""
    prof = tmp_path / "gpt.txt"
    gpt = _run(tmp_path / "gpt.json", "--blocks", "3", "--recipes", "cgx", "sdp4bit", "--block",
               "gpt", "--mesh", "--cprofile", str(prof))  # fmt: skip
    assert gpt["mesh"] == "2 nodes x 2" and mlp[0]["mesh"] is None
    two = prof.read_text().split("== sdp4bit")[1]
    assert "_two_level.py" in two and "_two_level.py" not in prof.read_text().split("== sdp4bit")[0]
    assert {r["recipe"]: r for r in gpt["rows"]}["sdp4bit"]["hooks"]["qsdp::reduce-scatter"][
        "calls"
    ] == 3
    ops = {}
    for block, d, text in (("mlp", *mlp), ("gpt", gpt, prof.read_text())):
        assert d["block"] == block and d["device"] == "cpu"
        cgx = {r["recipe"]: r for r in d["rows"]}["cgx"]
        assert cgx["hooks"]["qsdp::reduce-scatter"]["calls"] == 3
        ops[block] = cgx["issued_ops"]
        assert "== plain: 2 steps" in text and "== cgx: 2 steps" in text
        assert "_reduce_scatter.py" in text.split("== cgx")[1]  # the hook's code, profiled
    assert ops["gpt"] > ops["mlp"]


def test_ddp_buckets_against_a_hook_that_does_nothing(tmp_path):
    """``--ddp KB``: the blocks in DDP with small buckets (several), a no-op hook as the floor;
    each recipe's hook issues ops on top of it, CGX's two phases more than Global-QSGD's."""
    d = _run(tmp_path / "ddp.json", "--blocks", "3", "--ddp", "16", "--recipes", "cgx",
             "global-qsgd")  # fmt: skip
    assert d["parallel"] == "ddp, buckets of 16.0 KiB" and d["ddp_buckets"] >= 3, d
    rows = {r["recipe"]: r for r in d["rows"]}
    assert list(rows) == ["noop", "cgx", "global-qsgd"]
    assert rows["noop"]["x_plain"] == 1.0 and rows["noop"]["hook_calls"] == 0
    ops = [rows[name]["issued_ops"] for name in rows]
    assert ops[0] < ops[2] < ops[1], ops  # noop < global-qsgd < cgx
    # one NaN/Inf verdict a backward, whatever the buckets; each bucket's hook in a scope
    for name in ("cgx", "global-qsgd"):
        hooks = rows[name]["hooks"]
        assert hooks["qsdp::nonfinite verdict"]["calls"] == 1
        assert hooks["qsdp::ddp all-reduce"]["calls"] == d["ddp_buckets"], hooks


def test_ddp_at_staleness_1_beside_the_synchronous_hook(tmp_path):
    """``--ddp KB`` with ``NAME+s1`` (``--optimizer``: the prediction runs on its state): each
    bucket still one hook call a backward, the delayed send and the prediction on top of the
    synchronous hook's ops; an option DDP lacks is refused by name."""
    d = _run(tmp_path / "ddp_s1.json", "--blocks", "3", "--ddp", "16", "--optimizer",
             "--recipes", "cgx", "cgx+s1")  # fmt: skip
    rows = {r["recipe"]: r for r in d["rows"]}
    assert list(rows) == ["noop", "cgx", "cgx+s1"]
    for name in ("cgx", "cgx+s1"):
        assert rows[name]["hooks"]["qsdp::ddp all-reduce"]["calls"] == d["ddp_buckets"]
    assert rows["cgx+s1"]["issued_ops"] > rows["cgx"]["issued_ops"]
    cmd = [sys.executable, "benchmarks/host_per_step.py", "--out", str(tmp_path / "x.json"),
           "--ddp", "16", "--recipes", "cgx+s1+graphs", "--optimizer"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "the options are +pipeline, +graphs and +s1" in run.stderr
