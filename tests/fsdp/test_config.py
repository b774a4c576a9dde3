"""CompressionConfig, the recipes and compress_fsdp's argument checks (no processes needed)."""

import pytest
import torch
from torch import nn

import qsdp
from qsdp import CompressionConfig, QuantSpec, recipe

G8 = QuantSpec(bits=8, group_size=128, scheme="minmax", rounding="stochastic")


def test_recipes_are_typed_configs():
    assert recipe("bf16") == CompressionConfig()
    w8g8 = recipe("qsdp-w8g8")
    assert isinstance(w8g8.weights, qsdp.QuantizedWeights) and w8g8.weights.spec.bits == 8
    assert isinstance(w8g8.grads, qsdp.QuantizedGrads) and w8g8.grads.spec.bits == 8
    assert w8g8.grads.spec.rounding.value == "stochastic"  # unbiased gradients
    assert recipe("global-qsgd").grads == qsdp.IntegerGrads(carrier="int8", group_size=128)
    assert recipe("w4-direct").weights.spec.bits == 4 and recipe("w4-direct").grads is None
    assert set(qsdp.RECIPES) >= {
        "bf16",
        "qsdp-w8g8",
        "qsdp-g8",
        "cgx",
        "global-qsgd",
        "sdp4bit",
        "w4-direct",
        "qwd-only",
        "tlq-hs-only",
        "tlq-no-hadamard",
    }
    sdp = recipe("sdp4bit")
    assert isinstance(sdp.weights, qsdp.WeightDiffs) and sdp.two_level
    assert sdp.weights.spec.bits == 4 and sdp.weights.spec.group_size == 2048
    assert sdp.grads.intra.bits == 8 and sdp.grads.inter.bits == 4
    assert sdp.grads.intra.hadamard_block == sdp.grads.inter.hadamard_block == 32
    assert recipe("tlq-no-hadamard").grads.inter.hadamard_block is None
    assert recipe("qwd-only").grads is None and recipe("tlq-hs-only").weights is None
    assert recipe("w4-direct").weights.spec == sdp.weights.spec
    assert isinstance(recipe("w4-direct").weights, qsdp.QuantizedWeights)
    cgx = recipe("cgx").grads.spec  # CGX: 4-bit min-max, stochastic, groups of 256 (not 1024)
    assert (cgx.bits, cgx.group_size, cgx.scheme.value) == (4, 256, "minmax")
    assert recipe("cgx").weights is None


def test_recipe_overrides():
    assert recipe("sdp4bit", seed=3).seed == 3
    assert recipe("qsdp-w8g8", nonfinite="zero").nonfinite is qsdp.NonFinite.ZERO
    with pytest.raises(TypeError, match="unknown overrides \\['grad_carrier'\\]"):
        recipe("bf16", grad_carrier="int8")


def test_plans_leave_nan_checks_to_the_integration():
    from qsdp.comm import IntegerReduce, QuantizedReduce, TwoLevelReduce

    plan = recipe("qsdp-w8g8").grads.plan()
    assert isinstance(plan, QuantizedReduce) and plan.spec.nonfinite.value == "propagate"
    two = recipe("sdp4bit").grads.plan()
    assert isinstance(two, TwoLevelReduce) and two.mesh is None
    assert two.intra.nonfinite.value == two.inter.nonfinite.value == "propagate"
    integer = recipe("global-qsgd").grads.plan()
    assert isinstance(integer, IntegerReduce) and integer.nonfinite == "propagate"
    with pytest.raises(ValueError, match="reduce-scatter only|reduces only by reduce-scatter"):
        two.all_reduce(torch.zeros(4), None)


G4_64 = QuantSpec(bits=4, group_size=64, scheme="minmax", rounding="stochastic")


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: qsdp.IntegerGrads(carrier="int4"), ValueError, "carrier='int4' must be one of"),
        (lambda: qsdp.IntegerGrads(group_size=0), ValueError, "group_size=0"),
        (lambda: qsdp.IntegerGrads(rounding="up"), ValueError, "rounding='up'"),
        (lambda: CompressionConfig(seed=-1), ValueError, "seed=-1"),
        (lambda: CompressionConfig(weights=G8), TypeError, "weights=.* must be QuantizedWeights"),
        (lambda: CompressionConfig(grads=G8), TypeError, "grads=.* must be QuantizedGrads"),
        (lambda: CompressionConfig(nonfinite="skip"), ValueError, "nonfinite='skip' must be"),
        (lambda: qsdp.QuantizedMaster(spec=G8), ValueError, "scheme='shift-lattice'"),
        (lambda: qsdp.QuantizedWeights(spec="w8"), TypeError, "spec must be a qsdp.QuantSpec"),
        (lambda: qsdp.WeightDiffs(spec=G8, resync_every=-1), ValueError, "resync_every=-1"),
        (
            lambda: qsdp.TwoLevelGrads(intra=G8, inter=G4_64),
            ValueError,
            "intra.group_size=128 and inter.group_size=64 differ",
        ),
        (
            lambda: QuantSpec(
                bits=8, group_size=128, scheme="absmax", rounding="nearest", nonfinite="zero"
            ),
            ValueError,
            "cannot zero",
        ),
    ],
)
def test_bad_config(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        CompressionConfig(G8)  # keyword-only
    with pytest.raises(AttributeError):
        recipe("bf16").seed = 3


def test_compress_fsdp_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown recipe 'sdp5bit'; available: bf16"):
        qsdp.compress_fsdp(nn.Linear(2, 2), "sdp5bit")
    with pytest.raises(TypeError, match="config must be a qsdp.CompressionConfig"):
        qsdp.compress_fsdp(nn.Linear(2, 2), {"weights": None})
    with pytest.raises(ValueError, match="found no FSDPModule.*fully_shard"):
        qsdp.compress_fsdp(nn.Linear(2, 2), "qsdp-w8g8")
    with pytest.raises(ValueError, match="is for two-level gradients"):
        qsdp.compress_fsdp(nn.Linear(2, 2), "qsdp-w8g8", mesh=object())
    with pytest.raises(ValueError, match="mesh must be a 2-D DeviceMesh"):
        qsdp.compress_fsdp(nn.Linear(2, 2), "sdp4bit", mesh=object())
    with pytest.raises(ValueError, match="was not passed to qsdp.compress_fsdp"):
        qsdp.fsdp_comm_stats(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="was not passed to qsdp.compress_fsdp"):
        qsdp.fsdp.resync(nn.Linear(2, 2))


def test_quantized_reduce_scatter_needs_a_plan():
    from qsdp.fsdp import QuantizedReduceScatter

    with pytest.raises(TypeError, match="plan must be a qsdp.comm.ReducePlan"):
        QuantizedReduceScatter(plan=G8, seed=0, bucket=0, stats=None)


def test_all_gather_refuses_raw_bytes():
    from qsdp.comm import CommStats
    from qsdp.fsdp import QuantizedAllGather

    comm = QuantizedAllGather(G8, seed=0, bucket=0, stats=CommStats())
    buf = comm.allocate((8,), dtype=torch.uint8, device=torch.device("cpu"))
    with pytest.raises(TypeError, match="mix dtypes"):
        comm(buf, buf[:4], group=None)
