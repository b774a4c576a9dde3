"""``qsdp train`` on CPU: every recipe runs, bytes and ratios add up, a resumed run continues
exactly, bad inputs are refused with clear messages."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import qsdp
from qsdp.config import RECIPES
from qsdp.policy import AutoDecision
from qsdp.testing import run_distributed
from qsdp_train.data import open_data, prepare_data
from qsdp_train.train_cli import main as train_main
from qsdp_train.trainer import TrainConfig, lr_at, train_rank

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 400


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "play.txt").write_text(TEXT)
    return prepare_data(str(root / "play.txt"), "byte", cache_dir=root / "cache")


def _cfg(out: Path, recipe: str, **kw) -> TrainConfig:
    base = dict(
        preset="cpu-tiny",
        steps=4,
        micro_batch=2,
        block_size=32,
        eval_every=2,
        eval_batches=2,
        warmup=1,
        progress=False,
        tensorboard=False,
    )
    if kw.get("staleness") and "stale_after" not in kw:
        kw["stale_after"] = 0  # (short runs of the delayed schedule itself, from the first step)
    return TrainConfig(out=str(out), recipe=recipe, **(base | kw))


def _rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _every_recipe(rank: int, world: int, data: str, root: str) -> None:
    for name in RECIPES:
        train_rank(_cfg(Path(root) / name, name), open_data(Path(data)), torch.device("cpu"))


def test_every_recipe_trains_and_counts_its_bytes(data_dir, tmp_path):
    run_distributed(_every_recipe, 2, str(data_dir), str(tmp_path), timeout_s=600)
    ratio = {}
    for name in RECIPES:
        rows = _rows(tmp_path / name)
        assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
        assert all(np.isfinite(float(r["loss"])) for r in rows)
        assert rows[1]["val_loss"] and rows[3]["val_loss"] and not rows[0]["val_loss"]
        last = rows[-1]
        parts = sum(int(last[k]) for k in ("wire_bytes_all_gather", "wire_bytes_reduce_scatter"))
        assert int(last["wire_bytes"]) == parts + int(last["wire_bytes_all_reduce"])
        ratio[name] = float(last["compression_ratio"])
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["recipe"] == name and config["world_size"] == 2
        assert (tmp_path / name / "ckpt" / "latest").read_text() == "step_0000004"
    assert ratio["bf16"] == 1.0  # the uncompressed run sends exactly plain FSDP2's bytes
    assert 3.5 < ratio["qsdp-w8g8"] < 4.0  # 8-bit codes + scales (+ raw 1-D) vs fp32 on gloo
    assert ratio["sdp4bit"] > 2 * ratio["qsdp-w8g8"]
    assert 1.0 < ratio["qwd-only"] < ratio["sdp4bit"]


def _checkpoint_every_step(rank: int, world: int, data: str, root: str) -> None:
    cfg = _cfg(Path(root), "bf16", steps=5, ckpt_every=1, eval_every=0)  # default keep: 3
    train_rank(cfg, open_data(Path(data)), torch.device("cpu"))


def test_checkpoints_are_pruned_to_the_last_three_by_default(data_dir, tmp_path):
    run_distributed(_checkpoint_every_step, 2, str(data_dir), str(tmp_path))
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["latest", "step_0000003", "step_0000004", "step_0000005"], kept
    assert TrainConfig(out="x").keep_checkpoints == 3
    with pytest.raises(ValueError, match="--keep-checkpoints must be >= 0"):
        TrainConfig(out="x", keep_checkpoints=-1)


def _resume(rank: int, world: int, data: str, root: str, recipe: str) -> None:
    d = open_data(Path(data))
    cpu = torch.device("cpu")
    train_rank(_cfg(Path(root) / "straight", recipe, steps=6, seed=3), d, cpu)
    train_rank(_cfg(Path(root) / "resumed", recipe, steps=6, seed=3, stop_at=3), d, cpu)
    train_rank(_cfg(Path(root) / "resumed", recipe, steps=6, seed=3, resume=True), d, cpu)


@pytest.mark.parametrize("recipe", ["qsdp-w8g8", "sdp4bit"])
def test_resume_continues_the_run(data_dir, tmp_path, recipe):
    run_distributed(_resume, 2, str(data_dir), str(tmp_path), recipe, timeout_s=600)
    a, b = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in b] == [str(i) for i in range(6)]  # no duplicated rows
    la, lb = [float(r["loss"]) for r in a], [float(r["loss"]) for r in b]
    if recipe == "qsdp-w8g8":
        assert la == lb  # weights, optimizer, noise counters and data order all restored
    else:
        # weight differences restart from a full-precision gather after a load (by design)
        assert (
            la[:3] == lb[:3]
            and max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 2e-3 * la[-1]
        )


def _feedback_resume(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    kw = {"steps": 6, "seed": 3, "parallel": "ddp", "error_feedback": True}
    train_rank(_cfg(Path(root) / "straight", "cgx", **kw), d, cpu)
    train_rank(_cfg(Path(root) / "resumed", "cgx", stop_at=3, **kw), d, cpu)
    train_rank(_cfg(Path(root) / "resumed", "cgx", resume=True, **kw), d, cpu)
    train_rank(_cfg(Path(root) / "plain", "cgx", **(kw | {"error_feedback": False})), d, cpu)


def test_ddp_error_feedback_trains_and_resumes_exactly(data_dir, tmp_path):
    # 3 ranks: every rank's residual is its own, and each must come back from the checkpoint
    run_distributed(_feedback_resume, 3, str(data_dir), str(tmp_path), timeout_s=600)
    straight, resumed, plain = (
        [float(r["loss"]) for r in _rows(tmp_path / n)] for n in ("straight", "resumed", "plain")
    )
    # exact up to the resumed step; from there DDP's first iteration runs on its initial
    # buckets, whose quantization groups differ (see test_ddp_and_hsdp_train_count_and_resume;
    # the residuals' own round trip is exact: tests/ddp/test_ddp.py)
    assert straight[:3] == resumed[:3]
    assert max(abs(x - y) for x, y in zip(straight, resumed, strict=True)) < 2e-3 * straight[-1]
    assert straight[:1] == plain[:1] and straight != plain  # the residuals change the run
    saved = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert saved["error_feedback"] is True


def _buckets_and_pipeline(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    kw = {"steps": 4, "seed": 5, "parallel": "ddp"}
    small = {"ddp_bucket_mb": 0.25}  # cpu-tiny's 3.4 MB of gradients: 13+ buckets, not 2
    train_rank(_cfg(Path(root) / "default", "cgx", **kw), d, cpu)
    train_rank(_cfg(Path(root) / "small", "cgx", **kw, **small), d, cpu)
    train_rank(_cfg(Path(root) / "piped", "cgx", **kw, **small, pipeline=True), d, cpu)
    hsdp = kw | {"parallel": "hsdp", "nodes": 3}  # 3 nodes of 1: every exchange inter-node
    train_rank(_cfg(Path(root) / "hsdp", "cgx", **hsdp), d, cpu)
    train_rank(_cfg(Path(root) / "hsdp-piped", "cgx", **hsdp, pipeline=True), d, cpu)


def test_ddp_bucket_size_and_pipeline_reach_ddp_and_hsdp(data_dir, tmp_path):
    # 3 ranks; --pipeline changes where the exchanges run, never the bits
    run_distributed(_buckets_and_pipeline, 3, str(data_dir), str(tmp_path), timeout_s=600)
    default, small, piped, hsdp, hsdp_piped = (
        [float(r["loss"]) for r in _rows(tmp_path / n)]
        for n in ("default", "small", "piped", "hsdp", "hsdp-piped")
    )
    assert small == piped and hsdp == hsdp_piped
    # other buckets cut the quantization groups elsewhere: the run changes from its 2nd step
    assert default[0] == small[0] and default != small
    saved = json.loads((tmp_path / "piped" / "config.json").read_text())
    assert (saved["ddp_bucket_mb"], saved["pipeline"]) == (0.25, True)


def _redecide(rank: int, world: int, data: str, root: str) -> None:
    from qsdp.policy import auto

    d, cpu = open_data(Path(data)), torch.device("cpu")
    codec, launches = {8: 1e-12, 4: 1e-12}, {8: 1e-4, 4: 1e-4}  # 100 us of launches a call

    def link(bytes_per_s):  # injected measurements: the network "changes" between the runs
        def fake(group, device, **kw):
            n = torch.distributed.get_world_size(group)
            return auto.Measured(1e-5, bytes_per_s, codec, n, codec_s_per_call=launches)

        return fake

    out = Path(root) / "redecided"
    auto.measure = link(300e9)  # fast: uncompressed
    train_rank(_cfg(out, "auto", steps=4, stop_at=2, ckpt_every=0), d, cpu)
    auto.measure = link(1e6)  # slow: compress
    kept = Path(root) / "kept"
    train_rank(_cfg(kept, "auto", steps=4, stop_at=2, ckpt_every=0), d, cpu)
    train_rank(_cfg(kept, "auto", steps=4, resume=True, ckpt_every=0), d, cpu)
    train_rank(_cfg(out, "auto", steps=4, resume=True, redecide=True, ckpt_every=0), d, cpu)
    ddp = {"steps": 4, "ckpt_every": 0, "parallel": "ddp"}  # DDP: no hook, then a hook
    auto.measure = link(300e9)
    train_rank(_cfg(Path(root) / "ddp", "auto", stop_at=2, **ddp), d, cpu)
    auto.measure = link(1e6)
    train_rank(_cfg(Path(root) / "ddp", "auto", resume=True, redecide=True, **ddp), d, cpu)


def test_auto_redecides_on_resume_when_asked(data_dir, tmp_path, capsys):
    run_distributed(_redecide, 2, str(data_dir), str(tmp_path), timeout_s=600)
    rows = _rows(tmp_path / "redecided")
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    ratio = [float(r["compression_ratio"]) for r in rows]
    assert ratio[:2] == [1.0, 1.0] and min(ratio[2:]) > 2, ratio  # compressed from the resume
    loss = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0]
    record = json.loads((tmp_path / "redecided" / "config.json").read_text())["auto"]
    assert record["recipe"] != "bf16" and record["previous"]["recipe"] == "bf16"
    assert record["redecided_at"] == 2
    ddp = _rows(tmp_path / "ddp")
    assert [float(r["compression_ratio"]) for r in ddp][:2] == [1.0, 1.0]
    assert min(float(r["compression_ratio"]) for r in ddp[2:]) > 2
    record = json.loads((tmp_path / "ddp" / "config.json").read_text())["auto"]
    assert (record["previous"]["recipe"], record["recipe"]) == ("bf16", "cgx")
    # without --redecide a resumed run keeps its choice, whatever the link measures now
    kept = json.loads((tmp_path / "kept" / "config.json").read_text())["auto"]
    assert kept["recipe"] != "bf16" and "previous" not in kept


def _ddp_hsdp(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    for mode, recipe in (
        ("ddp", "bf16"),
        ("ddp", "cgx"),
        ("hsdp", "bf16"),
        ("hsdp", "global-qsgd"),
    ):
        out = Path(root) / f"{mode}-{recipe}"
        train_rank(_cfg(out, recipe, parallel=mode, grad_accum=2), d, cpu)
    # DDP resumes: the hook's noise counters are part of the checkpoint
    for name, kw in (("straight", {}), ("resumed", {"stop_at": 2}), ("resumed", {"resume": True})):
        train_rank(_cfg(Path(root) / f"ddp-{name}", "cgx", parallel="ddp", seed=3, **kw), d, cpu)
    # HSDP at staleness 1 predicts from each node's average by default; the estimates differ
    # between the nodes and each replica checkpoints its own: resumed exactly
    for name, kw in (
        ("stale", {}),
        ("stale-resumed", {"stop_at": 2}),
        ("stale-resumed", {"resume": True}),
        ("stale-last", {"predict": "last"}),
    ):
        cfg = _cfg(Path(root) / f"hsdp-{name}", "cgx", parallel="hsdp", staleness=1, seed=3)
        train_rank(replace(cfg, **kw), d, cpu)


def test_ddp_and_hsdp_train_count_and_resume(data_dir, tmp_path):
    run_distributed(_ddp_hsdp, 4, str(data_dir), str(tmp_path), timeout_s=600)
    ratio, loss = {}, {}
    for run in ("ddp-bf16", "ddp-cgx", "hsdp-bf16", "hsdp-global-qsgd"):
        rows = _rows(tmp_path / run)
        assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
        last = rows[-1]
        parts = ("wire_bytes_all_gather", "wire_bytes_reduce_scatter", "wire_bytes_all_reduce")
        assert int(last["wire_bytes"]) == sum(int(last[k]) for k in parts)
        ratio[run], loss[run] = float(last["compression_ratio"]), float(last["loss"])
        saved = json.loads((tmp_path / run / "config.json").read_text())
        assert saved["parallel"] == run.split("-")[0]
    assert ratio["ddp-bf16"] == ratio["hsdp-bf16"] == 1.0, ratio  # references count what runs
    assert ratio["ddp-cgx"] > 6  # 4-bit codes + scales vs fp32, 1-D parameters raw
    assert ratio["hsdp-global-qsgd"] > 1  # only the all-reduce across nodes is compressed
    assert abs(loss["ddp-cgx"] - loss["ddp-bf16"]) < 0.03 * loss["ddp-bf16"]
    assert abs(loss["hsdp-global-qsgd"] - loss["hsdp-bf16"]) < 0.03 * loss["hsdp-bf16"]
    stale, resumed, last = (
        [float(r["loss"]) for r in _rows(tmp_path / f"hsdp-{n}")]
        for n in ("stale", "stale-resumed", "stale-last")
    )
    assert stale == resumed, (stale, resumed)
    assert stale[:2] == last[:2] and stale[2] != last[2], (stale, last)
    saved = json.loads((tmp_path / "hsdp-stale" / "config.json").read_text())
    assert saved["predict"] == "local" and saved["staleness"] == 1
    # a resumed DDP run restores weights, optimizer and noise counters, but its first step runs
    # on DDP's initial buckets (DDP rebuilds them after its first iteration), so the
    # quantization groups, and with them the noise, differ from there: close, not identical
    a, b = _rows(tmp_path / "ddp-straight"), _rows(tmp_path / "ddp-resumed")
    la, lb = [float(r["loss"]) for r in a], [float(r["loss"]) for r in b]
    assert [r["step"] for r in b] == ["0", "1", "2", "3"] and la[:3] == lb[:3]
    assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 2e-3 * la[-1]


def _stale(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    for parallel, recipe in (("ddp", "bf16"), ("fsdp", "qsdp-w8g8")):
        for name, kw in (
            ("sync", {}),
            ("straight", {"staleness": 1}),
            ("as-is", {"staleness": 1, "predict": "none"}),
            ("accumulated", {"staleness": 1, "grad_accum": 2}),
            ("resumed", {"staleness": 1, "stop_at": 2}),  # right after an evaluation
            ("resumed", {"staleness": 1, "resume": True}),
            ("gated", {"staleness": 1, "stale_bound": 1e-9}),
            ("gated-resumed", {"staleness": 1, "stale_bound": 1e-9, "stop_at": 2}),
            ("gated-resumed", {"staleness": 1, "stale_bound": 1e-9, "resume": True}),
        ):
            out = Path(root) / f"{parallel}-{name}"
            cfg = _cfg(out, recipe, parallel=parallel, steps=6, seed=3, ckpt_every=0, **kw)
            train_rank(cfg, d, cpu)
    # the default prediction is from each rank's own gradient (the runs above); against the
    # last update's
    for parallel, recipe in (("ddp", "bf16"), ("fsdp", "qsdp-w8g8")):
        out = Path(root) / f"{parallel}-last"
        cfg = _cfg(out, recipe, parallel=parallel, steps=6, seed=3, ckpt_every=0, staleness=1)
        train_rank(replace(cfg, predict="last"), d, cpu)


def test_staleness_trains_late_gates_and_resumes_exactly(data_dir, tmp_path):
    run_distributed(_stale, 2, str(data_dir), str(tmp_path), timeout_s=600)
    for parallel in ("ddp", "fsdp"):
        _check_stale(tmp_path, parallel)
    for parallel in ("ddp", "fsdp"):
        local, last = (
            [float(r["loss"]) for r in _rows(tmp_path / f"{parallel}-{n}")]
            for n in ("straight", "last")
        )
        # step 1 has a gradient in flight but no optimizer state to step from yet; from step 2
        # on the prediction from each rank's own gradient differs from the last update's (and
        # _check_stale saw it resume exactly: the checkpoint carries each rank's own gradient)
        assert local[:2] == last[:2] and local[2] != last[2], (parallel, local, last)
        saved = json.loads((tmp_path / f"{parallel}-straight" / "config.json").read_text())
        assert saved["predict"] == "local", (parallel, saved["predict"])  # the default, recorded


def _check_stale(tmp_path: Path, parallel: str) -> None:
    def col(name: str, key: str) -> list:
        return [r[key] for r in _rows(tmp_path / f"{parallel}-{name}")]

    sync, straight, resumed = (
        [float(x) for x in col(n, "loss")] for n in ("sync", "straight", "resumed")
    )
    assert len(straight) == len(resumed) == 6
    # the checkpoint carries the reduction in flight and the weight prediction's last update:
    # the resumed run is the straight one (2 ranks: a sum of two floats does not depend on
    # DDP's bucket layout)
    assert straight == resumed
    # weight prediction: step 1 applies the first update, step 2 computes ahead by it
    as_is = [float(x) for x in col("as-is", "loss")]
    assert as_is[:2] == straight[:2] and as_is[2] != straight[2], (as_is, straight)
    # with gradient accumulation the step's micro-batches all compute ahead
    accumulated = [float(x) for x in col("accumulated", "loss")]
    assert len(accumulated) == 6 and accumulated[-1] < accumulated[0], accumulated
    # the first step applies nothing and takes no optimizer step: the second step computes on
    # the initial weights, where the synchronous run moved already
    assert sync[0] == straight[0] and sync[1] != straight[1]
    # [Note: the delayed gradient's learning rate]: step t applies step t - 1's gradient at
    # step t - 1's rate (step 0 applies nothing), so the applied rates are the synchronous ones
    lrs = {n: [float(x) for x in col(n, "lr")] for n in ("sync", "straight")}
    assert lrs["straight"][1:] == lrs["sync"][:-1], lrs
    assert len(set(lrs["sync"])) > 2, lrs  # (a schedule that moves)
    # without a bound the gate only measures: lr * |g| of each applied gradient, never forced
    gap = col("straight", "stale_gap")
    assert gap[0] == "" and all(float(x) > 0 for x in gap[1:]), gap
    assert col("straight", "sync_forced") == ["0"] * 6
    # a bound below every update: each step that applies a delayed gradient forces a drain,
    # the next runs synchronously (it moves like the synchronous run), the one after restarts
    # the pipeline (applies nothing): forced at steps 1 and 4
    assert col("gated", "sync_forced") == ["0", "1", "1", "1", "2", "2"]
    gated = [float(x) for x in col("gated", "loss")]
    assert gated[:2] == straight[:2] and gated[2] != straight[2]
    # the gate's count and its pending synchronous step survive a resume
    assert col("gated-resumed", "sync_forced") == col("gated", "sync_forced")
    assert [float(x) for x in col("gated-resumed", "loss")] == gated
    saved = json.loads((tmp_path / f"{parallel}-gated" / "config.json").read_text())
    assert saved["staleness"] == 1 and saved["stale_bound"] == 1e-9


def _adaptive(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    train_rank(_cfg(Path(root) / "adaptive", "cgx", steps=6, adaptive_every=2, seed=1), d, cpu)
    per = {"adaptive_every": 2, "adaptive_per_parameter": True, "seed": 1}
    train_rank(_cfg(Path(root) / "adaptive-param", "cgx", steps=6, **per), d, cpu)
    for parallel in ("fsdp", "ddp", "hsdp"):
        train_rank(
            _cfg(Path(root) / f"auto-{parallel}", "auto", steps=2, parallel=parallel), d, cpu
        )
    stop, resume = {"stop_at": 1, "ckpt_every": 0}, {"resume": True, "ckpt_every": 0}
    for kw in (stop, resume):  # a resumed "auto" run keeps its choice, measures nothing
        train_rank(_cfg(Path(root) / "auto-resumed", "auto", steps=2, **kw), d, cpu)


def test_adaptive_widths_and_auto_in_the_trainer(data_dir, tmp_path):
    run_distributed(_adaptive, 2, str(data_dir), str(tmp_path), timeout_s=600)
    saved = [r["grad_bytes_saved"] for r in _rows(tmp_path / "adaptive")]
    # the first plan is decided in step 1's backward (warm-up: a tenth of the steps, at least 1)
    assert saved[0] == "" and all(0 <= float(x) < 1 for x in saved[1:]), saved
    config = json.loads((tmp_path / "adaptive" / "config.json").read_text())
    assert config["adaptive_every"] == 2
    # a width per parameter: decided, logged and recorded the same way
    saved = [r["grad_bytes_saved"] for r in _rows(tmp_path / "adaptive-param")]
    assert saved[0] == "" and all(0 <= float(x) < 1 for x in saved[1:]), saved
    config = json.loads((tmp_path / "adaptive-param" / "config.json").read_text())
    assert config["adaptive_per_parameter"] is True
    for parallel in ("fsdp", "ddp", "hsdp"):  # "auto" measured, chose, recorded, trained
        rows = _rows(tmp_path / f"auto-{parallel}")
        assert len(rows) == 2 and float(rows[-1]["compression_ratio"]) > 0
        auto = json.loads((tmp_path / f"auto-{parallel}" / "config.json").read_text())["auto"]
        assert auto["recipe"] in qsdp.RECIPES and auto["bus_gb_per_s"] > 0
        # the typed decision, rebuilt from config.json as a resumed run rebuilds it
        decision = AutoDecision.from_record(auto)
        assert decision.record() == auto and decision.config() == qsdp.recipe(auto["recipe"])
        if parallel == "fsdp":  # decided per collective: the options of each
            assert set(auto["predicted_s"]) == {"weights", "grads"}
            assert {auto["weights"], auto["grads"]} <= {"none", "w8", "wd4", "g8", "g4"}
        else:  # one all-reduce (DDP's; compressed HSDP's across the nodes)
            assert set(auto["predicted_s"]) == {"all_reduce"} and auto["all_reduce"]
    resumed = json.loads((tmp_path / "auto-resumed" / "config.json").read_text())["auto"]
    assert "recipe" in resumed and len(_rows(tmp_path / "auto-resumed")) == 2


def _emulated_nodes(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    for name, kw in (("flat", {}), ("nodes", {"nodes": 2})):
        train_rank(_cfg(Path(root) / name, "sdp4bit", steps=2, **kw), d, cpu)
    # staleness 1 over two levels: each shard's estimate is its node's average, kept in the
    # checkpoint (two-level gradients without weight differences, which resync on a load)
    stale = {"nodes": 2, "staleness": 1, "steps": 5, "ckpt_every": 0}
    for name, kw in (
        ("stale", {}),
        ("stale-resumed", {"stop_at": 2}),  # right after an evaluation
        ("stale-resumed", {"resume": True}),
    ):
        train_rank(_cfg(Path(root) / name, "tlq-hs-only", **(stale | kw)), d, cpu)


def _stale_bytes(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    for name, kw in (("sync", {}), ("stale", {"staleness": 1})):
        train_rank(_cfg(Path(root) / name, "bf16", steps=3, **kw), d, cpu)


def test_staleness_counts_the_uncompressed_reduction_once(data_dir, tmp_path):
    run_distributed(_stale_bytes, 2, str(data_dir), str(tmp_path), timeout_s=600)
    cols = ("wire_bytes_all_gather", "wire_bytes_reduce_scatter")
    sync, stale = (
        [r[c] for c in cols] for r in (_rows(tmp_path / n)[-1] for n in ("sync", "stale"))
    )
    assert sync == stale and int(sync[1]) > 0  # the stale hook's count, not twice


def _stale_after(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    for parallel, recipe in (("fsdp", "sdp4bit"), ("ddp", "cgx")):
        for name, kw in (("sync", {}), ("late", {"staleness": 1, "stale_after": 3})):
            cfg = _cfg(Path(root) / f"{parallel}-{name}", recipe, steps=5, parallel=parallel)
            train_rank(replace(cfg, **kw), d, cpu)


def test_stale_after_runs_the_first_steps_synchronously(data_dir, tmp_path):
    run_distributed(_stale_after, 2, str(data_dir), str(tmp_path), timeout_s=600)
    for parallel in ("fsdp", "ddp"):
        sync, late = (
            [float(r["loss"]) for r in _rows(tmp_path / f"{parallel}-{n}")]
            for n in ("sync", "late")
        )
        # steps 0-2 reduce and apply at once: the same bits as staleness 0; step 3 is the first
        # stale one (it applies nothing, so step 4 starts from where step 3 did)
        assert late[:4] == sync[:4] and late[4] != sync[4], (parallel, sync, late)


def _auto_start(rank: int, world: int, data: str, root: str) -> None:
    d = open_data(Path(data))
    for name, kw in (("sync", {}), ("auto", {"staleness": 1, "stale_after": "auto"})):
        cfg = _cfg(
            Path(root) / name, "bf16", parallel="ddp", steps=30, warmup=25, eval_every=0, **kw
        )
        train_rank(cfg, d, torch.device("cpu"))


def test_the_automatic_start_is_the_synchronous_run_until_it_starts(data_dir, tmp_path):
    # Schedule(start="auto"), the default: the steps before the gradient norm settles reduce
    # and apply their own gradients, so they are the synchronous run's, bit for bit, learning
    # rate included ([Note: the delayed gradient's learning rate]); until 2026-11-29 they took
    # the previous step's rate, a warm-up one step behind
    run_distributed(_auto_start, 2, str(data_dir), str(tmp_path), timeout_s=600)
    rows = {n: _rows(tmp_path / n) for n in ("sync", "auto")}
    loss = {n: [float(r["loss"]) for r in rows[n]] for n in rows}
    lr = {n: [float(r["lr"]) for r in rows[n]] for n in rows}
    # the first delayed step applies nothing: the step after it is the first to differ
    first = next(t for t in range(30) if loss["auto"][t] != loss["sync"][t]) - 1
    assert 20 <= first < 29, (first, loss)  # (it needs two windows of 10 norms)
    assert lr["auto"][:first] == lr["sync"][:first], lr
    # from there each step applies the step before's gradient at that step's rate
    assert lr["auto"][first + 1 :] == lr["sync"][first:-1], lr
    assert len(set(lr["sync"][first:])) > 2, lr  # (a schedule that moves)


def _ahead(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    # a constant rate and no clipping: the gathers ahead anticipate the coming step exactly,
    # up to how torch's AdamW rounds its step (the copies take the fused kernel), a last-bit
    # difference that 4-bit weight differences may round to a quantization step
    base = dict(steps=6, warmup=0, min_lr_ratio=1.0, grad_clip=1e9, staleness=1, ckpt_every=0)
    for name, kw in (
        ("loop", {}),
        ("ahead", {"gather_ahead": True}),
        ("ahead-resumed", {"gather_ahead": True, "stop_at": 3}),
        ("ahead-resumed", {"gather_ahead": True, "resume": True}),
    ):
        cfg = _cfg(Path(root) / name, "sdp4bit", seed=3, **base, **kw)
        train_rank(cfg, d, cpu)
    try:
        train_rank(
            _cfg(Path(root) / "ahead-resumed", "sdp4bit", seed=3, **base, resume=True), d, cpu
        )
    except ValueError as e:  # the saved run gathered ahead: a resume must too
        return str(e)
    return "accepted"


def test_gather_ahead_trains_as_the_loops_prediction_and_resumes(data_dir, tmp_path):
    refused = run_distributed(_ahead, 2, str(data_dir), str(tmp_path), timeout_s=600)
    loss = {
        n: [float(r["loss"]) for r in _rows(tmp_path / n)]
        for n in ("loop", "ahead", "ahead-resumed")
    }
    # step 0 applies nothing, step 1 applies step 0's gradient; step 2 is the first forward
    # served from weights gathered in the backward before
    assert loss["ahead"][:2] == loss["loop"][:2], loss
    close = [abs(a - b) / b for a, b in zip(loss["ahead"], loss["loop"], strict=True)]
    assert max(close) < 1e-3, (close, loss)
    assert loss["ahead"][2:] != loss["loop"][2:], loss  # gathered ahead (rounded otherwise)
    # a resumed run gathers its first forward anew, then ahead again
    assert loss["ahead-resumed"][:3] == loss["ahead"][:3], loss
    back = [abs(a - b) / b for a, b in zip(loss["ahead-resumed"], loss["ahead"], strict=True)]
    assert max(back) < 1e-3, (back, loss)
    assert all(r == refused[0] for r in refused)  # every rank the same outcome
    assert "gather_ahead" in refused[0], refused[0]


def test_nodes_emulate_two_levels_for_fsdp(data_dir, tmp_path):
    run_distributed(_emulated_nodes, 4, str(data_dir), str(tmp_path), timeout_s=600)
    rs = {
        name: int(_rows(tmp_path / name)[-1]["wire_bytes_reduce_scatter"])
        for name in ("flat", "nodes")
    }
    # per piece of L elements on a 2 x 2 mesh, two levels send 2 * L 8-bit codes inside the node
    # and L / 2 bytes of 4-bit codes between them (2.5 L); one level 3 * L / 2 (plus scales)
    assert 1.5 < rs["nodes"] / rs["flat"] < 1.8, rs
    # staleness 1 with the node's estimates resumes exactly
    straight, resumed = (
        [r["loss"] for r in _rows(tmp_path / n)] for n in ("stale", "stale-resumed")
    )
    assert len(straight) == 5 and straight == resumed, (straight, resumed)
    config = json.loads((tmp_path / "stale" / "config.json").read_text())
    assert config["predict"] == "local" and config["nodes"] == 2


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(out="x", steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(1e-4) and lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 100) == pytest.approx(1e-4)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(10, 100))


def _graphs_on_cpu(rank: int, world: int, data: str, root: str) -> str:
    cfg = _cfg(Path(root) / "graphs", "qsdp-w8g8", graphs=True)
    try:
        train_rank(cfg, open_data(Path(data)), torch.device("cpu"))
    except ValueError as e:
        return str(e)
    return "trained"


def test_graphs_off_cuda_are_refused_on_every_rank_before_anything_is_written(data_dir, tmp_path):
    """``--graphs`` replays CUDA graphs; a CPU run says so on every rank and writes nothing.
    The schedule it asks for is ``Schedule(graphs=True)``, the library's (tested on a GPU)."""
    got = run_distributed(_graphs_on_cpu, 2, str(data_dir), str(tmp_path))
    assert all("--graphs replays CUDA graphs; this run is on cpu" in g for g in got), got
    assert not (tmp_path / "graphs" / "metrics.csv").exists()
    assert _cfg(tmp_path, "cgx", graphs=True).schedule() == qsdp.Schedule(graphs=True)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"recipe": "int3"}, "unknown recipe 'int3'"),
        ({"preset": "gpt-9b"}, "unknown preset 'gpt-9b'"),
        ({"steps": 0}, "--steps must be positive"),
        ({"steps": 5, "stop_at": 9}, "--stop-at must be in [1, --steps]"),
        ({"lr": 2.0}, "--lr must be in (0, 1)"),
        ({"parallel": "ddp", "recipe": "sdp4bit"}, "has two-level gradients"),
        ({"parallel": "ddp", "recipe": "qsdp-w8g8"}, "which DDP does not gather"),
        ({"parallel": "hsdp", "recipe": "tlq-hs-only"}, "has two-level gradients"),
        ({"parallel": "ddp", "recipe": "cgx", "nodes": 2}, "--nodes=2 is for --hsdp or FSDP"),
        ({"nodes": 1}, "--nodes=1 is for --hsdp or FSDP's two-level recipes, and at least 2"),
        ({"parallel": "zero"}, "parallel='zero' must be one of"),
        ({"stale_bound": 0.1}, "--stale-bound=0.1 needs --staleness 1"),
        ({"recipe": "global-qsgd", "adaptive_every": 5}, "adaptive needs quantized gradients"),
        ({"recipe": "cgx", "adaptive_every": 0}, "--adaptive-every must be positive"),
        ({"recipe": "auto", "staleness": 1}, "--recipe auto picks a recipe"),
        ({"staleness": 1, "stale_bound": -1.0}, "a positive bound"),
        ({"stale_after": 5}, "--stale-after=5 must be 'auto', 0 (from the first step) or, with"),
        ({"staleness": 1, "stale_after": "soon"}, "--stale-after=soon must be 'auto'"),
        ({"predict": "none"}, "--predict none is for --staleness 1"),
        ({"gather_ahead": True}, "--gather-ahead is for --staleness 1 under FSDP2"),
        (
            {"gather_ahead": True, "staleness": 1, "stale_bound": 0.1},
            "and no --stale-bound (the schedule predicts and starts itself); got",
        ),
        ({"gather_ahead": True, "staleness": 1, "stale_after": 2, "steps": 5}, "stale_after=2"),
        ({"gather_ahead": True, "staleness": 1, "predict": "last"}, "predict=last"),
        (
            {"gather_ahead": True, "staleness": 1, "recipe": "qsdp-w8g8"},
            "--recipe qsdp-w8g8 gathers none: use sdp4bit",
        ),
        (
            {"graphs": True, "staleness": 1, "parallel": "ddp", "recipe": "cgx"},
            "under DDP at --staleness 0 with cgx",
        ),
        ({"graphs": True, "parallel": "hsdp", "recipe": "cgx"}, "parallel=hsdp"),
        ({"graphs": True, "parallel": "ddp", "recipe": "global-qsgd"}, "recipe=global-qsgd"),
        (
            {"graphs": True, "parallel": "ddp", "recipe": "cgx", "error_feedback": True},
            "error_feedback=True",
        ),
        ({"graphs": True, "recipe": "auto"}, "recipe=auto, error_feedback=False: use it"),
        ({"predict": "ahead"}, "--predict must be one of"),
        ({"staleness": 1, "stale_after": 200}, "a step in (0, --steps)"),
        ({"staleness": 2, "parallel": "ddp", "recipe": "cgx"}, "--staleness must be 0 or 1"),
        ({"adaptive_per_parameter": True}, "--adaptive-per-parameter needs --adaptive-every N"),
        ({"error_feedback": True, "recipe": "cgx"}, "--error-feedback is for --ddp"),
        ({"redecide": True, "recipe": "auto"}, "--redecide is for resuming a --recipe auto run"),
        ({"grad_group_size": 256}, "--grad-group-size 256 is for recipes with quantized"),
        ({"grad_rounding": "nearest", "recipe": "auto"}, "not --recipe auto"),
        ({"grad_rounding": "down", "recipe": "cgx"}, "must be 'stochastic' or 'nearest'"),
        ({"grad_group_size": 100, "recipe": "cgx"}, "group_size"),
        ({"redecide": True, "resume": True, "recipe": "cgx"}, "(got --recipe cgx)"),
        ({"ddp_bucket_mb": 100.0}, "--ddp-bucket-mb 100.0 is DDP's bucket size in MiB"),
        ({"ddp_bucket_mb": 0.0, "parallel": "ddp", "recipe": "cgx"}, "give a positive size"),
        ({"pipeline": True, "recipe": "cgx"}, "--pipeline is for --ddp, or --hsdp at"),
        (
            {"pipeline": True, "recipe": "cgx", "parallel": "hsdp", "staleness": 1},
            "under hsdp at staleness 1",
        ),
        ({"pipeline": True, "parallel": "ddp", "recipe": "bf16"}, "not --recipe bf16 under ddp"),
        (
            {"error_feedback": True, "recipe": "global-qsgd", "parallel": "ddp"},
            "with quantized gradients (cgx, qsdp-g8), not --recipe global-qsgd",
        ),
        (
            {
                "adaptive_every": 5,
                "adaptive_per_parameter": True,
                "parallel": "ddp",
                "recipe": "cgx",
            },
            "FSDP2 at staleness 0",
        ),
    ],
)
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=None) as e:
        TrainConfig(**({"out": "x"} | kw))
    assert message in str(e.value)


