"""Staleness 0 or 1 on a 6-layer d-384 GPT on CPU (FSDP2 over gloo, recipe bf16, no CUDA):
does the one-step delay alone cost what the GPU study measured? Prints step, loss averaged
over ranks, gradient norm (rank 0). ``LR``: the peak learning rate (3e-4).
``STALE_AFTER=N``: staleness 1 only from step N (the steps
before reduce and apply at once, under ``synchronous()``).

    PYTHONPATH=src torchrun --standalone --nproc-per-node 4 probe.py {0,1}
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import qsdp
from qsdp.train.batches import Batches
from qsdp.train.data import open_data
from qsdp.train.model import GPT, ModelConfig

DATA = os.environ.get("DATA", "data/debian-docs-gpt2")


def main(stale: int) -> None:
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=6, n_head=6, d_model=384, block_size=128, vocab_size=50257))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    qsdp.compress_fsdp(model, qsdp.recipe("bf16", staleness=stale))
    state = qsdp.fsdp.comm_state(model)
    peak = float(os.environ.get("LR", 3e-4))
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.1)
    data = Batches(open_data(DATA), order="pass")
    after = int(os.environ.get("STALE_AFTER", 0))
    mode = os.environ.get("PREDICT", "")
    predict = (
        qsdp.WeightPrediction(opt, local=state if mode == "local" else None)
        if stale and mode in ("1", "local")
        else None
    )
    for step in range(int(os.environ.get("STEPS", 40))):
        for group in opt.param_groups:
            group["lr"] = peak * min(1.0, (step + 1) / 50)
        x, y = data.train_batch(
            step, 0, rank=rank, world_size=ws, micro_batch=4, block_size=128, seed=0
        )
        sync = state.synchronous() if stale and step < after else contextlib.nullcontext()
        ahead = (
            predict.ahead(enabled=state.in_flight and step >= after, clip=1.0)
            if predict is not None
            else contextlib.nullcontext()
        )
        with sync, ahead:
            _, loss = model(x, y)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if not (stale and state.applied_nothing):  # the first stale step applies nothing
            opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"{step} {float(mean):.4f} {float(norm):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
