"""The README's main command: the demo trains a tiny LM on real text and quantizes it."""

import json
import subprocess
import sys

import pytest

from qsdp_train.quant_demo import corpus, run


def test_corpus_is_real_english_text():
    data = corpus()
    assert len(data) > 200_000
    text = data.decode("ascii")
    for word in (" the ", " of ", " and ", "return"):
        assert word in text


def test_corpus_does_not_depend_on_what_the_process_did_before():
    """Reading a class's ``__annotations__`` creates it (an empty dict); pydoc's rendering
    listed it, so a FSDP2 test's first run trained on other batches than its second (found on
    2 x H100). Run in a fresh process, so that nothing here has read them already."""
    code = (
        "import hashlib, importlib, inspect\n"
        "from qsdp_train.quant_demo import CORPUS_MODULES, corpus\n"
        "a = corpus()\n"
        "for name in CORPUS_MODULES:\n"
        "    for obj in list(vars(importlib.import_module(name)).values()):\n"
        "        if inspect.isclass(obj):\n"
        "            getattr(obj, '__annotations__', None)\n"
        "print(a == corpus(), len(a))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    same, size = out.stdout.split()
    assert same == "True" and int(size) > 200_000, out.stdout


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = run(steps=5, out=out)
    saved = json.loads((out / "quant_demo.json").read_text())
    assert len(saved["rows"]) == len(result) and saved["losses"][-1] < saved["losses"][0]
    return {r.spec.split(":")[0]: r for r in result}


def test_errors_order_by_bit_width(rows):
    assert rows["W8 absmax (QSDP weights)"].rel_l2_error < 0.02
    assert rows["G8 minmax (QSDP/CGX grads)"].rel_l2_error < 0.03
    g4 = rows["G4 absmax+H32 (SDP4Bit inter)"].rel_l2_error
    assert 0.03 < g4 < 0.5
    assert rows["G2 absmax+H32"].rel_l2_error > g4


def test_weight_differences_beat_direct_4bit(rows):
    direct = rows["W4 direct"].rel_l2_error
    qwd = rows["W4 differences (qWD)"].rel_l2_error
    assert qwd < 0.05 * direct


def test_compression_ratios(rows):
    assert rows["W8 absmax (QSDP weights)"].ratio_vs_bf16 == pytest.approx(16 / 8.25, rel=0.01)
    assert rows["G4 absmax+H32 (SDP4Bit inter)"].ratio_vs_bf16 == pytest.approx(16 / 4.25, rel=0.01)


def test_cli():
    help_text = subprocess.run(
        [sys.executable, "-m", "qsdp_train", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "demo" in help_text
    bad = subprocess.run(
        [sys.executable, "-m", "qsdp_train", "bogus"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "unknown command 'bogus'" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "qsdp_train", "quant-demo", "--steps", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "--steps=0 must be >= 1" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "qsdp_train", "demo", "--steps", "0"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "qsdp demo: --steps=0 must be >= 5" in bad.stderr
