"""Writing nanoGPT token directories: atomic token files and the ``meta.json`` commit marker.

Every file is written to a temporary name in its directory and moved into place with
``os.replace``; ``meta.json`` goes last and is the commit marker (see [Note: the prepared format]
in ``data.py``). A directory is prepared when its ``meta.json`` has this ``FORMAT_VERSION``, the
caller's key, and split sizes that match the ``.bin`` files.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DTYPE",
    "FORMAT_VERSION",
    "commit",
    "is_prepared",
    "link",
    "read_meta",
    "remove_stale_tmp",
    "tmp_name",
    "write_meta",
    "write_tokens",
]

FORMAT_VERSION = 1
DTYPE = np.dtype("<u2")


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")


def remove_stale_tmp(path: Path) -> int:
    """Delete the temporary files of ``path`` (see :func:`tmp_name`) whose writer is gone.

    A writer killed outright (SIGKILL, out of memory, a lost machine) cannot remove its partial
    file, and one package's can be hundreds of MB. A file whose process id no longer runs on this
    machine is removed; a live writer's (two preparers at once) is kept. A cache shared between
    machines would see other hosts' process ids, so only one machine should build into it at once.

    Returns:
        The bytes removed.
    """
    freed = 0
    for tmp in path.parent.glob(f".{path.name}.*.*.tmp"):
        pid = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            size = tmp.stat().st_size
            tmp.unlink()
        except FileNotFoundError:
            continue
        freed += size
    return freed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_tokens(path: Path, chunks: Iterable[np.ndarray]) -> int:
    """Write integer token arrays to ``path`` as uint16, atomically; returns the token count."""
    tmp, n = tmp_name(path), 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                if chunk.size and (int(chunk.max()) >= 65536 or int(chunk.min()) < 0):
                    bad = int(chunk.max()) if int(chunk.max()) >= 65536 else int(chunk.min())
                    raise ValueError(
                        f"token id {bad} cannot be stored as uint16 (0..65535) in {path.name}; "
                        "the nanoGPT format holds vocabularies of at most 65536 tokens"
                    )
                f.write(np.ascontiguousarray(chunk, dtype=DTYPE).tobytes())
                n += chunk.size
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def write_meta(out: Path, meta: dict[str, Any]) -> None:
    tmp = tmp_name(out / "meta.json")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out / "meta.json")


def link(out: Path, name: str, target: Path) -> None:
    tmp = tmp_name(out / name)
    os.symlink(target, tmp)
    os.replace(tmp, out / name)


def commit(out: Path, key: dict[str, Any], splits: dict[str, Any], **fields: Any) -> Path:
    meta = {"format_version": FORMAT_VERSION, "key": key, "dtype": "uint16", **fields}
    write_meta(out, {**meta, "splits": splits})
    return out


def read_meta(out: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def is_prepared(out: Path, key: dict[str, Any]) -> bool:
    meta = read_meta(out)
    if meta is None or meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
        return False
    try:
        return all(
            (out / f"{s}.bin").stat().st_size == 2 * meta["splits"][s]["tokens"]
            for s in ("train", "val")
        )
    except (OSError, KeyError, TypeError):
        return False
