"""benchmarks/bench_fsdp_step.py --loop-steps: steps back to back, one synchronisation at the end,
beside the steps timed one by one (CPU: --device cpu --tiny, 2 gloo processes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from .bench_scripts import ROOT


def _bench(out: Path, *extra: str) -> tuple[dict, str]:
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "benchmarks/bench_fsdp_step.py",
           "--regime", "nvlink", "--device", "cpu", "--tiny", "--baselines", "bf16",
           "--recipes", "qsdp-w8g8+s1", "--steps", "2", "--warmup", "1",
           "--out", str(out), *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {r["variant"]: r for r in json.loads(out.read_text())["rows"]}, done.stdout


def test_loop_steps_time_every_variant_back_to_back(tmp_path):
    prof = tmp_path / "prof"
    rows, log = _bench(
        tmp_path / "loop.json", "--loop-steps", "3", "--profile", str(prof), "--mem-trace"
    )
    # (a baseline and a recipe at staleness 1, whose reductions a loop overlaps)
    assert set(rows) == {"fsdp2-bf16-reduce", "qsdp-w8g8+s1"}
    for r in rows.values():
        assert r["loop_s_per_step"] is not None and r["loop_s_per_step"] > 0, r
        assert math.isfinite(r["loop_s_per_step"])
        # the same program as the timed steps, a few in a row: within 20x of their median on
        # this shared CPU (a unit error, seconds for milliseconds, is 1000x)
        assert r["s_per_step"] / 20 < r["loop_s_per_step"] < 20 * r["s_per_step"], r
    # with --profile the loop runs once more, profiled: its tables and trace beside the step's
    for v in ("qsdp-w8g8_s1",):
        text = (prof / f"nvlink_{v}_loop.txt").read_text()
        assert "3 steps back to back" in text and "qsdp::reduce-scatter" in text, text[:500]
        assert (prof / f"nvlink_{v}_loop.txt.trace.json.gz").stat().st_size > 0
        assert (prof / f"nvlink_{v}.txt").exists()  # the profiled step's, as before
    # each variant's model is gone before the next is built (session 39: the benchmark had
    # collected inside its run, whose locals kept FSDP2's cycles, and every GPU variant began
    # with the last one's model allocated)
    for v in rows:
        assert f"  {v}: model freed after the run and a collection" in log, log[-2000:]
    # (off by default: tests/test_before_after.py's runs have no loop_s_per_step)
