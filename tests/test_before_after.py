"""benchmarks/run_before_after.sh: a commit's code beside the working tree's in one run, on the
CPU (bench_fsdp_step.py --device cpu --tiny, one gloo process a side: the script's alternation,
code and profiles are what is tested; the benchmark's ranks are tests/test_bench_loop.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .bench_scripts import ROOT

ARGS = ["--regime", "nvlink", "--device", "cpu", "--tiny", "--recipes", "qsdp-w8g8",
        "--baselines", "bf16", "--steps", "2", "--warmup", "1", "--profile", "@/prof"]  # fmt: skip


def _run(tmp: Path, *args: str, rounds: int = 1, **env: str) -> subprocess.CompletedProcess:
    """The script with ``args``, its results under ``tmp``; ``env`` added to (or replacing
    entries of) the environment."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # torchrun, python
    env = dict(os.environ, RESULTS_DIR=str(tmp), NPROC="1", ROUNDS=str(rounds),
               OMP_NUM_THREADS="1", PATH=path) | env  # fmt: skip
    cmd = ["bash", "benchmarks/run_before_after.sh", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_both_sides_run_with_their_own_code(tmp_path):
    done = _run(tmp_path, "HEAD", "bench_fsdp_step.py", *ARGS)
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split(" round ")[0] for line in done.stdout.splitlines()]
    assert order == ["before", "after"], done.stdout
    losses = set()
    for side in ("before_1", "after_1"):
        d = json.loads((tmp_path / side / "result.json").read_text())
        rows = {r["variant"]: r for r in d["rows"]}
        assert set(rows) == {"fsdp2-bf16-reduce", "qsdp-w8g8"}
        # (bench_fsdp_step times its steps back to back only when asked: --loop-steps)
        assert all(r["loop_s_per_step"] is None for r in rows.values()), rows
        losses.add(tuple(r["last_loss"] for r in d["rows"]))
        prof = tmp_path / side / "prof"
        assert not list(prof.glob("*.trace.json.gz"))  # summarized, then deleted
        assert list(prof.glob("*.streams.txt"))
    assert len(losses) == 1  # HEAD's code and the tree's train alike


#: Stands in for torchrun in the rounds test: notes which code (PYTHONPATH) ran which side
#: (its --out) and writes that side's result.
_TORCHRUN = """#!/usr/bin/env bash
out=""; prev=""
for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
echo "$PYTHONPATH $out" >> "$LOG"
echo '{"rows": []}' > "$out"
"""


def test_rounds_alternate_which_side_goes_first(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    log = tmp_path / "log.txt"
    done = _run(tmp_path / "r", "HEAD", "bench_fsdp_step.py", "--steps", "1", rounds=3,
                LOG=str(log), PATH=f"{bin_dir}:{os.environ['PATH']}")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split(" (")[0] for line in done.stdout.splitlines()]
    assert order == [f"{s} round {r}" for r, s in [(1, "before"), (1, "after"), (2, "after"),
                     (2, "before"), (3, "before"), (3, "after")]], done.stdout  # fmt: skip
    ran = [line.split() for line in log.read_text().splitlines()]
    for (code, out), line in zip(ran, done.stdout.splitlines(), strict=True):
        side = line.split(" round ")[0]
        # the commit's extracted src/ for "before", the tree's for "after"; --out in the side's
        # own folder (the default, @/result.json)
        assert (code == "./src") == (side == "after"), (code, line)
        assert out == str(tmp_path / "r" / f"{side}_{line.split()[2]}" / "result.json"), out


def test_refuses_what_it_cannot_run(tmp_path):
    bad = _run(tmp_path, "no-such-rev", "bench_fsdp_step.py")
    assert bad.returncode == 2 and "no-such-rev is not a commit" in bad.stderr
    bad = _run(tmp_path, "HEAD", "no_such_bench.py")
    assert bad.returncode == 2 and "no benchmarks/no_such_bench.py" in bad.stderr
