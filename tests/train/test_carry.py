"""``qsdp carry-data``: a prepared corpus in parts that fit a device call, and back ([Note: a
corpus across device calls] in ``qsdp_train/carry.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qsdp_train.carry import MANIFEST, pack, unpack


def _prepared(root: Path) -> Path:
    """A directory shaped as ``qsdp prepare-data`` writes it: uint16 tokens and a meta.json."""
    d = root / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    # (repetitive, as text's tokens are, so xz has something to take)
    words = rng.integers(0, 50257, size=64, dtype=np.uint16)
    words[rng.integers(0, 64, size=300_000)].tofile(d / "train.bin")
    words[rng.integers(0, 64, size=7_001)].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    return d


def test_pack_cuts_checked_parts_and_unpack_gives_the_same_bytes(tmp_path):
    src = _prepared(tmp_path)
    m = pack(src, tmp_path / "parts", part_mib=64 / 1024)  # parts of 64 KiB
    sizes = [p["bytes"] for p in m["parts"]]
    assert (
        len(sizes) > 2 and max(sizes) <= 64 * 1024 and sizes[:-1] == [64 * 1024] * (len(sizes) - 1)
    )
    assert sum(sizes) < 0.5 * sum(f["bytes"] for f in m["files"].values())  # compressed
    out = unpack(tmp_path / "parts", tmp_path / "back")
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    # two packs of one directory are the same bytes (no times or owners in the stream)
    again = pack(src, tmp_path / "again", part_mib=64 / 1024)
    assert [p["sha256"] for p in again["parts"]] == [p["sha256"] for p in m["parts"]]


def test_a_part_missing_cut_short_or_foreign_is_named_before_anything_is_written(tmp_path):
    src = _prepared(tmp_path)
    pack(src, tmp_path / "parts", part_mib=64 / 1024)
    for case in ("missing", "short", "foreign"):
        parts = tmp_path / case
        shutil.copytree(tmp_path / "parts", parts)
        if case == "missing":
            (parts / "part001.xz").unlink()
            match = r"part001\.xz: missing"
        elif case == "short":
            data = (parts / "part002.xz").read_bytes()
            (parts / "part002.xz").write_bytes(data[:-10])
            match = r"part002\.xz: size or sha256 differs"
        else:
            shutil.copy(parts / "part000.xz", parts / "part999.xz")
            match = r"part999\.xz'\] are not in the manifest"
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            unpack(parts, tmp_path / f"out-{case}")
        assert not (tmp_path / f"out-{case}").exists()


def test_a_manifest_that_lies_about_a_file_leaves_nothing_under_its_name(tmp_path):
    src = _prepared(tmp_path)
    pack(src, tmp_path / "parts", part_mib=64 / 1024)
    m = json.loads((tmp_path / "parts" / MANIFEST).read_text())
    m["files"]["val.bin"]["sha256"] = "0" * 64
    (tmp_path / "parts" / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="val.bin: its bytes differ"):
        unpack(tmp_path / "parts", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # (train.bin, checked first, taken back too)


def test_bad_requests_are_refused_with_the_fix(tmp_path):
    src = _prepared(tmp_path)
    with pytest.raises(ValueError, match="a call carries 64 MiB at most"):
        pack(src, tmp_path / "p", part_mib=65)
    with pytest.raises(ValueError, match="no files to pack"):
        pack(tmp_path / "nowhere", tmp_path / "p")
    pack(src, tmp_path / "p", part_mib=1)
    with pytest.raises(ValueError, match="pack into an empty folder"):
        pack(src, tmp_path / "p", part_mib=1)
    with pytest.raises(FileNotFoundError, match="no manifest"):
        unpack(tmp_path, tmp_path / "o")


def test_the_command_packs_and_unpacks(tmp_path):
    src = _prepared(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    run = [sys.executable, "-m", "qsdp_train", "carry-data"]
    out = subprocess.run([*run, "pack", str(src), str(tmp_path / "parts"), "--part-mib", "0.25"],
                         env=env, check=True, capture_output=True, text=True)  # fmt: skip
    assert "parts," in out.stdout
    out = subprocess.run([*run, "unpack", str(tmp_path / "parts"), str(tmp_path / "back")],
                         env=env, check=True, capture_output=True, text=True)  # fmt: skip
    assert Path(out.stdout.strip()) == tmp_path / "back"
    assert (tmp_path / "back" / "train.bin").read_bytes() == (src / "train.bin").read_bytes()
    bad = subprocess.run([*run, "unpack", str(tmp_path), str(tmp_path / "x")], env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and "qsdp carry-data:" in bad.stderr and "no manifest" in bad.stderr
