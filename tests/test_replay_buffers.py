"""``benchmarks/replay_buffers.py``: the buffers ``Schedule(graphs=True)``'s replays hold, on
the CPU (the replays run eagerly on them, the kernels no-ops). Only the modules whose shapes
repeat replay ([Note: only repeated shapes replayed]): the root's buffers, about four blocks'
worth, are gone, and the blocks' one set is what is left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, *args: str) -> dict:
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'benchmarks'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/replay_buffers.py", "--d", "64", "--layers", "3",
           "--steps", "2",
           "--out", str(out), *args]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())


def test_the_root_no_longer_holds_replay_buffers(tmp_path):
    new = _run(tmp_path / "new.json")
    old = _run(tmp_path / "all.json", "--all-modules")
    assert new["params"] == old["params"] and new["root_params"] > 3 * new["block_params"]
    rs = {d["replayed_modules"]: [r["numel"] for r in d["rows"] if r["key"] == "reduce_scatter"]
          for d in (new, old)}  # fmt: skip
    # sdp4bit: a reduce-scatter of each module's gradient (its whole input: the key's length)
    # and a gather of its differences, a buffer set per shape: the root's and a block's
    # before, a block's alone now
    assert sorted(rs["all"]) == sorted([new["root_params"], new["block_params"]])
    assert rs["repeated shapes"] == [new["block_params"]]
    assert len(old["rows"]) == 4 and len(new["rows"]) == 2  # (the gathers from step 2 on)
    assert 0 < new["total_bytes"] < 0.3 * old["total_bytes"], (new["total_bytes"], old)
