"""Every bad input raises an error that names the value and the fix; nothing is sent silently."""

import subprocess
import sys

import pytest
import torch

from qsdp.quant import Encoded, QuantSpec, decode, decode_sum, encode, encode_diff

SPEC = QuantSpec(4, 64, "absmax", "stochastic")
BACKENDS = ["reference", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("scheme", ["absmax", "minmax", "shift-lattice"])
def test_nonfinite_raises_with_count(backend, bad, scheme):
    spec = QuantSpec(8, 64, scheme, "nearest")
    x = torch.randn(300)
    x[[3, 200, 201]] = bad
    with pytest.raises(ValueError, match=r"3 of 300 values are NaN or Inf.*nonfinite='propagate'"):
        encode(x, spec, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_propagate_marks_only_its_groups(backend):
    spec = QuantSpec(4, 64, "minmax", "nearest", nonfinite="propagate")
    x = torch.randn(300)
    x[70] = float("nan")
    x[250] = float("inf")
    y = decode(encode(x, spec, backend=backend), backend=backend)
    nan_groups = {1, 3}
    for g in range(5):
        chunk = y[g * 64 : (g + 1) * 64]
        if g in nan_groups:
            assert bool(torch.isnan(chunk).all())
        else:
            assert bool(torch.isfinite(chunk).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_difference_raises(backend):
    a = torch.tensor([1.0, float("inf"), 3.0])
    with pytest.raises(ValueError, match="1 of 3 values"):
        encode_diff(a, a.clone(), SPEC, backend=backend)  # inf - inf = nan


def test_wrong_types_and_dtypes():
    with pytest.raises(TypeError, match="dtype torch.int64"):
        encode(torch.arange(10), SPEC)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        encode([1.0, 2.0], SPEC)
    with pytest.raises(TypeError, match="spec must be a QuantSpec"):
        encode(torch.randn(4), {"bits": 4})
    with pytest.raises(TypeError, match="decode takes an Encoded"):
        decode(torch.zeros(4, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": -1}, r"seed=-1 must be an int in \[0, 2\*\*64\)"),
        ({"step": 2**32}, "step=4294967296"),
        ({"stream": 1.5}, "stream=1.5"),
        ({"backend": "cuda"}, "backend='cuda' must be"),
        ({"out": torch.empty(3, dtype=torch.uint8)}, "out must be 1-D uint8 of 58 bytes"),
    ],
)
def test_bad_keywords(kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode(torch.randn(100), SPEC, **kwargs)


def test_mismatched_shapes_and_payloads():
    with pytest.raises(ValueError, match="equal shapes"):
        encode_diff(torch.randn(4), torch.randn(5), SPEC)
    with pytest.raises(ValueError, match="Encoded payload must be 1-D uint8 of 58 bytes"):
        Encoded(
            payload=torch.zeros(10, dtype=torch.uint8), numel=100, dtype=torch.float32, spec=SPEC
        )
    with pytest.raises(ValueError, match=r"payloads must be uint8 \[k, 58\]"):
        decode_sum(torch.zeros(2, 50, dtype=torch.uint8), 100, SPEC)
    with pytest.raises(ValueError, match="accumulate=True"):
        decode_sum(torch.zeros(2, 58, dtype=torch.uint8), 100, SPEC, accumulate=True)
    enc = encode(torch.randn(100), SPEC)
    with pytest.raises(ValueError, match="contiguous tensor of 100 elements"):
        decode(enc, out=torch.empty(99))


def test_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        encode(torch.randn(10), SPEC, backend="triton")


def test_import_neither_loads_triton_nor_initialises_cuda():
    code = (
        "import sys, qsdp, qsdp.quant;"
        "assert 'triton' not in sys.modules, 'triton imported';"
        "import torch; assert not torch.cuda.is_initialized(), 'cuda initialised'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
