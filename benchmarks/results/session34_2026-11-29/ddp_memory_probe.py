"""The peak device memory of DDP steps, as run on 1x H200 in session 34 (calls 9 and 11):

    PYTHONPATH=src python benchmarks/results/session34_2026-11-29/ddp_memory_probe.py noop cgx \
        cgx+graphs

12 GPT blocks of d 768 (85.1 M parameters) in DDP buckets of 25 MiB on a fake group of 4
(``benchmarks/host_per_step.py``'s model and variants), four forward-backward steps each; prints
the peak memory allocated over what was allocated before the model was built."""

import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, "benchmarks")
import host_per_step  # noqa: E402 - benchmarks/ on the path first

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
for name in sys.argv[1:]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = host_per_step.build(name, 12, 768, block="gpt", device="cuda", ddp_bucket_kb=25600)
    x = torch.randn(4, 768, device="cuda")
    for _ in range(4):
        model(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(
        f"{name} params {params / 1e6:.1f} M, grads {params * 4 / 2**20:.0f} MiB, "
        f"peak {peak:.0f} MiB",
        flush=True,
    )
    del model
    torch.cuda.synchronize()
