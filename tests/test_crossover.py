"""benchmarks/crossover.py: the link's bus bandwidth, each recipe's speed-up and where it
crosses 1, from hand-made result files whose every figure is known."""

from __future__ import annotations

import json
import math

import pytest

from .bench_scripts import load

cx = load("crossover")


def _write(folder, tag: str, nccl_ms: float, plain: float, recipes: dict[str, float]) -> None:
    link = {
        "rows": [
            {
                "collective": "all_gather",
                "dtype": "bfloat16",
                "size_mib": 256,
                "world_size": 4,
                "nccl_ms": nccl_ms,
            }
        ]
    }
    (folder / f"link_{tag}.json").write_text(json.dumps(link))
    rows = [{"variant": "fsdp2-bf16-reduce", "s_per_step": plain}]
    rows += [{"variant": v, "s_per_step": s} for v, s in recipes.items()]
    step = {"device": "NVIDIA H200", "world_size": 4, "date": "2026-11-28T00:00:00", "rows": rows}
    (folder / f"step_{tag}.json").write_text(json.dumps(step))


def test_bandwidth_speedup_and_crossover(tmp_path):
    # 256 MiB * 3/4 in 201.3 ms = 1.0 GB/s; in 2.013 ms = 100 GB/s
    ms_1 = 256 * 2**20 * 0.75 / 1e9 * 1e3
    _write(tmp_path, "socket_1x1", ms_1, 2.0, {"a": 0.5, "b": 4.0})
    _write(tmp_path, "nvlink", ms_1 / 100, 0.2, {"a": 0.4, "b": 0.4})
    rows = cx.load(tmp_path)
    by = {(r["setting"], r["variant"]): r for r in rows}
    assert by["socket_1x1", "a"]["bus_gbps"] == pytest.approx(1.0, rel=1e-3)
    assert by["nvlink", "a"]["bus_gbps"] == pytest.approx(100.0, rel=1e-3)
    assert by["socket_1x1", "a"]["speedup"] == 4.0 and by["nvlink", "a"]["speedup"] == 0.5
    # a: 4x at 1 GB/s, 0.5x at 100: log-linear, crosses at t = 3/3.5 of the way in log(bw)
    c = cx.crossover([(1.0, 4.0), (100.0, 0.5)])
    assert c == pytest.approx(math.exp(math.log(100) * 3 / 3.5))
    assert cx.crossover([(1.0, 0.5), (100.0, 0.5)]) == "below every setting"
    assert cx.crossover([(1.0, 1.5), (100.0, 1.0)]) == "above every setting"


def test_main_writes_table_csv_and_svg(tmp_path, monkeypatch):
    ms_1 = 256 * 2**20 * 0.75 / 1e9 * 1e3
    _write(tmp_path, "socket_1x1", ms_1, 2.0, {"sdp4bit": 0.5})
    _write(tmp_path, "nvlink", ms_1 / 100, 0.2, {"sdp4bit": 0.4})
    svg = tmp_path / "plot.svg"
    monkeypatch.setattr("sys.argv", ["crossover.py", str(tmp_path), "--svg", str(svg)])
    cx.main()
    md = (tmp_path / "crossover.md").read_text()
    assert "| socket_1x1 | 1.00 | 2.000 | 0.500 (x4.00) |" in md
    assert "`sdp4bit` pays below 51.8 GB/s" in md  # exp(ln 100 * 3 / 3.5)
    assert (tmp_path / "crossover.csv").read_text().count("\n") == 5  # header + 4 rows
    assert svg.read_text().lstrip().startswith("<?xml")


def test_missing_link_file_is_named(tmp_path):
    _write(tmp_path, "nvlink", 1.0, 0.2, {"a": 0.4})
    (tmp_path / "link_nvlink.json").unlink()
    with pytest.raises(FileNotFoundError, match="link_nvlink.json"):
        cx.load(tmp_path)
