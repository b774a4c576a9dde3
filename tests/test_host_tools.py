"""benchmarks/host_sampled.py, host_primitives.py and host_per_bucket.py: the host-time tools of
issue 32. Their timings are not asserted (benchmarks measure, tests check); what they report
is."""

from __future__ import annotations

import json
import subprocess
import sys

from .bench_scripts import ROOT, load

ENV = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}

RAW = """\
<module> (x.py:1);setup (x.py:9) 100
<module> (x.py:1);timed_loop (benchmarks/host_sampled.py:50);step (b.py:2);call (src/qsdp/comm/_common.py:82);all_to_all_single (torch/c10d.py:5) 30
<module> (x.py:1);timed_loop (benchmarks/host_sampled.py:50);step (b.py:2);call (src/qsdp/comm/_common.py:83) 10
<module> (x.py:1);timed_loop (benchmarks/host_sampled.py:50);step (b.py:2);forward (torch/nn.py:3) 60
"""  # noqa: E501


def test_sampled_summary_counts_the_timed_loop_only(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(RAW)
    cmd = [sys.executable, "benchmarks/host_sampled.py", "summarize", str(raw)]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, capture_output=True, text=True)
    text = out.stdout
    assert text.startswith("100 samples in the timed loop")  # setup's 100 left out
    assert "  40.0%  call (src/qsdp/comm/_common.py)" in text  # inclusive, both lines
    assert "  30.0%  all_to_all_single (torch/c10d.py)" in text  # own
    assert "qsdp lines, with what they issued: 40.0% in all" in text
    assert "  30.0%  call (src/qsdp/comm/_common.py:82)" in text  # the line, with its C call
    assert "  10.0%  call (src/qsdp/comm/_common.py:83)" in text
    bad = subprocess.run(cmd + ["--loop", "nowhere"], cwd=ROOT, env=ENV, capture_output=True)
    assert bad.returncode != 0 and b"no stack holds a frame with 'nowhere'" in bad.stderr


def test_sampled_run_steps_a_recipe_synchronous_and_at_staleness_1():
    """``--staleness 1``, or a ``host_per_step.py`` variant name (``sdp4bit+s1``: its optimizer
    made) over the 2 x 2 mesh."""
    for recipe, extra in (("cgx", []), ("cgx", ["--staleness", "1"]), ("sdp4bit+s1", ["--mesh"])):
        cmd = [sys.executable, "benchmarks/host_sampled.py", "run", "--recipe", recipe,
               "--steps", "3", "--blocks", "2", *extra]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, capture_output=True, text=True)
        name, ms, unit = out.stdout.split()[:3]
        assert name == recipe and float(ms) > 0 and unit == "ms"


def test_primitives_price_each_piece_on_the_cpu(tmp_path):
    out = tmp_path / "p.json"
    cmd = [sys.executable, "benchmarks/host_primitives.py", "--out", str(out), "--calls", "20",
           "--rounds", "1"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    d = json.loads(out.read_text())
    assert d["device"] == "cpu" and d["world_size"] == 1
    rows = d["us_per_call"]
    for name in ("tensor.view(-1)", "torch.empty (256 KiB)", "qsdp.quant.encode (64 Ki elements)"):
        assert rows[name] > 0, name
    assert not any(k.startswith("triton launch") or "stream" in k for k in rows)  # GPU only


def test_per_bucket_over_a_mesh_takes_the_two_level_path(tmp_path):
    """``--mesh 2x2``: sdp4bit's reduce-scatter is the two-level one (its two hops and the
    raw part's reduce-scatter: 3 torch.distributed calls, the NaN/Inf verdict's all-reduce
    aside, which the plan leaves to the integration); a one-level recipe's stays one level."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, "benchmarks/host_per_bucket.py", "--collective", "reduce_scatter",
           "--recipes", "sdp4bit", "qsdp-w8g8", "--calls", "3", "--out", str(out),
           "--mesh", "2x2"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["mesh"] == "2x2" for r in rows.values())
    assert rows["sdp4bit"]["collectives"] == {
        "hierarchical_reduce_scatter": {"calls": 1, "dist_calls": 3}
    }, rows["sdp4bit"]
    assert list(rows["qsdp-w8g8"]["collectives"]) == ["reduce_scatter"], rows["qsdp-w8g8"]
    bad = [sys.executable, "benchmarks/host_per_bucket.py", "--mesh", "2x2", "--out", "x.json"]
    res = subprocess.run(bad, cwd=ROOT, env=ENV, capture_output=True, timeout=120)
    assert res.returncode != 0 and b"--mesh 2x2 times --collective reduce_scatter" in res.stderr


def _fr(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_memory_peak_replays_to_the_highest_point_and_charges_the_right_lines():
    mp = load("memory_peak")
    qsdp_line = [_fr("/x/torch/ops.py", 1, "empty"), _fr("/x/src/qsdp/fsdp/_reduce.py", 7, "h")]
    fsdp_line = [_fr("/x/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", 3, "alloc")]
    model_line = [_fr("/x/torch/optim/adamw.py", 9, "step"), _fr("/x/benchmarks/b.py", 5, "run")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": qsdp_line},
        {"action": "alloc", "addr": 2, "size": 50, "frames": fsdp_line},
        {"action": "free_completed", "addr": 99, "size": 30},  # allocated before recording
        {"action": "free_requested", "addr": 1, "size": 100},  # held for a stream still
        {"action": "alloc", "addr": 3, "size": 40, "frames": model_line},  # the peak: 1000+160
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_requested", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 4, "size": 60, "frames": model_line},  # 1070: lower
    ]
    peak = mp.at_peak(trace, before=1000)
    assert (peak.bytes, peak.index) == (1160, 4)
    assert peak.held == {
        mp.BEFORE: (970, 0),
        "qsdp/fsdp/_reduce.py:7 h  [freed, held for a stream]": (100, 1),
        "torch/distributed/fsdp/_fully_shard/_fsdp_param.py:3 alloc": (50, 1),
        "benchmarks/b.py:5 run": (40, 1),
    }
    assert sum(b for b, _ in peak.held.values()) == peak.bytes
    assert "1 more lines" in peak.table(top=3)
