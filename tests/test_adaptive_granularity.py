"""benchmarks/adaptive_granularity.py --group-sizes: plans over (width, group size) options
against CGX's 4 bits in groups of 1024, on hand-made gradients."""

from __future__ import annotations

import torch

from .bench_scripts import load


def test_group_size_plans_keep_the_reference_error_budget():
    ag = load("adaptive_granularity")
    g = torch.Generator().manual_seed(0)
    # two heavy-tailed parameters and a small-gradient one, each a multiple of 1024 long
    grads = {
        "a": torch.randn(8192, generator=g) * torch.randn(8192, generator=g).exp(),
        "b": torch.randn(4096, generator=g) ** 3,
        "c": torch.randn(2048, generator=g) * 1e-3,
    }
    spec = ag.REFERENCE
    assert (spec.bits, spec.group_size) == (4, 1024)
    for relative in (False, True):
        out = ag.saved_with_groups(grads, [["a"], ["b"], ["c"]], spec, relative=relative)
        ref = out["uniform"]["4b/g1024"]
        assert (ref["bytes"], ref["error"]) == (1.0, 1.0)  # the reference against itself
        assert out["error_vs_reference"] <= 1.0 + 1e-9  # never above the budget
        assert 0.0 <= out["bytes_saved"] < 1.0 and sum(out["chosen"].values()) == 3
        # more bits in the same groups: more bytes, less error
        assert out["uniform"]["8b/g1024"]["bytes"] > 1.0 > out["uniform"]["2b/g1024"]["bytes"]
        assert out["uniform"]["8b/g1024"]["error"] < 1.0 < out["uniform"]["2b/g1024"]["error"]
        # smaller groups of the heavy-tailed gradients: more scale bytes, less error
        assert out["uniform"]["4b/g64"]["bytes"] > 1.0 > out["uniform"]["4b/g64"]["error"]
    assert ag._key(3, 256) // 100_000 == 3 and ag._key(3, 256) % 100_000 == 256
