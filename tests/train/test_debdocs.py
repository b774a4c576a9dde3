"""The Debian-docs corpus on a fake ``.deb`` served from a ``file://`` mirror (no network)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from qsdp_train import corpora, debcorpus
from qsdp_train.data import prepare_data
from qsdp_train.debcorpus import DebCorpus
from qsdp_train.debdocs import DebPackage, PageText, fetch_deb, html_to_text, package_pages
from qsdp_train.prepare_cli import main as prepare_main

from .debfiles import member, symlink, write_deb

ROOT = "usr/share/doc/fake-doc/html"

PAGE = """<html><head><script>var nav = 1;</script><title>T</title></head><body>
<div class="sidebar">Navigation text</div>
<div class="body" role="main">
<section id="intro">
<h1>Intro<a class="headerlink" href="#intro" title="Link to this heading">¶</a></h1>
<p>First   paragraph &amp; more.</p>



<div><script>alert("x")</script><style>p {{}}</style><p>{body}</p></div>
<pre>code  line
    indented</pre>
</section>
</div>
<div class="footer">Footer text</div>
</body></html>"""


def page(body: str) -> bytes:
    return PAGE.format(body=body).encode()


def make_deb(path: Path, *, compression: str = "xz", n_pages: int = 8, tag: str = "") -> None:
    """An ar archive (debian-binary, control.tar.xz, data.tar.<compression>) like a real .deb."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode=f"w:{compression}") as tar:
        for i in range(n_pages):
            body = f"{tag}Page {i} says " + "words of prose " * (5 + 3 * i)
            member(tar, f"./{ROOT}/guide/p{i}.html", page(body))
        member(tar, f"./{ROOT}/tiny.html", b'<div role="main"><p>Too small.</p></div>')
        member(tar, f"./{ROOT}/nomain.html", b"<p>" + b"no main element " * 20 + b"</p>")
        member(tar, f"./{ROOT}/translations/zh/index.html", page("translated " * 30))
        member(tar, f"./{ROOT}/_static/x.html", page("static " * 30))
        member(tar, f"./{ROOT}/genindex.html", page("index " * 30))
        member(tar, f"./{ROOT}/../../../../../../evil.html", page("hostile " * 30))
        member(tar, "/tmp/qsdp-absolute-evil.html", page("hostile " * 30))
        symlink(tar, f"./{ROOT}/linked.html", "/etc/passwd")
    write_deb(path, data.getvalue(), compression=compression)


def pin(mirror: Path, name: str = "fake-doc", **kw) -> DebPackage:
    pool = f"pool/main/f/{name}/{name}_1.0-1_all.deb"
    (mirror / pool).parent.mkdir(parents=True, exist_ok=True)
    make_deb(mirror / pool, tag=kw.pop("tag", name + " "), **kw)
    sha = hashlib.sha256((mirror / pool).read_bytes()).hexdigest()
    return DebPackage(
        name=name, version="1.0-1", pool_path=pool, sha256=sha, license="MIT", html_root=ROOT
    )


@pytest.fixture
def fake(tmp_path, monkeypatch) -> tuple[Path, Path, DebCorpus]:
    """(mirror dir, cache dir, a two-package corpus), the mirror set as QSDP_DEBIAN_MIRROR."""
    mirror, cache = tmp_path / "mirror", tmp_path / "cache"
    corpus = DebCorpus(
        name="fake-docs",
        packages=(pin(mirror, "fake-doc"), pin(mirror, "other2.7-doc", n_pages=6)),
        val_fraction=0.2,
        min_chars=100,
    )
    monkeypatch.setenv("QSDP_DEBIAN_MIRROR", mirror.as_uri())
    return mirror, cache, corpus


EXPECTED_P0 = (
    "Intro\n\nFirst   paragraph & more.\n\nfake-doc Page 0 says "
    + ("words of prose " * 5).rstrip()
    + "\n\ncode  line\n    indented"
)


def test_html_to_text_exact():
    text = html_to_text(page("Body text.").decode())
    assert text == "Intro\n\nFirst   paragraph & more.\n\nBody text.\n\ncode  line\n    indented"
    assert html_to_text("<p>no main here</p>") is None
    assert html_to_text('<x><main role="main">A<main>B</main>C</main>after') == "A\nB\nC"


