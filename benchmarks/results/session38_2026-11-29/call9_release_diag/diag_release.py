"""What holds an sdp4bit model's memory after del + gc on the GPU (session 38, call 9):
torchrun --nproc-per-node 4 diag_release.py [sdp4bit|cgx] [mesh|nomesh]."""

import gc
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import bench_fsdp_step
import qsdp
from qsdp_train.model import GPT

recipe, use_mesh = sys.argv[1], sys.argv[2] == "mesh"
dist.init_process_group("nccl")
rank = dist.get_rank()
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)


def gib():
    torch.cuda.synchronize()
    torch.empty(1, device=dev)
    return torch.cuda.memory_allocated(dev) / 2**30


def cuda_tensors():
    out = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda and o.numel() * o.element_size() > 2**20:
                out.append(o)
        except Exception:
            pass
    return out


def run():
    c = replace(bench_fsdp_step.GPT_1_4B, n_layer=4)
    torch.manual_seed(0)
    with dev:
        model = GPT(c)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    ws = dist.get_world_size()
    mesh = None
    if use_mesh:
        mesh = init_device_mesh("cuda", (1, ws), mesh_dim_names=("inter", "intra"))
    qsdp.compress_fsdp(model, recipe, **({"mesh": mesh} if mesh is not None else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, c.vocab_size, (2, 256), device=dev)
    for _ in range(3):
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    return params, mesh


base = gib()
params, mesh = run()
gc.collect()
torch.cuda.empty_cache()
after = gib()
held = cuda_tensors()
if rank == 0:
    print(
        f"{recipe} {'mesh' if use_mesh else 'nomesh'}: {params / 1e6:.0f} M params, bf16 copy "
        f"{params * 2 / 2**30:.3f} GiB; allocated {base:.3f} before, {after:.3f} after del+gc"
    )
    print(
        f"  python-visible CUDA tensors > 1 MiB: {len(held)}, "
        f"{sum(t.numel() * t.element_size() for t in held) / 2**30:.3f} GiB"
    )
    for t in held[:6]:
        refs = [type(r).__qualname__ for r in gc.get_referrers(t) if r is not held]
        print("   ", tuple(t.shape), t.dtype, "held by", refs[:5])
del held
dist.barrier()
a2 = gib()
x = torch.ones(1 << 20, device=dev)
dist.all_reduce(x)
if mesh is not None:
    for g in (mesh.get_group(0), mesh.get_group(1)):
        y = torch.ones(1 << 10, device=dev)
        dist.all_reduce(y, group=g)
a3 = gib()
from qsdp.runtime import streams  # noqa: E402

for g in list(streams._TWINS.values()):
    y = torch.ones(1 << 10, device=dev)
    dist.all_reduce(y, group=g)
a4 = gib()
if rank == 0:
    print(
        f"  after a barrier {a2:.3f}, after an all-reduce on the world and mesh groups {a3:.3f}, "
        f"after one on each of qsdp's {len(streams._TWINS)} twin groups {a4:.3f}"
    )
dist.destroy_process_group()
