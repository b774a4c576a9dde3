"""Single-process pure-torch check: does a one-step delayed gradient (AdamW) cost what qsdp's
staleness 1 costs on the mid_d384 probe? VARIANT: sync | delay | predict | extrap (env STEPS,
LR, B1: Adam's beta1, TAU: the extrapolation's scale)."""

import os
import sys

import torch

from qsdp.train.batches import Batches
from qsdp.train.data import open_data
from qsdp.train.model import GPT, ModelConfig

torch.set_num_threads(2)
variant = sys.argv[1]
steps = int(os.environ.get("STEPS", 60))
peak = float(os.environ.get("LR", 3e-4))
torch.manual_seed(0)
model = GPT(ModelConfig(n_layer=6, n_head=6, d_model=384, block_size=128, vocab_size=50257))
params = [p for p in model.parameters()]
b1 = float(os.environ.get("B1", 0.9))
opt = torch.optim.AdamW(params, lr=peak, betas=(b1, 0.95), weight_decay=0.1)
data = Batches(open_data("data/debian-docs-gpt2"), order="pass")
pending = None
prev = None
for step in range(steps):
    lr = peak * min(1.0, (step + 1) / 50)
    for g in opt.param_groups:
        g["lr"] = lr
    xs, ys = zip(
        *[
            data.train_batch(step, 0, rank=r, world_size=4, micro_batch=4, block_size=128, seed=0)
            for r in range(4)
        ],
        strict=True,
    )
    x, y = torch.cat(xs), torch.cat(ys)
    saved = None
    if variant == "predict" and pending is not None:
        # evaluate at the predicted iterate: the in-flight update estimated by Adam's state
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                st = opt.state.get(p)
                if st:
                    t = st["step"]
                    m, v = st["exp_avg"], st["exp_avg_sq"]
                    bc1 = 1 - b1 ** float(t)
                    bc2 = 1 - 0.95 ** float(t)
                    p.sub_(lr * (m / bc1) / ((v / bc2).sqrt() + 1e-8))
    if variant == "extrap" and prev is not None:
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, q in zip(params, prev, strict=True):
                p.add_(p - q, alpha=float(os.environ.get("TAU", 1.0)))
    _, loss = model(x, y)
    loss.backward()
    if saved is not None:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    grads = [p.grad.detach().clone() for p in params]
    opt.zero_grad(set_to_none=True)
    if variant == "sync":
        apply = grads
    else:
        apply, pending = pending, grads
    if apply is not None:
        for p, g in zip(params, apply, strict=True):
            p.grad = g
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        prev = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        norm = torch.tensor(0.0)
    print(f"{step} {float(loss):.4f} {float(norm):.3f}", flush=True)
