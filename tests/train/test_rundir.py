"""A run directory is written only by the run that owns it: a new run into an existing one, a
``--resume`` under other settings, an ``--out`` that is a file and data too short for the block
are refused with one line, before any worker starts, and change nothing; a worker that fails
later is reported in one line too."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import qsdp_train.launch as launch_module
from qsdp.testing import run_distributed
from qsdp_train.data import open_data, prepare_data
from qsdp_train.launch import TrainError, launch
from qsdp_train.rundir import RESUME_MAY_CHANGE, RESUME_MUST_MATCH, validate
from qsdp_train.train_cli import main as train_main
from qsdp_train.trainer import COLUMNS, TrainConfig, train_rank

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 400
SETTINGS = dict(
    recipe="bf16",
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
# the same settings as command-line flags
FLAGS = [
    *("--recipe", "bf16", "--steps", "4", "--micro-batch", "2", "--block-size", "32"),
    *("--eval-every", "2", "--eval-batches", "2", "--warmup", "1", "--nproc", "2"),
    *("--no-progress", "--no-tensorboard"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rundir")
    (root / "play.txt").write_text(TEXT)
    (root / "other.txt").write_text(TEXT.upper())
    data = prepare_data(str(root / "play.txt"), None, cache_dir=root / "cache")
    return {"root": root, "txt": root / "play.txt", "other": root / "other.txt", "data": data}


def _stopped_run(rank: int, world: int, data: str, txt: str, out: str) -> None:
    cfg = TrainConfig(out=out, data=txt, stop_at=2, **SETTINGS)  # a checkpoint at step 2
    train_rank(cfg, open_data(Path(data)), torch.device("cpu"))


@pytest.fixture(scope="module")
def saved_run(files) -> Path:
    out = files["root"] / "saved"
    run_distributed(_stopped_run, 2, str(files["data"]), str(files["txt"]), str(out))
    return out


@pytest.fixture
def run(saved_run, files, tmp_path, monkeypatch) -> Path:
    """A copy of a 2-rank run stopped at step 2 of 4, for one test to try to spoil."""
    monkeypatch.setenv("QSDP_DATA_DIR", str(files["root"] / "cache"))
    return Path(shutil.copytree(saved_run, tmp_path / "run"))


class _NoSpawn:
    def get_context(self, *args, **kwargs):
        raise AssertionError("qsdp train started workers for a run it should have refused")


@pytest.fixture
def no_spawn(monkeypatch, files):
    monkeypatch.setenv("QSDP_DATA_DIR", str(files["root"] / "cache"))
    monkeypatch.setattr(launch_module, "mp", _NoSpawn())


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _refused(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    message = str(e.value.code)
    assert message.startswith("qsdp train: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("extra", [[], ["--recipe", "qsdp-w8g8", "--seed", "5"]])
def test_a_new_run_into_a_run_directory_is_refused_and_changes_nothing(run, files, no_spawn, extra):
    before = _snapshot(run)
    message = _refused(["--out", str(run), "--data", str(files["txt"]), *FLAGS, *extra])
    assert f"{run} holds a run (config.json, metrics.csv, ckpt)" in message, message
    assert "pass --resume to continue it, or choose another --out" in message, message
    assert "resume_from_step" not in message  # the Python API's name means nothing to a CLI user
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            ["--recipe", "qsdp-w8g8", "--seed", "5"],
            ["--recipe: saved 'bf16', now 'qsdp-w8g8'", "--seed: saved 0, now 5"],
        ),
        (["--steps", "6"], ["--steps: saved 4, now 6"]),
        (["--micro-batch", "3", "--lr", "0.002"], ["--micro-batch", "--lr"]),
        (["--nproc", "3"], ["the number of processes (--nproc, or torchrun's): saved 2, now 3"]),
        (["--block-size", "16"], ["--block-size: saved 32, now 16"]),
    ],
)
def test_resume_under_other_settings_is_refused_and_changes_nothing(
    run, files, no_spawn, extra, named
):
    before = _snapshot(run)
    argv = ["--out", str(run), "--data", str(files["txt"]), *FLAGS, *extra, "--resume"]
    message = _refused(argv)
    assert "--resume would continue the run in" in message, message
    for text in named:
        assert text in message, message
    assert _snapshot(run) == before


def test_resume_takes_the_saved_settings_and_refuses_only_typed_contradictions(
    run, files, no_spawn
):
    before = _snapshot(run)
    # nothing typed but --seed: --recipe, --steps, --data, ... default to the saved run's
    message = _refused(["--out", str(run), "--resume", "--seed", "5"])
    assert "(--seed: saved 0, now 5)" in message, message
    assert f"`qsdp train --out {run} --resume` takes them all" in message, message
    message = _refused(["--out", str(run), "--resume", "--ddp", "--steps", "6"])
    assert "(--steps: saved 4, now 6; --ddp/--hsdp (parallel): saved 'fsdp', now 'ddp')" in (
        message
    ), message
    assert _snapshot(run) == before


def test_resume_with_only_out_continues_the_run(run, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    train_main(["--out", str(run), "--resume", "--no-progress"])
    steps = [line.split(",")[0] for line in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == ["0", "1", "2", "3"], steps
    assert (run / "ckpt" / "latest").read_text() == "step_0000004"


def test_resume_on_other_data_is_refused(run, files, no_spawn):
    before = _snapshot(run)
    message = _refused(["--out", str(run), "--data", str(files["other"]), *FLAGS, "--resume"])
    assert "--data (the file it names): saved" in message and "other.txt" in message, message
    assert _snapshot(run) == before


def test_every_setting_is_either_compared_or_free_on_resume():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not set(RESUME_MUST_MATCH) & set(RESUME_MAY_CHANGE)
    assert names - set(RESUME_MUST_MATCH) - set(RESUME_MAY_CHANGE) == set()


CHANGED = {
    "recipe": "qsdp-w8g8",
    "preset": "gpt-125m",
    "block_size": 16,
    "micro_batch": 3,
    "grad_accum": 2,
    "steps": 6,
    "lr": 2e-3,
    "min_lr_ratio": 0.2,
    "warmup": 2,
    "weight_decay": 0.0,
    "grad_clip": 0.5,
    "dropout": 0.1,
    "eval_batches": 3,
    "seed": 1,
    "data_order": "pass",
    "two_level": False,
    "parallel": "ddp",
}


def test_resume_checks_each_setting_and_lets_the_free_ones_change(run, files, monkeypatch):
    data = open_data(files["data"])
    saved = TrainConfig(out=str(run), data=str(files["txt"]), resume=True, **SETTINGS)
    validate(saved, data, world_size=2, columns=COLUMNS)  # the same settings: resumable
    free = dataclasses.replace(
        saved, stop_at=3, eval_every=1, ckpt_every=1, progress=True, tensorboard=None
    )
    validate(free, data, world_size=2, columns=COLUMNS)
    monkeypatch.chdir(files["root"])  # the same data named by a relative path
    validate(dataclasses.replace(saved, data="play.txt"), data, world_size=2, columns=COLUMNS)
    for name, value in CHANGED.items():
        flag = (
            "--ddp/--hsdp \\(parallel\\)" if name == "parallel" else "--" + name.replace("_", "-")
        )
        with pytest.raises(ValueError, match=f"{flag}: saved"):
            validate(
                dataclasses.replace(saved, **{name: value}), data, world_size=2, columns=COLUMNS
            )
    for name, value in {
        "grad_group_size": 256,
        "grad_rounding": "nearest",
        "ddp_bucket_mb": 100.0,
    }.items():
        # (overrides of quantized gradients: asked of a cgx run, beside the recipe's own change)
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')}: saved None"):
            cgx = dataclasses.replace(saved, recipe="cgx", parallel="ddp", **{name: value})
            validate(cgx, data, world_size=2, columns=COLUMNS)
    # --nodes exists only with --hsdp: a saved HSDP run resumed with other nodes is refused
    config = run / "config.json"
    text = config.read_text().replace('"parallel": "fsdp"', '"parallel": "hsdp"')
    config.write_text(text.replace('"nodes": null', '"nodes": 2'))
    with pytest.raises(ValueError, match="--nodes: saved 2, now 4"):
        hsdp = dataclasses.replace(saved, parallel="hsdp", nodes=4)
        validate(hsdp, data, world_size=2, columns=COLUMNS)
    # a saved synchronous run resumed at staleness 1 is refused
    config.write_text(config.read_text().replace('"parallel": "hsdp"', '"parallel": "ddp"'))
    with pytest.raises(ValueError, match="--staleness: saved 0, now 1"):
        stale = dataclasses.replace(saved, parallel="ddp", staleness=1)
        validate(stale, data, world_size=2, columns=COLUMNS)
    # a stale run that predicted resumed without prediction is refused
    config.write_text(config.read_text().replace('"staleness": 0', '"staleness": 1'))
    with pytest.raises(ValueError, match="--predict: saved 'last', now 'none'"):
        as_is = dataclasses.replace(saved, parallel="ddp", staleness=1, predict="none")
        validate(as_is, data, world_size=2, columns=COLUMNS)
    # a stale run from before weight prediction (no "predict" saved) resumes only without it
    text = config.read_text().replace('"predict": "last",', "")
    config.write_text(text.replace('"nodes": 2', '"nodes": null'))
    assert '"predict"' not in config.read_text()
    with pytest.raises(ValueError, match="from before weight prediction.*--predict none"):
        validate(
            dataclasses.replace(saved, parallel="ddp", staleness=1),
            data,
            world_size=2,
            columns=COLUMNS,
        )
    validate(as_is, data, world_size=2, columns=COLUMNS)
    unchecked = {"data", "tokenizer", "nodes", "staleness", "stale_bound", "stale_after"}
    unchecked |= {"adaptive_every", "adaptive_per_parameter", "predict", "error_feedback"}
    unchecked |= {"adaptive_error", "grad_group_size", "grad_rounding", "ddp_bucket_mb"}
    unchecked |= {"gather_ahead"}  # (refused on resume in test_trainer's gather-ahead test)
    assert set(CHANGED) | unchecked == set(RESUME_MUST_MATCH) & set(
        f.name for f in dataclasses.fields(TrainConfig)
    )


def test_resume_without_a_checkpoint_is_refused(files, tmp_path, no_spawn):
    message = _refused(["--out", str(tmp_path), "--data", str(files["txt"]), *FLAGS, "--resume"])
    assert "--resume: no finished checkpoint" in message, message
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_file_is_one_clean_error(files, tmp_path, no_spawn):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    message = _refused(["--out", str(out), "--data", str(files["txt"]), *FLAGS])
    assert f"--out {out} is a file, not a run directory; choose another --out" in message
    assert out.read_text() == "mine"


def test_too_short_data_is_refused_before_any_worker_starts(files, tmp_path, no_spawn):
    argv = ["--out", str(tmp_path / "run"), "--data", str(files["txt"]), *FLAGS]
    message = _refused([*argv, "--block-size", "100000"])
    assert "too short for block_size=100000, which needs at least 100001" in message, message
    assert "--block-size" in message and not (tmp_path / "run").exists()


class _FailsOnRankOne(TrainConfig):
    """Settings whose ``grad_clip`` raises on rank 1 once the launching process has set
    ``QSDP_TEST_FAIL=1``: a failure inside a worker, mid-step."""

    def __getattribute__(self, name: str):
        if name == "grad_clip" and os.environ.get("RANK") == "1" == os.environ.get(
            "QSDP_TEST_FAIL"
        ):
            raise RuntimeError("injected failure on rank 1")
        return super().__getattribute__(name)


def _launch_failing_on_rank_one(out: str, data: str) -> None:
    """In a fresh interpreter (see the test): the launch's one line on stdout."""
    from multiprocessing import forkserver

    # the workers' server started first: the failure is asked for after it, so a worker sees
    # it only if it takes the launching process's environment as at the launch
    multiprocessing.get_context("forkserver").set_forkserver_preload(launch_module._PRELOAD)
    forkserver.ensure_running()
    os.environ["QSDP_TEST_FAIL"] = "1"
    cfg = _FailsOnRankOne(out=out, data=data, **SETTINGS)
    try:
        launch(cfg, nproc=2)
    except TrainError as e:
        assert e.rank == 1 and "injected failure" in e.tracebacks[1], e.tracebacks
        print(e)


