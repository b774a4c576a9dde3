"""The kernels' parameter names against the names Triton keeps for itself at launch.

Kernels are launched by keyword. Under ``TRITON_INTERPRET=1`` (CI) a parameter named like a
launch option (``stream``, ``num_warps``, ...) passes, but a compiled launch asserts or takes
it as an option: a kernel parameter ``stream`` broke every GPU launch once. This test finds
that on the CPU."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import triton

from qsdp.quant._triton import kernels

# JITFunction.run's own keywords and the options _pack_args refuses outright
_LAUNCH_KEYWORDS = {"grid", "warmup", "device", "device_type", "stream"}


def _backend_options() -> set[str]:
    from triton.backends.nvidia.compiler import CUDAOptions

    return {f.name for f in dataclasses.fields(CUDAOptions)}


def _kernels() -> dict[str, triton.runtime.jit.KernelInterface]:
    """The launched kernels (compiled, or interpreted under ``TRITON_INTERPRET=1``)."""
    found = {
        name: obj
        for name, obj in vars(kernels).items()
        if isinstance(obj, triton.runtime.jit.KernelInterface) and name.endswith("_kernel")
    }
    assert found, "no launched kernels found in qsdp.quant._triton.kernels"
    return found


@pytest.mark.parametrize("name", sorted(_kernels()))
def test_kernel_parameters_are_not_launch_options(name):
    reserved = _LAUNCH_KEYWORDS | _backend_options()
    assert {"num_warps", "enable_fp_fusion"} <= reserved  # the options launch.py passes
    params = set(inspect.signature(_kernels()[name].fn).parameters)
    assert any(p.endswith("_ptr") for p in params)  # the signature was read
    clash = sorted(params & reserved)
    assert not clash, f"{name} has parameters named like Triton launch options: {clash}"