def test_gradient_quantizer_overrides_reach_the_config():
    config = TrainConfig(
        out="x", recipe="cgx", parallel="ddp", grad_group_size=1024, grad_rounding="nearest"
    ).compression()
    assert (config.grads.spec.group_size, config.grads.spec.rounding.value) == (1024, "nearest")
    assert (
        config.grads.spec.bits == 4 and config.grads.spec.scheme.value == "minmax"
    )  # the rest kept
    plain = TrainConfig(out="x", recipe="cgx").compression()
    assert plain.grads.spec.group_size == 256 and plain.grads.spec.rounding.value == "stochastic"


@pytest.mark.parametrize(
    "kw, resolved",
    [
        ({}, "last"),  # synchronous: nothing to predict (and "last" is the refusal-free value)
        ({"staleness": 1}, "local"),  # FSDP2: each rank's own gradient (+1.9% against +19%)
        ({"staleness": 1, "nodes": 2, "recipe": "sdp4bit"}, "local"),  # two-level reduce-scatter
        ({"staleness": 1, "parallel": "ddp", "recipe": "cgx"}, "local"),  # its own gradient
        ({"staleness": 1, "parallel": "hsdp", "recipe": "cgx"}, "local"),  # node's average
        ({"staleness": 1, "predict": "last"}, "last"),  # an explicit choice stands
    ],
)
def test_predict_default_is_the_best_that_applies(kw, resolved):
    cfg = TrainConfig(**({"out": "x"} | kw))
    assert cfg.predict == resolved
    assert dataclasses.asdict(cfg)["predict"] == resolved  # what config.json records


