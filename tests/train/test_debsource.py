"""Source trees as documents (debsource.py) and corpora mixing them with HTML manuals, on fake
``.deb`` files served from a ``file://`` mirror (no network)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from qsdp_train import corpora, debcorpus, debsource
from qsdp_train.data import prepare_data
from qsdp_train.debcorpus import DebCorpus
from qsdp_train.debdocs import DebPackage, fetch_deb
from qsdp_train.debpin import DocText, Skipped
from qsdp_train.debsource import DebSourceTree, file_text

from .debfiles import member, symlink, write_deb

TREE = "linux-source-9.9"
SCHED = "/* the scheduler */\nint pick_next_task(void)\n{\n\treturn 0;\n}\n" * 6
COLOR = "#!/bin/sh\n# ESC and DEL are text: \x1b[31m red \x1b[0m \x7f\n" + "echo ok\n" * 30
UNICODE = "// Grüße, 日本語 – UTF-8 text\n" + "int x;\n" * 40
README = "Linux kernel\n============\n\n" + "There are several guides for kernel developers. " * 8
# A tree with one file for each rule of [Note: a source tree as documents], in archive order.
FILES: list[tuple[str, bytes | None]] = [
    ("kernel/sched.c", SCHED.encode()),
    ("Documentation/admin.rst", b"Excluded: the HTML manual has it.\n" * 10),
    ("drivers/x/blob.bin", b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 300),
    ("drivers/x/latin1.c", b"/* caf\xe9 */\n" * 40),
    ("drivers/x/sep.c", b"int a;\n\x04" + b"int b;\n" * 40),
    ("drivers/x/fw.h", b"static const u8 fw[] = {\n" + b"0x12, 0xab, 0x00, 0xff,\n" * 40 + b"};"),
    ("drivers/x/big.c", b"/* big */\n" * 300),
    ("include/link.h", None),
    ("scripts/color.sh", COLOR.encode()),
    ("lib/\u00fc.c", UNICODE.encode()),
    ("tiny.c", b"int x;\n"),
    ("README", README.encode()),
]
KEPT = {
    "kernel/sched.c": SCHED,
    "scripts/color.sh": COLOR,
    "lib/\u00fc.c": UNICODE,
    "README": README,
}


def source_tarball(files: list[tuple[str, bytes | None]] = FILES) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        folder = tarfile.TarInfo(TREE)  # a folder: neither a document nor a skip
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, data in files:
            if data is None:
                symlink(tar, f"{TREE}/{name}", "../kernel/sched.c")
            else:
                member(tar, f"{TREE}/{name}", data)
    return buf.getvalue()


def deb_with(mirror: Path, name: str, members: dict[str, bytes]) -> tuple[str, str]:
    """A fake ``.deb`` in ``mirror`` holding ``members``; returns (pool path, sha256)."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for path, blob in members.items():
            member(tar, f"./{path}", blob)
    pool = f"pool/main/{name[0]}/{name}/{name}_1.0-1_all.deb"
    write_deb(mirror / pool, data.getvalue())
    return pool, hashlib.sha256((mirror / pool).read_bytes()).hexdigest()


def kernel_pin(mirror: Path, **kw) -> DebSourceTree:
    pool, sha = deb_with(
        mirror,
        TREE,
        {
            f"usr/share/doc/{TREE}/copyright": b"License: GPL-2\n",
            f"usr/src/{TREE}.tar.xz": source_tarball(),
        },
    )
    return DebSourceTree(
        name=TREE,
        version="1.0-1",
        pool_path=pool,
        sha256=sha,
        license="GPL-2",
        tarball=f"usr/src/{TREE}.tar.xz",
        root=TREE,
        exclude=r"^Documentation/",
        max_bytes=2048,
        **kw,
    )


def html_pin(mirror: Path) -> DebPackage:
    page = '<div role="main"><p>' + "A manual page of prose. " * 20 + "</p></div>"
    pool, sha = deb_with(mirror, "a-doc", {"usr/share/doc/a-doc/html/intro.html": page.encode()})
    return DebPackage(
        name="a-doc",
        version="1.0-1",
        pool_path=pool,
        sha256=sha,
        license="MIT",
        html_root="usr/share/doc/a-doc/html",
    )


