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
    assert w8g8.weights.bits == 8 and w8g8.grads.bits == 8
    assert w8g8.grads.rounding.value == "stochastic"  # unbiased gradients
    assert recipe("global-qsgd").grad_carrier == "int8"
    assert recipe("w4-direct").weights.bits == 4 and recipe("w4-direct").grads is None
    assert set(qsdp.RECIPES) >= {
        "bf16",
        "qsdp-w8g8",
        "global-qsgd",
        "sdp4bit",
        "w4-direct",
        "qwd-only",
        "tlq-hs-only",
        "tlq-no-hadamard",
    }
    sdp = recipe("sdp4bit")
    assert sdp.weight_diffs and sdp.weights.bits == 4 and sdp.weights.group_size == 2048
    assert sdp.grads.bits == 8 and sdp.grads_inter.bits == 4
    assert sdp.grads.hadamard_block == sdp.grads_inter.hadamard_block == 32
    assert recipe("tlq-no-hadamard").grads_inter.hadamard_block is None
    assert recipe("qwd-only").grads is None and recipe("tlq-hs-only").weights is None
    assert recipe("w4-direct").weights == sdp.weights and not recipe("w4-direct").weight_diffs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"grads": G8, "grad_carrier": "int8"}, ValueError, "not both"),
        ({"grad_carrier": "int4"}, ValueError, "grad_carrier='int4' must be one of"),
        ({"grad_group_size": 0}, ValueError, "grad_group_size=0"),
        ({"seed": -1}, ValueError, "seed=-1"),
        ({"weights": "w8"}, TypeError, "weights must be a QuantSpec"),
        ({"grads_inter": G8}, ValueError, "grads_inter .* needs grads"),
        ({"grad_nonfinite": "skip"}, ValueError, "grad_nonfinite='skip' must be"),
        ({"weights": G8, "quantized_master": True}, ValueError, "scheme='shift-lattice'"),
        ({"quantized_master": True}, ValueError, "scheme='shift-lattice'"),
        ({"weight_diffs": True}, ValueError, "weight_diffs needs weights"),
        ({"weights": G8, "weight_resync_every": -1}, ValueError, "weight_resync_every=-1"),
    ],
)
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        CompressionConfig(**kwargs)


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


def test_quantized_reduce_scatter_needs_one_source():
    from qsdp.fsdp import QuantizedReduceScatter

    with pytest.raises(ValueError, match="exactly one of spec and carrier"):
        QuantizedReduceScatter(
            spec=G8, carrier="int8", group_size=128, seed=0, bucket=0, stats=None
        )


def test_all_gather_refuses_raw_bytes():
    from qsdp.comm import CommStats
    from qsdp.fsdp import QuantizedAllGather

    comm = QuantizedAllGather(G8, seed=0, bucket=0, stats=CommStats())
    buf = comm.allocate((8,), dtype=torch.uint8, device=torch.device("cpu"))
    with pytest.raises(TypeError, match="mix dtypes"):
        comm(buf, buf[:4], group=None)
