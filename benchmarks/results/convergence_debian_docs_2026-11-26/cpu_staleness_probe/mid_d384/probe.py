import os, sys, time, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import qsdp
from qsdp.train.model import GPT, ModelConfig
from qsdp.train.data import open_data
from qsdp.train.batches import Batches

def main(stale):
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mc = ModelConfig(n_layer=6, n_head=6, d_model=384, block_size=128, vocab_size=50257)
    model = GPT(mc)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    qsdp.compress_fsdp(model, qsdp.recipe("bf16", staleness=stale))
    state = qsdp.fsdp.comm_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = Batches(open_data("/work/main/data/debian-docs-gpt2"), order="pass")
    steps = int(os.environ.get("STEPS", 40))
    for step in range(steps):
        lr = 3e-4 * min(1.0, (step + 1) / 50)
        for g in opt.param_groups: g["lr"] = lr
        x, y = data.train_batch(step, 0, rank=rank, world_size=ws, micro_batch=4, block_size=128, seed=0)
        _, loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if not (stale and state.applied_nothing):
            opt.step()
        opt.zero_grad(set_to_none=True)
        l = loss.detach().clone(); dist.all_reduce(l, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"{step} {float(l):.4f} {float(norm):.3f}", flush=True)
    dist.destroy_process_group()

main(int(sys.argv[1]))
