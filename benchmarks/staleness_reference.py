"""Staleness 1 done by hand on one GPU, without qsdp's collectives: is the convergence study's
cost of staleness the one-step delay itself, and what does weight prediction recover?

GPT-125M on the debian-docs corpus with the study's data, schedule and optimizer (the batches of
4 ranks x MICRO sequences, one pass, AdamW 0.9/0.95, clipping 1.0, warm-up then cosine to a
tenth), bf16 autocast, one process. Variants (one run each, the same seed and data):

- ``sync``: each step applies its own gradient;
- ``delay``: each step applies the previous step's gradient (none at step 0; the last one by one
  more optimizer step), as ``staleness=1`` does;
- ``predict``: ``delay``, the gradient computed at the parameters plus the last update
  (``qsdp.WeightPrediction``, [Note: weight prediction]);
- ``local``: ``delay``, the gradient computed at the parameters AdamW would reach with the
  gradient in flight estimated by one rank's own (unreduced) gradient of the previous step: the
  next update's momentum part is known exactly, only the new gradient's share is estimated;
- ``blend``: ``local``, the estimate one rank's gradient and the momentum for the 3 others;
- ``oracle``: ``local`` with the reduced gradient in flight itself (a check of the prediction's
  arithmetic: it must train as ``sync`` does).

Writes one CSV per variant (step, loss, val_loss at the eval steps, grad norm) and prints the
final validation loss of each against ``sync``.

    PYTHONPATH=src python benchmarks/staleness_reference.py --data data/debian-docs-gpt2 \
        --out out/staleness_reference [--variants sync delay predict] [--lr 3e-4]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import time
from pathlib import Path

import torch

import qsdp
from qsdp_train.batches import Batches
from qsdp_train.data import open_data
from qsdp_train.model import GPT, PRESETS

RANKS = 4  # the study's GPUs: each step is the batches of 4 ranks


def lr_at(step: int, a: argparse.Namespace) -> float:
    """The trainer's schedule: linear warm-up, cosine to a tenth at the last step."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    floor = a.lr * 0.1
    return floor + 0.5 * (a.lr - floor) * (1 + math.cos(math.pi * progress))


def evaluate(model: GPT, batches: Batches, a: argparse.Namespace, device) -> float:
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for rank in range(RANKS):
            for x, y in batches.val_batches(
                10,
                rank=rank,
                world_size=RANKS,
                micro_batch=a.micro,
                block_size=PRESETS[a.preset].block_size,
            ):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    _, loss = model(x.to(device), y.to(device))
                total += float(loss) * x.numel()
                n += x.numel()
    model.train()
    return total / n


@torch.no_grad()
def adamw_ahead(opt: torch.optim.AdamW, estimate: dict, clip: float, blend: int = 1) -> list:
    """Move every parameter to where ``opt.step()`` would take it with the gradients
    ``estimate`` (clipped by their own global norm); returns the saved parameters. ``blend``
    ranks: the estimate is one rank's gradient, the other ``blend - 1`` ranks' are taken to be
    the momentum (bias-corrected)."""
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in estimate.values()])
    )
    scale = min(1.0, clip / (float(norm) + 1e-6))
    saved = []
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            state = opt.state.get(p)
            if not state or p not in estimate:
                continue
            t = float(state["step"]) + 1
            g = estimate[p] * scale
            if blend > 1:
                g = (g + state["exp_avg"] * ((blend - 1) / (1 - b1 ** (t - 1)))) / blend
            m = state["exp_avg"] * b1 + g * (1 - b1)
            v = state["exp_avg_sq"] * b2 + g * g * (1 - b2)
            denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
            saved.append((p, p.detach().clone()))
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1**t))
    return saved


def run(variant: str, a: argparse.Namespace, device: torch.device) -> float:
    data = open_data(Path(a.data))
    batches = Batches(data, order="pass")
    torch.manual_seed(0)
    model = GPT(PRESETS[a.preset].with_vocab(data.vocab_size)).to(device)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay}],
        lr=a.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        fused=device.type == "cuda",
    )
    predict = qsdp.WeightPrediction(opt) if variant == "predict" else None
    pending: list[torch.Tensor] | None = None
    estimate: dict = {}
    rows = []
    t0 = time.perf_counter()
    for step in range(a.steps + (variant != "sync")):
        last = step == a.steps  # the delayed variants' extra step: the last gradient
        # a delayed step applies the previous step's gradient at that step's rate, as
        # qsdp train does since 2026-11-27 ([Note: the delayed gradient's learning rate]; the
        # committed runs of 2026-11-26 used lr_at(step), the schedule shifted by a step)
        lr = lr_at(step - 1 if variant != "sync" and step > 0 else step, a)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        if not last:
            ahead = (
                predict.ahead(enabled=pending is not None) if predict else contextlib.nullcontext()
            )
            if variant == "oracle" and pending is not None:  # the reduced gradient itself
                estimate = dict(zip(params, pending, strict=True))
            saved = (
                adamw_ahead(opt, estimate, 1.0, blend=RANKS if variant == "blend" else 1)
                if variant in ("local", "blend", "oracle") and pending is not None and estimate
                else []
            )
            with ahead:
                for rank in range(RANKS):
                    x, y = batches.train_batch(
                        step,
                        0,
                        rank=rank,
                        world_size=RANKS,
                        micro_batch=a.micro,
                        block_size=PRESETS[a.preset].block_size,
                        seed=0,
                    )
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        _, loss = model(x.to(device), y.to(device))
                    (loss / RANKS).backward()
                    loss_sum += float(loss) / RANKS
                    if variant in ("local", "blend") and rank == 0:  # rank 0's own gradient
                        estimate = {p: p.grad.detach() * RANKS for p in params}
            with torch.no_grad():
                for p, x in saved:
                    p.copy_(x)
        grads = [p.grad for p in params] if not last else None
        if variant != "sync":  # apply the previous step's gradient, keep this one
            for p in params:
                p.grad = None
            apply, pending = pending, grads
            if apply is not None:
                for p, g in zip(params, apply, strict=True):
                    p.grad = g
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0) if params[0].grad is not None else None
        if norm is not None:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if last:
            break
        val = (
            evaluate(model, batches, a, device)
            if (step + 1) % 50 == 0 or step == a.steps - 1
            else None
        )
        rows.append(
            dict(
                step=step,
                loss=loss_sum,
                val_loss=val,
                grad_norm=None if norm is None else float(norm),
                lr=lr,
            )
        )
        if step % 50 == 0:
            print(
                f"{variant} step {step}: loss {loss_sum:.4f} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    final = rows[-1]["val_loss"]  # at the last step, as qsdp train's metrics
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{variant}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return final


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", nargs="+", default=["sync", "delay", "predict", "local"])
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--steps", type=int, default=356)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--preset", default="gpt-125m", choices=sorted(PRESETS))
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    finals = {}
    for v in a.variants:
        finals[v] = run(v, a, device)
        print(f"{v}: final val loss {finals[v]:.4f}", flush=True)
    base = finals.get("sync")
    summary = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": vars(a),
        "final_val_loss": finals,
        "vs_sync": {v: f / base - 1 for v, f in finals.items()} if base else None,
    }
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["vs_sync"]))


if __name__ == "__main__":
    main()