def test_cli_rejects_bad_input_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--out", str(tmp_path), "--steps", "0"])
    assert "qsdp train: --steps must be positive" in str(e.value.code)
    with pytest.raises(SystemExit) as e:  # one line, not a traceback
        train_main(["--out", str(tmp_path), "--data", str(tmp_path / "missing.txt")])
    assert str(e.value.code).startswith("qsdp train: data path ")
    assert "missing.txt does not exist" in str(e.value.code)


def _too_long_block(rank: int, world: int, data: str, root: str) -> str:
    try:
        train_rank(
            _cfg(Path(root), "bf16", block_size=100_000), open_data(Path(data)), torch.device("cpu")
        )
    except ValueError as e:
        return str(e)
    return "no error"


def _resume_nothing(rank: int, world: int, data: str, root: str) -> str:
    try:
        train_rank(
            _cfg(Path(root), "bf16", resume=True), open_data(Path(data)), torch.device("cpu")
        )
    except FileNotFoundError as e:
        return str(e)
    return "no error"


def test_too_short_data_and_resume_without_checkpoint_are_clear(data_dir, tmp_path):
    msg = run_distributed(_too_long_block, 2, str(data_dir), str(tmp_path / "a"))[0]
    assert "tokens" in msg and "100001" in msg, msg
    msg = run_distributed(_resume_nothing, 2, str(data_dir), str(tmp_path / "b"))[0]
    assert "--resume: no finished checkpoint" in msg, msg


