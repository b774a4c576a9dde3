"""What bench_fsdp_step.run_variant leaves allocated on the GPU after it returns (session 39):
torchrun --nproc-per-node 2 probe_leftover.py [LAYERS [LOOP_STEPS [RECIPE ...]]]
(PYTHONPATH=src:benchmarks; RECIPE "plain" for plain FSDP2). Each variant:
its parameters' weak references after gc, the allocated bytes, and the CUDA tensors > 1 MiB that
Python still reaches with their holders' types."""

import argparse
import gc
import sys
import weakref
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

import bench_fsdp_step as b

dist.init_process_group("nccl")
rank = dist.get_rank()
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
refs = []
build = b.build


def recorded_build(*a, **k):
    m = build(*a, **k)
    refs.append(([weakref.ref(p) for p in m.parameters()], weakref.ref(m)))
    return m


b.build = recorded_build
args = argparse.Namespace(
    regime="nvlink",
    out=Path("/tmp/x.json"),
    recipes=None,
    hsdp=False,
    baselines=[],
    steps=2,
    rounds=1,
    warmup=1,
    loop_steps=int(sys.argv[2]) if len(sys.argv) > 2 else 2,
    batch=8,
    device="cuda",
    tiny=False,
    mem_trace=False,
    profile=None,
    mem_peak=None,
    cprofile=None,
    profile_all_ranks=False,
    bounds=False,
)
c = replace(b.GPT_1_4B, n_layer=int(sys.argv[1]) if len(sys.argv) > 1 else 4)
named = [None if r == "plain" else r for r in sys.argv[3:]]
for recipe in named or (None, "sdp4bit", "sdp4bit+graphs", "sdp4bit+s1", "cgx"):
    b.run_variant(str(recipe), c, args, dev, recipe, torch.bfloat16, torch.bfloat16)
    gc.collect()
    torch.cuda.empty_cache()
    prefs, mref = refs[-1]
    alive = [r() for r in prefs if r() is not None]
    left = b._allocated_now(dev) / 2**30
    held = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().nbytes() > 2**20:
                held.append(o)
        except Exception:
            pass
    if rank == 0:
        size = sum(t.untyped_storage().nbytes() for t in held) / 2**30
        print(
            f"{recipe}: model alive {mref() is not None}, params alive {len(alive)}/"
            f"{len(prefs)}, allocated {left:.3f} GiB, python-visible {len(held)} "
            f"tensors {size:.3f} GiB",
            flush=True,
        )
        for t in held[:5]:
            hold = [type(r).__qualname__ for r in gc.get_referrers(t) if r is not held]
            print("   ", tuple(t.shape), t.dtype, "held by", hold[:4], flush=True)
    del alive, held
dist.destroy_process_group()
