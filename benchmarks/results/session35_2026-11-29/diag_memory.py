"""Where the replayed codecs' memory goes (session 35, 1x H200): one variant per process.

    PYTHONPATH=src python benchmarks/results/session35_2026-11-29/diag_memory.py qsdp-w8g8+graphs

Prints the current and peak allocation after each step, the bytes of the captured sites' buffers
(unique storages) and the segments captured."""

import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, "benchmarks")
import host_per_step  # noqa: E402 - benchmarks/ on the path first
from qsdp.fsdp._state import _installed  # noqa: E402

name, mesh = sys.argv[1], "--mesh" in sys.argv
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
two = None
if mesh:
    from torch.distributed.device_mesh import init_device_mesh

    two = init_device_mesh("cuda", (2, 2), mesh_dim_names=("inter", "intra"))
base = torch.cuda.memory_allocated()
model = host_per_step.build(name, 8, 1024, block="gpt", device="cuda", mesh=two)
params = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(8, 1024, device="cuda")
mib = 2**20
for step in range(4):
    torch.cuda.reset_peak_memory_stats()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(
        f"{name} step {step}: now {(torch.cuda.memory_allocated() - base) / mib:.0f} MiB, "
        f"peak {(torch.cuda.max_memory_allocated() - base) / mib:.0f} MiB, "
        f"reserved {torch.cuda.memory_reserved() / mib:.0f} MiB",
        flush=True,
    )
hooks = _installed(model).hooks if name != "plain" else []
graphs = {id(g): g for h in hooks if (g := getattr(h, "graphs", None))}


def storages(obj, seen: dict[int, int]) -> None:
    """The bytes of each storage ``obj`` holds (tensors, in tuples, lists and dicts), by address."""
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            storages(o, seen)
    elif isinstance(obj, dict):
        for o in obj.values():
            storages(o, seen)


for g in graphs.values():
    held: dict[int, int] = {}
    for b in g._buffers.values():
        storages(b, held)
    print(
        f"  graphs: {len(g.sites)} sites, {len(g._buffers)} buffer sets of "
        f"{sum(held.values()) / mib:.0f} MiB, {g.captured} captured, {g.replayed} replayed; "
        f"params {params / 1e6:.1f} M",
        flush=True,
    )