def test_pages_of_a_fake_deb(fake):
    mirror, cache, corpus = fake
    pkg = corpus.packages[0]
    pages = list(package_pages(fetch_deb(pkg, cache), pkg))
    texts = {p.path: p.text for p in pages if isinstance(p, PageText)}
    links = [p for p in pages if isinstance(p, str)]
    assert links == ["linked.html"]
    assert sorted(texts) == sorted(
        [f"guide/p{i}.html" for i in range(8)]
        + ["tiny.html", "nomain.html", "../../../../../../evil.html"]
    )
    assert texts["guide/p0.html"] == EXPECTED_P0
    assert texts["tiny.html"] == "Too small." and texts["nomain.html"] is None
    assert all("¶" not in t and "alert" not in t and "nav" not in t for t in texts.values() if t)


def test_sha256_mismatch_names_the_fix(fake):
    mirror, cache, corpus = fake
    good = corpus.packages[0]
    bad = DebPackage(**{**good.__dict__, "sha256": "0" * 64})
    with pytest.raises(
        ValueError, match=r"has sha256 [0-9a-f]{64}, expected 0{64}.*delete the file"
    ):
        fetch_deb(bad, cache)
    assert not list((cache / "downloads").iterdir())  # the bad download was not kept
    path = fetch_deb(good, cache)
    path.write_bytes(path.read_bytes() + b"x")  # a cached file is checked again
    with pytest.raises(ValueError, match=f"{path}.*expected {good.sha256}.*delete the file"):
        fetch_deb(good, cache)


def test_only_xz_packages_are_read(tmp_path):
    (tmp_path / "pool").mkdir()
    make_deb(tmp_path / "pool" / "g.deb", compression="gz")
    sha = hashlib.sha256((tmp_path / "pool" / "g.deb").read_bytes()).hexdigest()
    pkg = DebPackage(
        name="g", version="1", pool_path="pool/g.deb", sha256=sha, license="MIT", html_root=ROOT
    )
    deb = fetch_deb(pkg, tmp_path / "cache", mirror=tmp_path.as_uri())
    with pytest.raises(ValueError, match=r"\['data.tar.gz'\], not data.tar.xz.*pin another"):
        list(package_pages(deb, pkg))


def tokens(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16)


def docs_of(path: Path) -> list[str]:
    return tokens(path).astype(np.uint8).tobytes().decode().split("\x04")[:-1]


def test_prepare_splits_by_page_and_counts_match(fake, tmp_path):
    mirror, cache, corpus = fake
    out = prepare_data(None, "byte", cache_dir=cache, corpus=corpus)
    assert out == cache / "fake-docs-byte"
    meta = json.loads((out / "meta.json").read_text())
    names = {s: [d["name"] for d in meta["splits"][s]["documents"]] for s in ("train", "val")}
    want = [f"fake-doc/guide/p{i}.html" for i in range(8)]
    want += [f"other2.7-doc/guide/p{i}.html" for i in range(6)]
    want += ["fake-doc/../../../../../../evil.html", "other2.7-doc/../../../../../../evil.html"]
    assert sorted(names["train"] + names["val"]) == sorted(want)
    assert not set(names["train"]) & set(names["val"]) and names["val"]
    for s in ("train", "val"):
        split = meta["splits"][s]
        assert split["tokens"] == (out / f"{s}.bin").stat().st_size // 2
        assert split["tokens"] == sum(d["tokens"] for d in split["documents"])
        assert split["n_documents"] == len(names[s]) == len(docs_of(out / f"{s}.bin"))
    texts = dict(
        zip(
            names["train"] + names["val"],
            docs_of(out / "train.bin") + docs_of(out / "val.bin"),
            strict=True,
        )
    )
    assert texts["fake-doc/guide/p0.html"] == EXPECTED_P0
    pkgs = meta["source"]["packages"]
    assert [
        (p["name"], p["license"], p["too_small"], p["no_main"], p["links_skipped"]) for p in pkgs
    ] == [
        ("fake-doc", "MIT", 1, 1, 1),
        ("other2.7-doc", "MIT", 1, 1, 1),
    ]
    assert pkgs[0]["sha256"] == corpus.packages[0].sha256


