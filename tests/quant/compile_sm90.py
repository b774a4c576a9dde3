"""Compile every Triton kernel of ``qsdp.quant`` (and weight prediction's, ``qsdp.runtime``)
for an H100 (sm_90) without a GPU and print, per kernel, the registers and spill bytes
``ptxas`` reports, as JSON (run by ``test_compile_sm90.py`` in a process of its own: the
tests' interpreter mode must be off when triton is imported)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qsdp.quant import QuantSpec  # noqa: E402
from qsdp.quant._triton import kernels as K  # noqa: E402
from qsdp.quant._triton import launch as L  # noqa: E402
from qsdp.runtime import _adam_triton as A  # noqa: E402

#: 8-bit and 4-bit groups as the recipes send them: CGX's min-max stochastic, SDP4Bit's rotated
#: absmax (Hadamard 32 with signs)
SPECS = {
    "minmax4-stochastic": QuantSpec(bits=4, group_size=256, scheme="minmax", rounding="stochastic"),
    "absmax8-h32": QuantSpec(
        bits=8,
        group_size=128,
        scheme="absmax",
        rounding="stochastic",
        hadamard_block=32,
        hadamard_seed=7,
    ),  # fmt: skip
}
FLOATS = {"inv_sqrt_h", "divisor", "limit", "lr", "beta1", "beta2", "eps", "weight_decay", "coef"}
FLOATS |= {"bias1", "bias2_sqrt", "log_beta1", "log_beta2"}


def _compile(fn, pointers: dict[str, str], constexprs: dict, aligned: bool = False) -> dict:
    """``aligned``: every pointer 16-byte aligned, as Triton's launcher specializes it when the
    tensor's address is."""
    signature, fixed = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
            fixed[(i,)] = constexprs[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in pointers}
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=fixed, attrs=attrs if aligned else None),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": L._NUM_WARPS},
    )
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
    )
    os.unlink(f.name)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {
        "registers": int(regs.group(1)),
        "spill_bytes": int(spills.group(1)),
        # global loads of 2 or 4 words at once (vectorized), and all global loads
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v[24]", kernel.asm["ptx"])),
        "loads": len(re.findall(r"ld\.global", kernel.asm["ptx"])),
    }


def main() -> None:
    results = {}
    codes_ptr = {"in_ptr": "*u8", "out_ptr": "*u8", "signs_ptr": "*fp32", "scale_ptr": "*fp32"}
    for name, spec in SPECS.items():
        c = L._consts(spec, rotate=True, block=L._BLOCK)
        flags = {"BIG": False, "ALIGNED": True}
        for tail in (False, True):
            enc = {**c.tile, **c.codes, **c.quantize, **c.rotation, **flags, "TAIL": tail}
            # (the step read from device memory: the launch a replayed CUDA graph holds)
            enc |= {"HAS_REF": True, "MULTI": True, "STEP_PTR": True}
            ptrs = {"x_ptr": "*bf16", "ref_ptr": "*bf16", "out_ptr": "*u8", "signs_ptr": "*fp32",
                    "streams_ptr": "*i64", "step_ptr": "*i64"}  # fmt: skip
            results[f"encode {name} tail={tail}"] = _compile(K.encode_kernel, ptrs, enc)
            dec = {**c.tile, **c.codes, **c.rotation, **flags, "TAIL": tail, "K": 3}
            dec |= {"ACCUMULATE": False, "INTERPRET": False, "HAS_BASE": True, "DIVIDE": True}
            ptrs = {"in_ptr": "*u8", "out_ptr": "*bf16", "signs_ptr": "*fp32", "base_ptr": "*bf16"}
            results[f"decode {name} tail={tail}"] = _compile(K.decode_kernel, ptrs, dec)
        c = L._consts(spec, rotate=False, block=L._BLOCK)
        dse = {**c.in_codes, **c.tile, **c.codes, **c.quantize, "K": 3, "BIG": False}
        # (the step read from device memory: a replayed two-level reduce-scatter's launch)
        dse |= {"IN_ALIGNED": True, "ALIGNED": True, "TAIL": True, "STEP_PTR": True}
        ptrs = {**codes_ptr, "step_ptr": "*i64"}
        results[f"decode_sum_encode {name}"] = _compile(K.decode_sum_encode_kernel, ptrs, dse)
    gi = {"ROWS": 16, "GROUP": 256, "STOCHASTIC": True, "BIG": False, "TAIL": True}
    ptrs = {"x_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*i8"}
    results["global_int_encode"] = _compile(K.global_int_encode_kernel, ptrs, gi)
    rf = {"BLOCK": 2048, "SEARCH": 4, "BIG": False}
    ptrs = {"x_ptr": "*bf16", "ends_ptr": "*i64", "flags_ptr": "*i32"}
    results["run_flags"] = _compile(K.run_flags_kernel, ptrs, rf)
    rs = {"K": 7, "DIVIDE": True, "BLOCK": 1024, "SEARCH": 4, "INTERPRET": False}
    ptrs = {"rows_ptr": "*bf16", "base_ptr": "*bf16", "out_ptr": "*bf16", "ends_ptr": "*i64",
            "starts_ptr": "*i64"}  # fmt: skip
    results["row_sum"] = _compile(K.row_sum_kernel, ptrs, rs)
    # a flagged result zeroed: written through its bits' integer type, the flag the one load
    zf = {"BLOCK": L._ZERO_BLOCK, "BIG": False}
    ptrs = {"x_ptr": "*i32", "flag_ptr": "*i32"}
    results["zero_flagged"] = _compile(K.zero_flagged_kernel, ptrs, zf)
    ptrs = {"x_ptr": "*i32", "flags_ptr": "*i32", "rel_ptr": "*i64", "numel_ptr": "*i64",
            "param_ptr": "*i32", "first_ptr": "*i32"}  # fmt: skip
    zfe = {"BLOCK": L._ZERO_BLOCK}
    results["zero_flagged_each"] = _compile(K.zero_flagged_each_kernel, ptrs, zfe)
    ptrs = {"x_ptr": "*fp32", "g_ptr": "*bf16", "m_ptr": "*fp32", "v_ptr": "*fp32",
            "out_ptr": "*bf16", "t_ptr": "*fp32", "coef_ptr": "*fp32", "rel_ptr": "*i64",
            "numel_ptr": "*i64",
            "param_ptr": "*i32", "first_ptr": "*i32"}  # fmt: skip
    # weight prediction's step, a group in one launch; its step counts read on the host or
    # by the kernel (a fused optimizer's)
    for decoupled, aligned, here in itertools.product((False, True), repeat=3):
        ap = {"DECOUPLED": decoupled, "ALIGNED": aligned, "STEPS_HERE": here, "BLOCK": A._BLOCK}
        name = f"adam_predict decoupled={decoupled} aligned={aligned} steps_here={here}"
        results[name] = _compile(
            A.adam_predict_kernel, ptrs, ap | {"COEF_HERE": False}, aligned=aligned
        )
    # the clip coefficient read on the device (Schedule(predict_clip=...))
    ap = {"DECOUPLED": True, "ALIGNED": True, "STEPS_HERE": True, "BLOCK": A._BLOCK}
    name = "adam_predict decoupled=True aligned=True steps_here=True coef_here=True"
    results[name] = _compile(A.adam_predict_kernel, ptrs, ap | {"COEF_HERE": True}, aligned=True)
    json.dump({"triton": triton.__version__, "kernels": results}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
