"""Ad hoc (session 36): the host time of weight prediction's launcher for one 12-parameter group
(a GPT block's shapes, d 64), the Triton kernel a no-op (host_per_bucket's stubs), on the CPU.
Run from the repository root with PYTHONPATH=<a tree's src> (the old and new trees alternated):
prints the best of 7 rounds of 1500 calls, in microseconds a call."""

import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import host_per_bucket  # noqa: E402

host_per_bucket._stub_kernels()
from qsdp.runtime import adam_step  # noqa: E402

SHAPES = [(64,), (256, 64), (256,), (64, 256), (64,), (64,), (64,), (64, 64), (192,), (192, 64),
          (64,), (64,)]  # fmt: skip
params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
opt = torch.optim.AdamW(params, lr=1e-3)
for p in params:
    p.grad = torch.randn_like(p)
opt.step()
estimates = [torch.randn(p.shape) for p in params]
states = [opt.state[p] for p in params]
flat = torch.empty(sum(p.numel() for p in params))
outs = list(flat.split([p.numel() for p in params]))
xs = [p.detach() for p in params]


def once() -> None:
    step = adam_step.AdamStep(
        group=opt.param_groups[0], adamw=True, estimates=estimates, states=states, clip_coef=1.0
    )
    adam_step.predict_step(outs, xs=xs, step=step)


for _ in range(100):
    once()
best = float("inf")
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(1500):
        once()
    best = min(best, (time.perf_counter() - t0) / 1500 * 1e6)
print(f"{best:.1f}")