def test_finished_and_cached_parts_are_reused_offline(fake):
    mirror, cache, corpus = fake
    out = prepare_data(None, "byte", cache_dir=cache, corpus=corpus)
    before = {f: (out / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json")}
    mtime = (out / "meta.json").stat().st_mtime_ns
    for f in mirror.rglob("*.deb"):
        f.unlink()
    assert prepare_data(None, "byte", cache_dir=cache, corpus=corpus) == out
    assert (out / "meta.json").stat().st_mtime_ns == mtime  # not even rewritten
    for f in (cache / "downloads").iterdir():  # parts alone rebuild the corpus: no fetch
        f.unlink()
    (out / "meta.json").unlink()
    assert prepare_data(None, "byte", cache_dir=cache, corpus=corpus) == out
    assert {f: (out / f).read_bytes() for f in before} == before


def test_resume_after_a_crash_is_byte_identical(fake, tmp_path, monkeypatch):
    mirror, cache, corpus = fake
    clean = prepare_data(None, "byte", cache_dir=tmp_path / "clean", corpus=corpus)
    real = debcorpus.fetch_deb

    def crash_on_second(pkg, *a, **kw):
        if pkg.name == "other2.7-doc":
            raise KeyboardInterrupt("killed")
        return real(pkg, *a, **kw)

    monkeypatch.setattr(debcorpus, "fetch_deb", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(None, "byte", cache_dir=cache, corpus=corpus)
    parts = sorted(p.name for p in (cache / "debdocs-parts").iterdir())
    stem = f"fake-doc-{corpus.packages[0].sha256[:16]}-byte"
    assert parts == [f"{stem}.bin", f"{stem}.json"]  # the first package only
    assert not (cache / "fake-docs-byte" / "meta.json").exists()
    fetched = []  # the second package's name has dots: its part files must keep them
    monkeypatch.setattr(
        debcorpus, "fetch_deb", lambda p, *a, **k: fetched.append(p.name) or real(p, *a, **k)
    )
    out = prepare_data(None, "byte", cache_dir=cache, corpus=corpus)
    assert fetched == ["other2.7-doc"]
    stems = [f"{p.name}-{p.sha256[:16]}-byte" for p in corpus.packages]
    want = sorted(f"{s}{ext}" for s in stems for ext in (".bin", ".json"))
    assert sorted(p.name for p in (cache / "debdocs-parts").iterdir()) == want
    for f in ("train.bin", "val.bin", "meta.json"):
        assert (out / f).read_bytes() == (clean / f).read_bytes(), f


def test_hostile_member_names_write_nothing(fake, tmp_path, monkeypatch):
    mirror, cache, corpus = fake
    monkeypatch.chdir(tmp_path)
    prepare_data(None, "byte", cache_dir=cache, corpus=corpus)
    assert not Path("/tmp/qsdp-absolute-evil.html").exists()
    for base in (tmp_path, cache, cache / "downloads", Path.cwd()):
        for up in range(8):
            assert not (base.joinpath(*[".."] * up) / "evil.html").exists()
    assert not list(tmp_path.rglob("*.html"))


def test_cli_prepares_and_prints(fake, monkeypatch, capsys):
    mirror, cache, corpus = fake
    monkeypatch.setitem(corpora.CORPORA, "fake-docs", corpus)
    argv = ["--corpus", "fake-docs", "--tokenizer", "byte", "--cache-dir", str(cache)]
    out = prepare_main([*argv, "--no-progress"])
    lines = capsys.readouterr().out.splitlines()
    meta = json.loads((out / "meta.json").read_text())
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert lines[0] == str(cache / "fake-docs-byte")
    assert lines[1].startswith(
        f"fake-docs (byte): train {train['tokens']:,} tokens in {train['n_documents']} documents, "
        f"val {val['tokens']:,} tokens in {val['n_documents']} documents ("
    )
    (out / "meta.json").unlink()  # rebuilt from the cached parts, with progress lines
    prepare_main(argv)  # on a non-terminal stderr: plain lines
    assert "fake-docs: fake-doc 1.0-1: cached" in capsys.readouterr().err


def test_cli_bad_corpus_lists_the_valid_ones(capsys):
    from qsdp_train.cli import main as qsdp_main

    with pytest.raises(
        SystemExit,
        match=r"unknown corpus 'nope'; use one of \['debian-docs', 'debian-large', 'shakespeare'\]",
    ):
        qsdp_main(["prepare-data", "--corpus", "nope"])


def test_registry_pins_are_well_formed():
    assert corpora.CORPORA["shakespeare"] is corpora.SHAKESPEARE
    docs = corpora.CORPORA["debian-docs"]
    assert isinstance(docs, DebCorpus) and len(docs.packages) == 11
    for p in docs.packages:
        assert p.pool_path.endswith(f"{p.filename}") and p.license and p.html_root.endswith("html")
