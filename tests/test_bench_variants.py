"""benchmarks/variants.py: the step benchmarks' ``+gN`` option."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import qsdp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import variants  # noqa: E402

sys.path.pop(0)


def test_plus_g_sets_the_gradients_group_size_and_refuses_recipes_without_one():
    assert variants.group_size(["pipe", "g1024", "b100"]) == 1024
    assert variants.group_size(["pipe", "b100"]) == 0
    cgx = variants.with_group_size(qsdp.recipe("cgx"), 1024)
    assert cgx.grads.spec.group_size == 1024 and qsdp.recipe("cgx").grads.spec.group_size == 256
    assert cgx.grads.spec.bits == 4 and cgx.weights is None  # nothing else changed
    assert variants.with_group_size(qsdp.recipe("global-qsgd"), 512).grads.group_size == 512
    with pytest.raises(SystemExit, match=r"\+g512: this recipe's gradients \(TwoLevelGrads\)"):
        variants.with_group_size(qsdp.recipe("sdp4bit"), 512)
