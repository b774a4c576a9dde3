"""``qsdp carry-data``: a prepared corpus cut into checked parts small enough to travel.

[Note: a corpus across device calls]
The GPU machines have no network, and a device call carries at most 64 MiB of working tree,
the repository's ~19 MiB of tracked files included, where debian-large's train split is 927 MB
of tokens (issue 34 needs >= 250 M of them: 500 MB). ``pack`` writes a prepared directory
(``qsdp prepare-data``'s ``train.bin``, ``val.bin``, ``meta.json``) as one xz-compressed tar
stream (GPT-2 tokens of source and manuals: 3.8-6.7x at xz's preset 6) cut into numbered parts
of at most ``part_mib`` MiB (40 by default, the room the repository leaves), and a
``manifest.json`` holding each part's size and sha256 and each file's size and sha256. The
parts go over in successive calls of one held machine (docs/data.md, "On the GPU machines"):
each call carries the parts folder with the part of its turn and its command moves it out of
the working tree onto the machine's own disk (which lasts while the machine is held); the last
call runs ``unpack``, which checks every part before it reads any,
rebuilds the directory and checks every file against the manifest, so a part lost, cut short or
carried twice is named, never trained on. The tar stream keeps no owner, time or mode beyond
the files' bytes, so two packs of one directory are the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["pack", "unpack"]

MANIFEST = "manifest.json"
_FORMAT = "qsdp carried corpus 1"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Parts(io.RawIOBase):
    """A write-only stream that compresses what it is given (xz) into numbered part files of at
    most ``limit`` bytes each."""

    def __init__(self, out: Path, limit: int, preset: int) -> None:
        self.out, self.limit = out, limit
        self._xz = lzma.LZMACompressor(format=lzma.FORMAT_XZ, preset=preset)
        self._file: io.BufferedWriter | None = None
        self._room = 0
        self.parts: list[Path] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._emit(self._xz.compress(bytes(data)))
        return len(data)

    def finish(self) -> None:
        self._emit(self._xz.flush())
        if self._file is not None:
            self._file.close()
            self._file = None

    def _emit(self, data: bytes) -> None:
        while data:
            if self._file is None or self._room == 0:
                if self._file is not None:
                    self._file.close()
                path = self.out / f"part{len(self.parts):03d}.xz"
                self.parts.append(path)
                self._file, self._room = path.open("wb"), self.limit
            take = data[: self._room]
            self._file.write(take)
            self._room -= len(take)
            data = data[len(take) :]


def pack(src: Path, out: Path, *, part_mib: float = 40, preset: int = 6) -> dict:
    """Pack the prepared directory ``src`` into ``out`` ([Note: a corpus across device calls]).

    Args:
        src: a directory of regular files (``qsdp prepare-data``'s output).
        out: the parts' folder: created, and it must hold no parts or manifest already.
        part_mib: the largest part, in MiB (under the 64 MiB a call carries, with room for the
            rest of the working tree).
        preset: the xz preset (0-9).

    Returns:
        The manifest (also written to ``out/manifest.json``).
    """
    src, out = Path(src), Path(out)
    files = sorted(p for p in src.iterdir() if p.is_file()) if src.is_dir() else []
    if not files:
        raise ValueError(f"{src}: no files to pack (pass a directory qsdp prepare-data made)")
    if not 0 < part_mib <= 64:
        raise ValueError(f"part_mib={part_mib!r} must be in (0, 64]: a call carries 64 MiB at most")
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.iterdir() if p.name == MANIFEST or p.suffix == ".xz")
    if stale:
        raise ValueError(f"{out} holds {stale[:3]} already: pack into an empty folder")
    t0 = time.monotonic()
    sink = _Parts(out, int(part_mib * 2**20), preset)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(path.name)
            info.size, info.mode = path.stat().st_size, 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    sink.finish()
    manifest = {
        "format": _FORMAT,
        "source": src.name,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        "parts": [
            {"name": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sink.parts
        ],
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


class _Joined(io.RawIOBase):
    """The parts read one after another as one stream."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths: Iterator[Path] = iter(paths)
        self._file: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                path = next(self._paths, None)
                if path is None:
                    return 0
                self._file = path.open("rb")
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None


def unpack(parts: Path, out: Path) -> Path:
    """Check and unpack the parts ``pack`` wrote into the directory ``out``.

    Every part is checked against the manifest (size, sha256) before any is read, every file
    after it is written; a mismatch raises naming the part or file, and leaves no file of a
    failed unpack in ``out`` under its final name.

    Returns:
        ``out``, holding the packed directory's files.
    """
    parts, out = Path(parts), Path(out)
    path = parts / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest (pack with qsdp carry-data pack)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != _FORMAT:
        raise ValueError(f"{path}: not a qsdp carried corpus (format {manifest.get('format')!r})")
    names = {p["name"] for p in manifest["parts"]}
    extra = sorted(p.name for p in parts.glob("part*.xz") if p.name not in names)
    if extra:
        raise ValueError(f"{parts}: parts {extra} are not in the manifest: another pack's?")
    for want in manifest["parts"]:
        p = parts / want["name"]
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing ({len(names)} parts in the manifest)")
        if p.stat().st_size != want["bytes"] or _sha256(p) != want["sha256"]:
            raise ValueError(f"{p}: size or sha256 differs from the manifest (cut short?)")
    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, Path]] = []
    try:
        _extract(parts, manifest, out, written)
    except BaseException:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in written:
        tmp.replace(final)
    return out


