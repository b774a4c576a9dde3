import pytest
import torch

from qsdp.quant import NonFinite, QuantSpec, Rounding, Scheme


def test_strings_become_enums():
    s = QuantSpec(4, 128, "absmax", "stochastic", hadamard_block=32, nonfinite="propagate")
    assert s.scheme is Scheme.ABSMAX
    assert s.rounding is Rounding.STOCHASTIC
    assert s.nonfinite is NonFinite.PROPAGATE
    assert str(s) == "absmax4/g128/stochastic, hadamard=32"


def test_frozen():
    s = QuantSpec(8, 128, "absmax", "nearest")
    with pytest.raises(AttributeError):
        s.bits = 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 5}, r"bits=5 must be one of \(2, 3, 4, 6, 8\)"),
        ({"bits": 16}, "bits=16"),
        ({"group_size": 100}, "group_size=100 must be a power of two"),
        ({"group_size": 8}, "group_size=8"),
        ({"group_size": 16384}, "group_size=16384"),
        ({"scheme": "maxabs"}, "scheme='maxabs' must be one of"),
        ({"rounding": "up"}, "rounding='up' must be one of"),
        ({"hadamard_block": 24}, "hadamard_block=24"),
        ({"hadamard_block": 512}, "hadamard_block=512"),
        ({"group_size": 16, "hadamard_block": 32}, "must not exceed group_size=16"),
        ({"hadamard_seed": 3}, "hadamard_seed is set but hadamard_block is None"),
        ({"hadamard_block": 32, "hadamard_seed": -1}, "hadamard_seed=-1"),
        ({"scale_dtype": torch.float16}, "scale_dtype=torch.float16"),
        ({"scheme": "minmax", "scale_dtype": torch.bfloat16}, "needs scheme='absmax'"),
        ({"nonfinite": "ignore"}, "nonfinite='ignore'"),
    ],
)
def test_bad_spec_raises_with_fix(kwargs, match):
    args = {"bits": 8, "group_size": 128, "scheme": "absmax", "rounding": "nearest"} | kwargs
    with pytest.raises(ValueError, match=match):
        QuantSpec(**args)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("scheme", ["absmax", "minmax", "shift-lattice"])
@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 5000])
def test_payload_bytes_formula(bits, scheme, numel):
    s = QuantSpec(bits, 128, scheme, "nearest")
    groups = -(-numel // 128)
    fields = 1 if scheme == "absmax" else 2
    assert s.num_groups(numel) == groups
    assert s.payload_bytes(numel) == -(-numel * bits // 8) + groups * fields * 4


def test_bf16_scales_halve_scale_bytes():
    s = QuantSpec(4, 32, "absmax", "nearest", scale_dtype=torch.bfloat16)
    assert s.scale_bytes == 2
    assert s.payload_bytes(100) == 50 + 4 * 2


def test_one_name_for_an_encode_that_never_raises():
    for mode in ("raise", "propagate"):
        spec = QuantSpec(
            bits=4, group_size=128, scheme="minmax", rounding="stochastic", nonfinite=mode
        )
        quiet = spec.propagating()
        assert quiet.nonfinite is NonFinite.PROPAGATE
        assert quiet == QuantSpec(
            bits=4, group_size=128, scheme="minmax", rounding="stochastic", nonfinite="propagate"
        )


def test_a_spec_and_a_split_hash_anew_in_another_process():
    """A split caches its hash (a collective looks it up on every call); a pickled one must not
    carry it to a process whose string hashes differ, where it would miss every lookup. A spec
    (its hash from its fields) and a split both work as keys there."""
    import pickle
    import subprocess
    import sys

    from qsdp.comm import Split

    spec = QuantSpec(8, 128, "absmax", "nearest", nonfinite="propagate")
    split = Split.of([(3, True), (2, False)], raw_names=("ln.weight",))
    assert {spec: 1}[QuantSpec(8, 128, "absmax", "nearest", nonfinite="propagate")] == 1
    assert {split: 1}[Split.of([(3, True), (2, False)], raw_names=("ln.weight",))] == 1
    # another group's equal split (its parameters named otherwise) is the same key: the groups
    # of equal blocks share a replayed site's buffers ([Note: codec segments replayed])
    other = Split.of([(3, True), (2, False)], raw_names=("blocks.1.ln.weight",))
    assert other == split and {split: 1}[other] == 1 and other.raw_names != split.raw_names
    assert Split.of([(2, True), (3, False)]) != split  # (the runs are what a split is)
    code = (
        "import pickle, sys\n"
        "from qsdp.comm import Split\n"
        "from qsdp.quant import QuantSpec\n"
        "spec, split = pickle.loads(sys.stdin.buffer.read())\n"
        "print({spec: 1}.get(QuantSpec(8, 128, 'absmax', 'nearest', nonfinite='propagate')),\n"
        "      {split: 1}.get(Split.of([(3, True), (2, False)], raw_names=('ln.weight',))))\n"
    )
    env = {"PYTHONHASHSEED": "12345"}  # another process, other string hashes
    import os

    got = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps((spec, split)),
        capture_output=True,
        env={**os.environ, **env},
        check=True,
    )
    assert got.stdout.split() == [b"1", b"1"], got.stderr