def test_a_failing_worker_is_reported_in_one_line(files, tmp_path):
    # In a fresh interpreter: the workers write to the stderr of the process that started
    # their server ([Note: the workers fork from a server]), which in this pytest process may
    # be an earlier test's, where no capture of this test would see a trace.
    env = os.environ | {"QSDP_DATA_DIR": str(files["root"] / "cache"), "OMP_NUM_THREADS": "1"}
    code = (
        "from tests.train.test_rundir import _launch_failing_on_rank_one as f; "
        f"f({str(tmp_path / 'run')!r}, {str(files['txt'])!r})"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "qsdp train: RuntimeError: injected failure on rank 1 (rank 1)\n"
    # neither the failing worker nor its peer (whose collective lost rank 1) printed a trace
    assert "Traceback" not in done.stderr and "Connection closed" not in done.stderr, done.stderr


def _worker_outcome(rank: int, results, how: str) -> None:
    # What _local_worker sends: (rank, False, one-line message, traceback), then exit code 1.
    if rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        results.put((1, False, "ValueError-like cause", "traceback of rank 1"))
        raise SystemExit(1)
    time.sleep(0.5)  # rank 0's collective fails once rank 1 has left
    results.put((0, False, "RuntimeError: Connection closed by peer", "traceback of rank 0"))
    raise SystemExit(1)


@pytest.mark.parametrize(
    "how, message",
    [
        ("raises", "qsdp train: ValueError-like cause (rank 1)"),
        ("killed", "qsdp train: rank 1 died with exit code -9 before reporting an error (SIGKILL"),
    ],
)
def test_the_cause_is_named_not_the_peer_it_took_down(how, message):
    ctx = multiprocessing.get_context("forkserver")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker_outcome, args=(r, results, how)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        with pytest.raises(TrainError) as e:
            launch_module._collect(procs, results)
    finally:
        for p in procs:
            p.join()
    assert str(e.value).startswith(message), str(e.value)
    assert e.value.rank == 1 and "traceback of rank 0" in e.value.tracebacks[0]


def _training_two_steps_in(files, out: Path) -> subprocess.Popen:
    """``qsdp train`` of 5000 steps into ``out``, in a session of its own, once it has logged
    two steps (a stop request then has a run to save)."""
    env = os.environ | {"QSDP_DATA_DIR": str(files["root"] / "cache"), "OMP_NUM_THREADS": "1"}
    argv = ["--out", str(out), "--data", str(files["txt"]), *FLAGS, "--steps", "5000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "qsdp_train", "train", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.csv"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break  # two steps logged
        time.sleep(0.05)
    if proc.poll() is not None:
        raise AssertionError(proc.communicate())
    return proc


@pytest.mark.parametrize("to", ["launcher", "group"])
def test_ctrl_c_saves_the_last_step_and_says_how_to_resume(files, tmp_path, to):
    # a real SIGINT: to the launcher alone (kill -INT), or to its process group as a terminal's
    # Ctrl-C does (the launcher and its workers)
    out = tmp_path / "run"
    proc = _training_two_steps_in(files, out)
    try:
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    latest = (out / "ckpt" / "latest").read_text()
    step = int(latest.removeprefix("step_"))
    assert last == (
        f"qsdp train: interrupted after step {step} of 5000; saved {out / 'ckpt' / latest}; "
        f"resume with: qsdp train --out {out} --resume"
    ), err
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert step >= 2 and [r.split(",")[0] for r in rows] == [str(i) for i in range(step)]


def test_a_run_with_no_checkpoint_does_not_block_a_new_one(run, files):
    # what a run killed before its first checkpoint leaves: settings and rows, no ckpt/latest
    shutil.rmtree(run / "ckpt")
    (run / "ckpt" / "step_0000001").mkdir(parents=True)  # a save that never finished
    cfg = TrainConfig(out=str(run), data=str(files["txt"]), **SETTINGS)
    validate(cfg, open_data(files["data"]), world_size=2, columns=COLUMNS)  # not refused
    with pytest.raises(FileNotFoundError, match="run without --resume to start afresh in"):
        validate(
            dataclasses.replace(cfg, resume=True),
            open_data(files["data"]),
            world_size=2,
            columns=COLUMNS,
        )
    run_distributed(_stopped_run, 2, str(files["data"]), str(files["txt"]), str(run))
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["latest", "step_0000002"]
    rows = (run / "metrics.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == ["0", "1"]


def test_sigterm_saves_the_last_step_like_ctrl_c(files, tmp_path):
    # a scheduler's preemption: SIGTERM to the launcher alone; the run stops after a step every
    # rank agrees on, saves it, and exits 143 (128 + SIGTERM) with the same one line
    out = tmp_path / "run"
    proc = _training_two_steps_in(files, out)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    latest = (out / "ckpt" / "latest").read_text()
    step = int(latest.removeprefix("step_"))
    assert err.strip().splitlines()[-1] == (
        f"qsdp train: terminated (SIGTERM) after step {step} of 5000; saved "
        f"{out / 'ckpt' / latest}; resume with: qsdp train --out {out} --resume"
    ), err
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert step >= 2 and [r.split(",")[0] for r in rows] == [str(i) for i in range(step)]


def test_ctrl_c_before_any_worker_starts_is_one_line(files, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as while the data is prepared, before any worker starts

    monkeypatch.setattr("qsdp_train.train_cli.launch", interrupted)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_main(["--out", str(out), "--data", str(files["txt"]), *FLAGS])
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err == f"qsdp train: interrupted before training started; {out} was not written\n"


def test_a_ctrl_c_that_could_not_save_says_so(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(launch_module.Interrupted) as e:  # a second Ctrl-C, nothing saved yet
        launch_module._raise_interrupted({}, 2, out, finished=False)
    assert str(e.value) == (
        "interrupted: a second Ctrl-C stopped the workers mid-step; no checkpoint was saved"
    )
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "latest").write_text("step_0000004")
    stopped = {0: (6, str(out / "ckpt" / "step_0000006"), "saved"), 1: (7, "x", "saved")}
    with pytest.raises(launch_module.Interrupted) as e:  # ranks that disagree: no new save
        launch_module._raise_interrupted(stopped, 1, out, finished=False)
    assert str(e.value) == (
        "interrupted: the workers stopped before they could agree on a step to save; the last "
        f"checkpoint is {out / 'ckpt' / 'step_0000004'}"
    )
    assert e.value.checkpoint is None
    launch_module._raise_interrupted({}, 1, out, finished=True)  # the run had finished: no error