@pytest.fixture
def mirror(tmp_path, monkeypatch) -> Path:
    mirror = tmp_path / "mirror"
    monkeypatch.setenv("QSDP_DEBIAN_MIRROR", mirror.as_uri())
    return mirror


def test_nested_tarball_documents_and_filters(mirror, tmp_path):
    pin = kernel_pin(mirror)
    got = list(pin.documents(fetch_deb(pin, tmp_path / "cache")))
    assert [(d.path, d.reason if isinstance(d, Skipped) else "text") for d in got] == [
        ("kernel/sched.c", "text"),
        ("Documentation/admin.rst", "excluded"),
        ("drivers/x/blob.bin", "binary"),
        ("drivers/x/latin1.c", "binary"),
        ("drivers/x/sep.c", "binary"),
        ("drivers/x/fw.h", "hex_data"),
        ("drivers/x/big.c", "too_large"),
        ("include/link.h", "links_skipped"),
        ("scripts/color.sh", "text"),
        ("lib/\u00fc.c", "text"),
        ("tiny.c", "text"),  # too small for a corpus, but that is the corpus' rule
        ("README", "text"),
    ]
    texts = {d.path: d.text for d in got if isinstance(d, DocText)}
    assert texts == {**KEPT, "tiny.c": "int x;\n"}  # exactly the files' text, nothing normalised
    assert {r for d in got if isinstance(d, Skipped) for r in [d.reason]} <= set(pin.skip_reasons)


def test_package_files_without_a_tarball(mirror, tmp_path):
    pod = "=head1 NAME\n\nperlintro - a brief introduction\n\n" + "=head2 Text\n\nProse. " * 20
    pool, sha = deb_with(
        mirror,
        "perl-doc",
        {
            "usr/share/perl/5.40.1/pod/perlintro.pod": pod.encode(),
            "usr/share/perl/5.40.1/pod/README.Debian": b"not a pod " * 40,
            "usr/share/doc/perl-doc/copyright": b"License: GPL-1+ or Artistic\n" * 10,
        },
    )
    pin = DebSourceTree(
        name="perl-doc",
        version="1.0-1",
        pool_path=pool,
        sha256=sha,
        license="GPL-1+ or Artistic",
        root="usr/share/perl/5.40.1/pod",
        include=r"\.pod$",
    )
    got = list(pin.documents(fetch_deb(pin, tmp_path / "cache")))
    assert got == [
        DocText(path="perlintro.pod", text=pod),
        Skipped(path="README.Debian", reason="excluded"),
    ]


def test_file_text_rules():
    assert file_text(b"a\tb\nc\x0b\x0c\r\x1b[0m\x7f", max_hex_fraction=0.5) == (
        "a\tb\nc\x0b\x0c\r\x1b[0m\x7f",
        "",
    )
    for ctl in (0x00, 0x04, 0x08, 0x0E, 0x1A, 0x1C, 0x1F):
        assert file_text(b"text" + bytes([ctl]), max_hex_fraction=0.5) == (None, "binary"), ctl
    assert file_text(b"caf\xe9", max_hex_fraction=0.5) == (None, "binary")
    assert file_text(b"", max_hex_fraction=0.5) == ("", "")
    # 0x1234 is 6 of 12 bytes: exactly the limit passes, one byte more of hex does not
    assert file_text(b"0x1234 abcde", max_hex_fraction=0.5) == ("0x1234 abcde", "")
    assert file_text(b"0x12345 abcd", max_hex_fraction=0.5) == (None, "hex_data")
    assert file_text(b"0x12345 abcd", max_hex_fraction=1.0) == ("0x12345 abcd", "")


