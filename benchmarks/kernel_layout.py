"""How the codec kernels' code stores and loads are laid out on a GPU, compiled without one.

    PYTHONPATH=src python benchmarks/kernel_layout.py --bits 2 3 4 6 8 [--out r.txt]

Compiles ``encode_kernel`` and ``decode_kernel`` for an sm_90 target (Triton needs no device
for that) at each width (absmax, nearest, groups of 128, no Hadamard: the tile the benchmarks
time) and prints, for the store (encode) and the load (decode) of the packed codes, the layout
the compiler chose (``threadsPerWarp``: how a warp's 32 lanes spread over the tensor's axes)
and the global byte accesses per thread in the PTX. A warp whose lanes sit in different groups'
rows touches one 32-byte sector per lane and instruction; lanes along consecutive bytes share a
sector. Static evidence, no timing: what it shows is checked on a GPU by ``bench_quant.py``.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qsdp.quant import QuantSpec  # noqa: E402
from qsdp.quant._triton import kernels as K  # noqa: E402
from qsdp.quant._triton import launch as L  # noqa: E402

_POINTERS = {
    "encode": {"x_ptr": "*fp32", "ref_ptr": "*fp32", "out_ptr": "*u8", "signs_ptr": "*fp32"},
    "decode": {"in_ptr": "*u8", "out_ptr": "*fp32", "signs_ptr": "*fp32"},
}
_INTS = ("numel", "scale_region", "n_code_bytes", "n_groups", "key0", "key1", "rng_stream")
_INTS += ("step", "pid_base", "chunk_stride", "row_stride", "out_row_stride")
_FLAGS = {
    "encode": {"HAS_REF": False},
    "decode": {"K": 1, "ACCUMULATE": False, "INTERPRET": False},
}


def compile_kernel(kind: str, bits: int, arch: int):
    """The compiled ``kind`` ("encode" or "decode") kernel of the benchmarks' tile at
    ``bits``, and its tile."""
    spec = QuantSpec(bits=bits, group_size=128, scheme="absmax", rounding="nearest")
    c = L._consts(spec, rotate=False, block=L._BLOCK)
    constexprs = {**c.tile, **c.codes, **c.quantize, **c.rotation, **_FLAGS[kind]}
    constexprs |= {"BIG": False, "ALIGNED": True, "TAIL": False}
    fn = K.encode_kernel if kind == "encode" else K.decode_kernel
    signature, fixed = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in _POINTERS[kind]:
            signature[name] = _POINTERS[kind][name]
        elif name in _INTS:
            signature[name] = "i32"
        elif name == "inv_sqrt_h":
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr"
            fixed[(i,)] = constexprs[name]
    source = ASTSource(fn=fn, signature=signature, constexprs=fixed)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(source, target=target, options={"num_warps": L._NUM_WARPS}), c


def describe(kind: str, bits: int, arch: int) -> str:
    kernel, c = compile_kernel(kind, bits, arch)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    layouts = dict(re.findall(r"^(#blocked\d*) = (#ttg\.blocked<\{.*\}>)", ttgir, re.M))
    # the codes' access: the one through i8 pointers (the scales are 32-bit words)
    op = "tt.store" if kind == "encode" else "tt.load"
    access = re.search(
        op.replace(".", "\\.") + r" .*tensor<([\dx]+)x!tt\.ptr<i8>, (#blocked\d*)>", ttgir
    )
    shape, layout = (access.group(1), layouts[access.group(2)]) if access else ("?", "?")
    warp = re.search(r"threadsPerWarp = \[([\d, ]+)\]", layout)
    ptx_op = "st.global" if kind == "encode" else "ld.global"
    per_thread = len(re.findall(ptx_op.replace(".", "\\.") + r"(\.[a-z]+)*\.(b8|u8)", ptx))
    return (
        f"{kind} bits {bits}: tile {dict(c.tile)}, codes as a {shape} tensor, threadsPerWarp "
        f"[{warp.group(1) if warp else '?'}] ({layout}); byte accesses per thread: {per_thread}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--arch", type=int, default=90, help="the CUDA compute capability (90: H100)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    lines = [f"triton {triton.__version__}, sm_{a.arch}"]
    lines += [describe(kind, b, a.arch) for kind in ("encode", "decode") for b in a.bits]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
