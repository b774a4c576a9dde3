"""The device memory ``Schedule(graphs=True)``'s replayed collectives hold, by FSDP module shape,
without a GPU: a GPT of the 1.42 B model's proportions, scaled down.

    PYTHONPATH=src python benchmarks/replay_buffers.py --out r.json

Each replayed collective keeps buffers per shape and stream for the whole run ([Note: codec
segments replayed] in ``qsdp.comm._graphs``); which FSDP modules replay is [Note: only repeated
shapes replayed] in ``qsdp.fsdp.api``. This builds ``bench_fsdp_step.py``'s GPT (24 blocks,
untied head) with d ``--d`` and the vocabulary scaled alike (50304 * d / 2048: the root, the
embeddings and the head, stays about four blocks' worth of parameters), every block
``fully_shard``-ed, on a ``fake`` process group of ``--world`` ranks on the CPU, the replays
run eagerly on their buffers (``CodecGraphs(capture=False)``: the buffers are allocated as on a
GPU, nothing captured) and every Triton kernel a no-op (``host_per_bucket.py``'s stubs), for
``--steps`` steps of AdamW. Prints and writes the bytes of the buffers per collective and shape,
which modules they serve, and the total per parameter of the model: the replays' share of the
memory a GPU run measures over the eager recipe (the CUDA graphs' own pools and the captured
kernels' temporaries come on top there). ``--all-modules`` replays every module, the root
too (the rule before 2026-11-29), for comparison.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import bench_fsdp_step  # benchmarks/, the script's own folder
import host_per_bucket
import qsdp
from qsdp import comm as qc
from qsdp.fsdp import api as fsdp_api
from qsdp_train.model import GPT


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (a buffer set: a tensor, or a dict, tuple or list of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return [t for o in vars(obj).values() for t in _tensors(o)] if hasattr(obj, "__dict__") else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipe", default="sdp4bit")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=24, help="blocks (the test: fewer, faster)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--all-modules", action="store_true", help="replay the root too")
    a = p.parse_args()
    host_per_bucket._stub_kernels()  # (the Triton path taken on the CPU, its kernels no-ops)
    made: list[qc.CodecGraphs] = []
    real = qc.CodecGraphs

    def graphs() -> qc.CodecGraphs:  # the replays' buffers as on a GPU, nothing captured
        made.append(real(capture=False))
        return made[-1]

    fsdp_api.qc.CodecGraphs = type(  # (this process only: the check and the factory)
        "CPUCodecGraphs",
        (),
        {"__new__": lambda cls: graphs(), "check_parameters": staticmethod(lambda ps: None)},
    )
    if a.all_modules:
        fsdp_api.repeated_shapes = lambda groups: frozenset(
            i for i, g in enumerate(groups) if g.params
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.world)
    scale = a.d / 2048
    config = replace(
        bench_fsdp_step.GPT_1_4B, n_layer=a.layers, d_model=a.d, n_head=max(1, a.d // 128),
        block_size=64,
        vocab_size=int(50304 * scale) // 64 * 64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    qsdp.compress_fsdp(model, a.recipe, schedule=qsdp.Schedule(graphs=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, config.vocab_size, (2, 16))
    for _ in range(a.steps):
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for g in made:
        for key, value in g._buffers.items():
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(value))
            rows.append({"key": str(key[0]) if isinstance(key, tuple) else str(key),
                         "numel": next((k for k in key if isinstance(k, int) and k > 1), None)
                         if isinstance(key, tuple) else None, "bytes": nbytes})  # fmt: skip
    total = sum(r["bytes"] for r in rows)
    groups = qsdp.fsdp.fsdp_groups(model)
    out = {
        "benchmark": "replay_buffers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": f"cpu ({platform.machine()}): buffers only, no GPU",
        "recipe": a.recipe,
        "world_size": a.world,
        "model": {"layers": config.n_layer, "d": a.d, "vocab": config.vocab_size},
        "params": params,
        "root_params": sum(p.numel() for g in groups if g.name == "" for p in g.params),
        "block_params": sum(p.numel() for p in model.blocks[0].parameters()),
        "replayed_modules": "all" if a.all_modules else "repeated shapes",
        "rows": rows,
        "total_bytes": total,
        "bytes_per_param": total / params,
    }
    a.out.write_text(json.dumps(out, indent=1))
    for r in rows:
        print(f"{r['key']:<40} {r['numel']!s:>12} {r['bytes']:>14,} B")
    print(f"total {total:,} B = {total / params:.3f} B a parameter ({params:,} parameters)")


if __name__ == "__main__":
    main()