def _extract(parts: Path, manifest: dict, out: Path, written: list[tuple[Path, Path]]) -> None:
    """The stream's files into ``out`` under temporary names (``(temporary, final)`` appended to
    ``written`` as each is opened), each checked against the manifest; raises at the first that
    differs, or if one is missing."""
    stream = lzma.LZMAFile(_Joined([parts / p["name"] for p in manifest["parts"]]))
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            want = manifest["files"].get(member.name)
            if want is None or not member.isfile() or "/" in member.name:
                raise ValueError(f"{parts}: the stream holds {member.name!r}, not in the manifest")
            tmp = out / f".{member.name}.part"
            written.append((tmp, out / member.name))
            with tar.extractfile(member) as f, tmp.open("wb") as g:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    g.write(block)
            if tmp.stat().st_size != want["bytes"] or _sha256(tmp) != want["sha256"]:
                raise ValueError(f"{member.name}: its bytes differ from the manifest's sha256")
    missing = sorted(set(manifest["files"]) - {final.name for _, final in written})
    if missing:
        raise ValueError(f"{parts}: the stream ends without {missing}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsdp carry-data",
        description="Cut a prepared corpus into checked parts that fit a device call, and put "
        "it back together there ([Note: a corpus across device calls] in qsdp_train/carry.py).",
    )
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("pack", help="a prepared directory -> parts and manifest.json")
    a.add_argument("src", type=Path, help="what qsdp prepare-data printed")
    a.add_argument("out", type=Path, help="the parts' folder (new or empty)")
    a.add_argument("--part-mib", type=float, default=40, help="largest part, MiB (default 40)")
    a.add_argument("--preset", type=int, default=6, choices=range(10), help="xz preset")
    b = sub.add_parser("unpack", help="parts and manifest.json -> the prepared directory")
    b.add_argument("parts", type=Path)
    b.add_argument("out", type=Path, help="the directory to write (qsdp train --data takes it)")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        if a.what == "pack":
            m = pack(a.src, a.out, part_mib=a.part_mib, preset=a.preset)
            size = sum(p["bytes"] for p in m["parts"])
            whole = sum(f["bytes"] for f in m["files"].values())
            print(
                f"{a.out}: {len(m['parts'])} parts, {size / 2**20:.1f} MiB of {whole / 2**20:.1f}"
                f" MiB ({time.monotonic() - t0:.1f} s)"
            )
        else:
            print(unpack(a.parts, a.out))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"qsdp carry-data: {e}")