def test_pin_errors_name_the_fix(mirror, tmp_path):
    pin = kernel_pin(mirror)
    deb = fetch_deb(pin, tmp_path / "cache")
    wrong = DebSourceTree(**{**pin.__dict__, "tarball": "usr/src/linux.tar.xz"})
    with pytest.raises(
        ValueError, match=r"no member 'usr/src/linux.tar.xz'; fix the pin's tarball"
    ):
        list(wrong.documents(deb))
    wrong = DebSourceTree(**{**pin.__dict__, "root": "linux-9.9"})
    with pytest.raises(
        ValueError, match=r"no file under root 'linux-9.9'; fix the pin's root .*'linux-source-9.9'"
    ):
        list(wrong.documents(deb))
    bad = {
        "sha256": ("x" * 64, r"sha256='x+' must be 64 lowercase hex digits"),
        "pool_path": ("pool/../etc/x.deb", r"pool_path='pool/../etc/x.deb' must be relative"),
        "tarball": ("/usr/src/x.tar.xz", r"tarball='/usr/src/x.tar.xz' must be relative"),
        "exclude": ("(", r"exclude='\(':"),
        "max_bytes": (0, r"max_bytes=0 must be >= 1"),
        "max_hex_fraction": (0.0, r"max_hex_fraction=0.0 must be in \(0, 1\]; try 0.5"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            DebSourceTree(**{**pin.__dict__, field: value})


def tokens_of(path: Path) -> list[str]:
    return np.fromfile(path, dtype=np.uint16).astype(np.uint8).tobytes().decode().split("\x04")


def test_a_corpus_of_pages_and_files(mirror, tmp_path):
    kernel, doc = kernel_pin(mirror), html_pin(mirror)
    corpus = DebCorpus(name="fake-large", packages=(kernel, doc), val_fraction=0.3, min_chars=100)
    out = prepare_data(None, "byte", cache_dir=tmp_path / "cache", corpus=corpus)
    meta = json.loads((out / "meta.json").read_text())
    names = {s: [d["name"] for d in meta["splits"][s]["documents"]] for s in ("train", "val")}
    texts = dict(
        zip(
            names["train"] + names["val"],
            tokens_of(out / "train.bin")[:-1] + tokens_of(out / "val.bin")[:-1],
            strict=True,
        )
    )
    want = {f"{TREE}/{path}": text for path, text in KEPT.items()}
    assert texts == {**want, "a-doc/intro.html": ("A manual page of prose. " * 20).strip()}
    assert names["val"] and not set(names["train"]) & set(names["val"])
    packages = {p["name"]: p for p in meta["source"]["packages"]}
    assert packages[TREE] == {
        "name": TREE,
        "version": "1.0-1",
        "pool_path": kernel.pool_path,
        "sha256": kernel.sha256,
        "license": "GPL-2",
        "files": 4,
        "tokens": sum(len(t.encode()) for t in KEPT.values()),
        "too_small": 1,
        "excluded": 1,
        "links_skipped": 1,
        "too_large": 1,
        "binary": 3,
        "hex_data": 1,
        "rules": kernel.rules(),
    }
    assert packages["a-doc"]["pages"] == 1 and packages["a-doc"]["no_main"] == 0
    assert meta["key"]["source_rules"] == {TREE: kernel.rules()}
    assert meta["source"]["kind"] == "debian-packages"


def test_a_killed_build_resumes_with_the_same_bytes(mirror, tmp_path, monkeypatch):
    kernel, doc = kernel_pin(mirror), html_pin(mirror)
    corpus = DebCorpus(name="fake-large", packages=(kernel, doc), val_fraction=0.3, min_chars=100)
    clean = prepare_data(None, "byte", cache_dir=tmp_path / "clean", corpus=corpus)
    cache = tmp_path / "cache"
    real = DebSourceTree.documents
    read: list[str] = []

    def killed_midway(self, deb):
        for i, d in enumerate(real(self, deb)):
            if i == 4:
                raise KeyboardInterrupt("killed")
            yield d

    monkeypatch.setattr(DebSourceTree, "documents", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(None, "byte", cache_dir=cache, corpus=corpus)
    parts = cache / "debdocs-parts"
    stems = {p.name: f"{p.name}-{p.sha256[:16]}-byte" for p in (kernel, doc)}
    # a-doc sorts first and is done; the kernel's half-written part left nothing, not even a tmp
    done = [f"{stems['a-doc']}{ext}" for ext in (".bin", ".json")]
    assert sorted(f.name for f in parts.iterdir()) == done
    assert not (cache / "fake-large-byte" / "meta.json").exists()

    def counted(self, deb):
        read.append(self.name)
        return real(self, deb)

    # a SIGKILL leaves its partial part behind: a dead writer's is removed, a live one's is kept
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    ).stdout.strip()
    stale = parts / f".{stems[TREE]}.bin.{dead}.0123abcd.tmp"
    live = parts / f".{stems[TREE]}.bin.{os.getpid()}.4567cdef.tmp"
    stale.write_bytes(b"\0" * 1000)
    live.write_bytes(b"\0" * 10)
    monkeypatch.setattr(DebSourceTree, "documents", counted)
    monkeypatch.setattr(
        debcorpus,
        "fetch_deb",
        lambda p, *a, **k: read.append(f"fetch {p.name}") or fetch_deb(p, *a, **k),
    )
    out = prepare_data(None, "byte", cache_dir=cache, corpus=corpus)
    assert read == [f"fetch {TREE}", TREE]  # only the killed package is read again
    assert not stale.exists() and live.exists()
    live.unlink()
    for f in ("train.bin", "val.bin", "meta.json"):
        assert (out / f).read_bytes() == (clean / f).read_bytes(), f
    # a part cut short (a disk full, a copy gone wrong) is made again, the same bytes
    kernel_bin = parts / f"{stems[TREE]}.bin"
    kernel_bin.write_bytes(kernel_bin.read_bytes()[:-2])
    (out / "meta.json").unlink()
    read.clear()
    assert prepare_data(None, "byte", cache_dir=cache, corpus=corpus) == out
    assert read == [f"fetch {TREE}", TREE]
    for f in ("train.bin", "val.bin", "meta.json"):
        assert (out / f).read_bytes() == (clean / f).read_bytes(), f


def test_progress_lines_in_a_log():
    buf = io.StringIO()
    report = debcorpus._Report(True, file=buf, every=0.0)
    report.start("pkg")
    report.tick(5)
    report.tick(0)
    report.finish("pkg: done")
    lines = buf.getvalue().splitlines()
    assert [re.sub(r"\d+ s$", "T s", x) for x in lines] == [
        "  pkg: 1 read, 5 tokens, T s",
        "  pkg: 2 read, 5 tokens, T s",
        "pkg: done",
    ]


def test_debian_large_pins_are_well_formed():
    large = corpora.CORPORA["debian-large"]
    assert isinstance(large, DebCorpus) and large is corpora.DEBIAN_LARGE
    names = [p.name for p in large.packages]
    assert len(set(names)) == len(names) == 20
    assert set(corpora.DEBIAN_DOCS.packages) <= set(large.packages)
    for p in large.packages:
        upstream = p.version.split(":", 1)[-1]  # the pool's file names drop the epoch
        assert p.pool_path.startswith("pool/main/"), p.name
        assert p.pool_path.endswith(f"/{p.name}_{upstream}_all.deb"), p.name
        assert re.fullmatch(r"[0-9a-f]{64}", p.sha256) and p.version and p.license, p.name
        json.dumps(p.rules())  # the part key holds them
    trees = [p for p in large.packages if isinstance(p, DebSourceTree)]
    assert {p.name for p in trees} == {"linux-source-6.12", "perl-doc"}
    kernel = next(p for p in trees if p.name == "linux-source-6.12")
    assert kernel.version == "6.12.107-1" and kernel.tarball == "usr/src/linux-source-6.12.tar.xz"
    docs = next(p for p in large.packages if p.name == "linux-doc-6.12")
    assert docs.version == kernel.version  # the manual and the source of the same kernel
    assert debsource.SOURCE_EXTRACTOR_VERSION == kernel.rules()["extractor_version"]
