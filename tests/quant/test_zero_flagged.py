"""``zero_flagged``: a tensor zeroed where a flag on the device is set. The Triton kernel
(interpreted on the CPU, compiled on a GPU) against the torch reference (``masked_fill_``), bit
for bit: a clear flag leaves every bit as it was (NaNs included), a set one writes +0.0 over
exactly the tensor, nothing beyond it; the bad inputs named."""

from __future__ import annotations

import pytest
import torch

from qsdp.quant import zero_flagged, zero_flagged_each
from qsdp.quant._triton import launch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# (one element; one program's worth less one; across programs with a partial last one)
LENGTHS = [1, launch._ZERO_BLOCK - 1, 2 * launch._ZERO_BLOCK + 5]


def _buffer(n, dtype, device="cpu"):
    """A buffer with ``n`` elements to zero between two guard runs, NaN and Inf among them."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n + 14, generator=g).to(dtype)
    x[3], x[-2] = float("nan"), float("inf")
    if n > 8:
        x[10] = float("nan")
    return x.to(device)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).cpu()


def _flags(set_, dtype, device="cpu"):
    """A flag as a view into a tensor of several (a verdict's ``unbind()``), at a nonzero
    offset."""
    many = torch.tensor([1, int(set_), 0], device=device).to(dtype)
    return many.unbind()[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.uint8, torch.bool])
def test_kernel_gives_the_reference_bits(dtype, n, flag_dtype, device="cpu"):
    for set_ in (False, True):
        want, got = _buffer(n, dtype, device), _buffer(n, dtype, device)
        before = _bits(want).clone()
        zero_flagged(want[7 : 7 + n], _flags(set_, flag_dtype, device), backend="reference")
        zero_flagged(got[7 : 7 + n], _flags(set_, flag_dtype, device), backend="triton")
        assert torch.equal(_bits(got), _bits(want)), (set_, dtype, n)
        inside = _bits(got)[7 : 7 + n]
        # clear: every bit kept (NaN and Inf too); set: +0.0 everywhere in x, nothing beyond
        assert torch.equal(inside, before[7 : 7 + n] if not set_ else torch.zeros_like(inside))
        assert torch.equal(_bits(got)[:7], before[:7])
        assert torch.equal(_bits(got)[7 + n :], before[7 + n :])


def test_a_two_dimensional_tensor_and_an_empty_one():
    x = torch.full((3, 5), float("nan"))
    zero_flagged(x, torch.ones(1, dtype=torch.int32), backend="triton")
    assert torch.equal(x, torch.zeros(3, 5)) and not torch.signbit(x).any()
    zero_flagged(torch.empty(0), torch.ones(1, dtype=torch.int32), backend="triton")


def test_bad_inputs_are_named():
    x = torch.ones(6)
    with pytest.raises(ValueError, match="one int32, uint8 or bool element, got torch.int32 of 2"):
        zero_flagged(x, torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="got torch.float32 of 1"):
        zero_flagged(x, torch.ones(()))
    with pytest.raises(ValueError, match=r"needs a contiguous x, got shape \(2, 3\)"):
        zero_flagged(x.view(3, 2).t(), torch.ones(1, dtype=torch.int32), backend="triton")
    before = torch.arange(6.0).view(3, 2)
    strided = before.t()  # the reference takes any layout
    zero_flagged(strided, torch.ones(1, dtype=torch.int32), backend="reference")
    assert not before.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernel_gives_the_reference_bits(dtype):
    for n in LENGTHS:
        for flag_dtype in (torch.int32, torch.bool):
            test_kernel_gives_the_reference_bits(dtype, n, flag_dtype, device="cuda")
    x = torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match="flag on cpu, x on cuda"):
        zero_flagged(x, torch.ones(1, dtype=torch.int32))


def _many(device="cpu"):
    """Tensors of three element sizes in separate storages and in one (two spans of a shared
    buffer, a gap between them), across programs and not, with their guards, and the flags."""
    pool = _buffer(2 * launch._ZERO_BLOCK + 40, torch.float32, device)
    xs = [
        pool[3 : 3 + launch._ZERO_BLOCK + 9],  # across programs
        pool[launch._ZERO_BLOCK + 20 : launch._ZERO_BLOCK + 31],  # the same storage, further on
        _buffer(5, torch.bfloat16, device)[7:12],
        _buffer(33, torch.float16, device)[7:40],
        _buffer(3, torch.float64, device)[7:10],
        _buffer(6, torch.float32, device)[7:13],
    ]
    return pool, xs


@pytest.mark.parametrize("pattern", [(1, 0, 1, 0, 1, 0), (0, 1, 0, 1, 0, 1), (0,) * 6, (1,) * 6])
def test_many_tensors_give_the_reference_bits(pattern, device="cpu"):
    flags = torch.tensor([0, *pattern[::-1]], dtype=torch.int32, device=device)
    which = [len(pattern) - j for j in range(len(pattern))]  # (each tensor's flag, reversed)
    got_pool, got = _many(device)
    want_pool, want = _many(device)
    bases = [x._base for x in got]
    before = [_bits(b).clone() for b in bases]
    zero_flagged_each(want, flags, which, backend="reference")
    zero_flagged_each(got, flags, which, backend="triton")
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(_bits(g._base), _bits(w._base)), j
        assert torch.equal(_bits(g), torch.zeros_like(_bits(g))) == bool(pattern[j]), j
    assert torch.equal(_bits(got_pool), _bits(want_pool))
    # outside the tensors, nothing written: the guards and the pool's gaps as they were
    for j, (b, old) in enumerate(zip(bases[2:], before[2:], strict=True)):
        assert torch.equal(_bits(b)[:7], old[:7]) and torch.equal(_bits(b)[-7:], old[-7:]), j
    pool_old = before[0]
    keep = torch.ones(got_pool.numel(), dtype=torch.bool)
    for x in got[:2]:
        keep[x.storage_offset() : x.storage_offset() + x.numel()] = False
    assert torch.equal(_bits(got_pool)[keep], pool_old[keep])  # (_bits is on the CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_many_tensors_give_the_reference_bits():
    for pattern in [(1, 0, 1, 0, 1, 0), (0,) * 6, (1,) * 6]:
        test_many_tensors_give_the_reference_bits(pattern, device="cuda")
