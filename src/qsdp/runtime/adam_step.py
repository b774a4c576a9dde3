"""Adam's and AdamW's next step as ``torch.optim`` computes it, taken on float32 values that are
not the parameters: where weight prediction puts the weights ([Note: weight prediction] in
``qsdp.runtime.prediction``), by moving the parameters (:func:`adam_next`) or only the weights an
all-gather sends (``qsdp.runtime.gathered``).

[Note: the prediction in one fused step]
The step is torch's own fused Adam / AdamW kernel (``torch._fused_adam_``, what ``fused=True``
runs; on CPU and CUDA) over float32 copies of the moments, so the optimizer's state is read and
never written: one launch set per parameter group, where the same step in ``torch._foreach_*``
ops took a dozen (sampled, 2x H200, GPT 1.42 B over sockets: the prediction held 24 ms of the
host's 222 ms a step). The steps it reads are filled on the device, one fill per distinct value:
a tensor built from a Python list is copied from pageable memory, which makes the host wait.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .placement import local_of

__all__ = ["adam_next", "check_adam", "fp32_copies", "predicted_into"]


def check_adam(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` takes the plain Adam / AdamW step :func:`predicted_into`
    computes."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(
            "WeightPrediction(local=...) computes the optimizer's next step and knows Adam and "
            f"AdamW, not {type(optimizer).__name__}: use WeightPrediction(optimizer) (the last "
            "update applied again)"
        )
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                raise ValueError(
                    f"WeightPrediction(local=...) computes Adam's plain step; {key}=True is not "
                    "it: use WeightPrediction(optimizer)"
                )


@torch.no_grad()
def predicted_into(
    new: Sequence[torch.Tensor],
    *,
    group: dict,
    adamw: bool,
    estimates: Sequence[torch.Tensor],
    states: Sequence[dict],
    clip_coef: float,
) -> None:
    """Move ``new`` (float32, each parameter's local values: the parameter itself or a copy)
    by the step ``optimizer.step()`` would take with the ``estimates`` as gradients (times
    ``clip_coef``), the optimizer's ``states`` read, not written ([Note: the prediction in one
    fused step]). ``group``: the parameters' optimizer group; ``adamw``: the optimizer is
    AdamW."""
    # AdamW, or Adam(decoupled_weight_decay=True) of torch >= 2.6
    decoupled = group.get("decoupled_weight_decay", adamw)
    beta1, beta2 = group["betas"]
    gs = torch._foreach_mul([g.to(torch.float32) for g in estimates], clip_coef)
    m = fp32_copies([local_of(s["exp_avg"]) for s in states])
    v = fp32_copies([local_of(s["exp_avg_sq"]) for s in states])
    values = [float(s["step"]) + 1 for s in states]
    device = new[0].device
    filled = {t: torch.full((), t, dtype=torch.float32, device=device) for t in set(values)}
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(
        list(new),
        gs,
        m,
        v,
        [],
        [filled[t] for t in values],
        amsgrad=False,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


@torch.no_grad()
def adam_next(
    optimizer: torch.optim.Optimizer, estimates: dict, clip_coef: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Move each parameter with an estimate and optimizer state to where ``optimizer.step()``
    would take it with that gradient (times ``clip_coef``); returns (local tensor, copy) to
    restore, bit for bit."""
    adamw = isinstance(optimizer, torch.optim.AdamW)
    saved = []
    for group in optimizer.param_groups:
        picked = [
            (p, estimates[p], optimizer.state[p])
            for p in group["params"]
            if p in estimates and optimizer.state.get(p)
        ]
        if not picked:
            continue
        xs = [local_of(p.detach()) for p, _, _ in picked]
        copies = torch._foreach_mul(xs, 1.0)  # (x * 1 is x, bit for bit: one launch set)
        new = [x.float() for x in xs]  # fp32 parameters: the tensors themselves, moved in place
        predicted_into(
            new,
            group=group,
            adamw=adamw,
            estimates=[g for _, g, _ in picked],
            states=[s for _, _, s in picked],
            clip_coef=clip_coef,
        )
        moved = [(x, n) for x, n in zip(xs, new, strict=True) if n is not x]  # (not fp32)
        if moved:
            torch._foreach_copy_([x for x, _ in moved], [n for _, n in moved])
        saved += list(zip(xs, copies, strict=True))
    return saved


def fp32_copies(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New float32 tensors equal to ``ts`` (one launch set when they are float32 already)."""
    if all(t.dtype == torch.float32 for t in ts):
        return torch._foreach_mul(list(ts), 1.0)
    return [t.to(torch.float32, copy=True) for t in ts]
