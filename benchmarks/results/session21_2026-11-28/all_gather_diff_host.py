"""Host time of one weight-difference all-gather (SDP4Bit's, ``qsdp.comm.all_gather_diff``),
kernels stubbed and a fake process group of 4 ranks (benchmarks/host_per_bucket.py's setup):
qsdp's Python, torch op dispatch and the collective's call, no wire and no kernel time. A GPT
block's 12,288 elements, 4-bit Hadamard differences. Median over 500 calls; output:
all_gather_diff_host.txt (before: the per-rank decode_add loop, commit 89ca048; after:
one decode_rows(accumulate=True), commit 5cb5eba).

    PYTHONPATH=src python benchmarks/results/session21_2026-11-28/all_gather_diff_host.py
"""

import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from torch.testing._internal.distributed.fake_pg import FakeStore

import host_per_bucket as h
import qsdp.comm as qc
from qsdp.quant import QuantSpec

h._stub_kernels()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
spec = QuantSpec(
    bits=4,
    group_size=128,
    scheme="absmax",
    rounding="stochastic",
    hadamard_block=32,
    hadamard_seed=1,
    nonfinite="propagate",
)
m = 64 * 64 * 3
x = torch.randn(m)
out = torch.empty(4 * m)
recon = torch.zeros(4 * m)
ts = []
for i in range(600):
    t = time.perf_counter()
    qc.all_gather_diff(out, x, recon, spec=spec, step=i)
    ts.append(time.perf_counter() - t)
with torch.profiler.profile() as prof:
    qc.all_gather_diff(out, x, recon, spec=spec, step=999)
ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
us = statistics.median(ts[100:]) * 1e6
print(f"all_gather_diff: {us:.0f} us per call, {ops} top-level aten ops")