def test_config_is_frozen():
    cfg = TrainConfig(out="x")
    with pytest.raises(AttributeError):
        cfg.steps = 3  # type: ignore[misc]
    assert replace(cfg, steps=3).steps == 3


def _accumulate(rank: int, world: int, data: str, root: str) -> None:
    d, cpu = open_data(Path(data)), torch.device("cpu")
    train_rank(_cfg(Path(root) / "one", "qsdp-w8g8", steps=2), d, cpu)
    train_rank(_cfg(Path(root) / "two", "qsdp-w8g8", steps=2, grad_accum=2), d, cpu)


def test_accumulation_gathers_per_micro_step_and_reduces_once(data_dir, tmp_path):
    run_distributed(_accumulate, 2, str(data_dir), str(tmp_path))
    one, two = _rows(tmp_path / "one")[-1], _rows(tmp_path / "two")[-1]
    # weights are gathered for every micro-step; gradients reduce-scattered once per step
    assert int(two["wire_bytes_all_gather"]) == 2 * int(one["wire_bytes_all_gather"])
    assert int(two["wire_bytes_reduce_scatter"]) == int(one["wire_bytes_reduce_scatter"])
    assert int(two["tokens"]) == 2 * int(one["tokens"])
    assert np.isfinite(float(two["loss"]))


def test_one_pass_refuses_a_run_longer_than_the_data(data_dir, tmp_path):
    from qsdp_train.rundir import validate

    data = open_data(data_dir)
    windows = (data.train.size - 1) // 32
    fits = windows // (2 * 2)  # micro-batch 2 on 2 ranks
    ok = _cfg(tmp_path / "a", "bf16", data_order="pass", steps=fits)
    validate(ok, data, world_size=2, columns=())
    long = _cfg(tmp_path / "b", "bf16", data_order="pass", steps=fits + 1)
    with pytest.raises(
        ValueError, match=f"holds {windows} windows of 32 tokens; pass --steps {fits}"
    ):
        validate(long, data, world_size=2, columns=())
    validate(_cfg(tmp_path / "c", "bf16", steps=fits + 1), data, world_size=2, columns=())
    with pytest.raises(ValueError, match="--data-order 'epoch' must be one of"):
        _cfg(tmp_path / "d", "bf16", data_order="epoch")
