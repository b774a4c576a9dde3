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

[Note: a non-finite estimate predicts nothing]
An estimate is this rank's own gradient, before the ranks agree on NaN/Inf: a NaN there, which
the check zeroes when its reduction is applied, would reach the predicted weights, and through
the gathers every rank's forward. Under ``nonfinite="zero"`` that was for good: the NaN forward
made every later gradient NaN, every later estimate too, and every loss after it NaN (tested:
3 ranks, one NaN gradient on one rank, ``qsdp-w8g8``; without prediction the run went on). The
step takes 0 for an estimate's non-finite elements, in the kernel and in its reference alike.

[Note: the prediction in one kernel]
On CUDA the step is one Triton kernel (``qsdp.runtime._adam_triton``), one launch per group
([Note: one launch per group] there), that reads the parameters, their estimates and their
moments and writes the predicted values, cast, straight where they go (a gather's input, or
the parameters themselves): no float32 copies of the moments and the parameters (16 bytes an
element allocated per group at each gather, where the forward peaks) and one pass over memory
where the fused step above took seven launch sets (copies, the estimates' casts one launch per
tensor, the step, the cast into the gather's input). Under staleness 1 these launches sit
between two all-gathers on FSDP2's all-gather stream, where a forward waits for them
(profiled, 2x H200, GPT 1.42 B over sockets: ~1.7 ms between the gathers of each block, 41 ms
a forward, before the kernel). Elsewhere (CPU, non-contiguous tensors, float64) the fused step
above runs: it is the kernel's reference (``tests/runtime/test_adam_kernel.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .placement import local_of

__all__ = [
    "AdamStep",
    "adam_next",
    "check_adam",
    "clip_coefficient",
    "fp32_copies",
    "predict_step",
    "predicted_into",
    "square_norm",
    "stepped",
]


@dataclass(frozen=True, kw_only=True)
class AdamStep:
    """What one predicted Adam / AdamW step of a parameter group reads besides the values it
    moves: the kernel, its dispatch and its reference take it alike."""

    group: dict
    """The parameters' optimizer group (``lr``, ``betas``, ``eps``, ``weight_decay``)."""
    adamw: bool
    """The optimizer is AdamW (or Adam with ``decoupled_weight_decay=True``, read from
    ``group``)."""
    estimates: Sequence[torch.Tensor]
    """Each parameter's gradient estimate, its local tensor's element count."""
    states: Sequence[dict]
    """Each parameter's optimizer state (``step``, ``exp_avg``, ``exp_avg_sq``): read only."""
    clip_coef: float | torch.Tensor
    """What the estimates are multiplied by (gradient clipping): a number, or a 0-d float32
    tensor on the estimates' device, read there ([Note: a clipped prediction never reads the
    device])."""

    @functools.cached_property
    def moments(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each parameter's (``exp_avg``, ``exp_avg_sq``) local tensors, read once (a
        DTensor's ``to_local()`` costs the host every call)."""
        return [(local_of(s["exp_avg"]), local_of(s["exp_avg_sq"])) for s in self.states]


def square_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The squared 2-norm of ``tensors`` together, a 0-d float32 tensor on their device: one
    norm launch set over all of them (``torch._foreach_norm`` in float32), not three ops a
    tensor (a GPT block's 12 parameters, every group of the model, at every predicted step)."""
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def clip_coefficient(square: torch.Tensor, clip: float) -> torch.Tensor:
    """What ``clip_grad_norm_(max_norm=clip)`` multiplies a gradient of squared norm
    ``square`` by: ``min(1, clip / (norm + 1e-6))``, computed where ``square`` is.

    [Note: a clipped prediction never reads the device]
    Weight prediction with ``Schedule(predict_clip=...)`` clips each estimate by the norm of one
    whole estimate, which a collective sums over the ranks. The coefficient used to be read on
    the host (``float(norm)``) at the first forward of every predicted step: the host waited
    there for the device, for the backward's last estimate and the collective, while the
    delayed reductions it was meant to overlap were still queued. Now the coefficient stays a
    0-d tensor on the device and the prediction's kernel reads it there (its torch reference
    multiplies by it as a tensor): the same clip, computed in float32 instead of float64 (the
    coefficient may differ by one float32 rounding from the host's)."""
    return torch.clamp(clip / (square.sqrt() + 1e-6), max=1.0)


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
        # read by the host at every prediction: one held on a device would make the host wait
        # for it ([Note: step counts read where they are] in qsdp.runtime._adam_triton)
        betas = group.get("betas", ())
        hyper = {"lr": group.get("lr"), "eps": group.get("eps"), "beta1": betas[0]}
        hyper |= {"beta2": betas[1], "weight_decay": group.get("weight_decay")}
        for key, value in hyper.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                raise ValueError(
                    f"WeightPrediction(local=...): the optimizer's {key} is a tensor on "
                    f"{value.device}; the prediction reads it on the host at every gather, which "
                    f"would wait for the device each time: pass {key} as a float or a CPU tensor"
                )


@torch.no_grad()
def predicted_into(new: Sequence[torch.Tensor], step: AdamStep) -> None:
    """Move ``new`` (float32, each parameter's local values: the parameter itself or a copy)
    by the step ``optimizer.step()`` would take with ``step``'s estimates as gradients (times
    its ``clip_coef``), the optimizer's states read, not written ([Note: the prediction in one
    fused step]): torch's fused kernel, the reference of the Triton one."""
    estimates, states = step.estimates, step.states
    # [Note: a non-finite estimate predicts nothing]
    gs = [torch.nan_to_num(g.to(torch.float32), nan=0.0, posinf=0.0, neginf=0.0) for g in estimates]
    torch._foreach_mul_(gs, step.clip_coef)
    m = fp32_copies([m for m, _ in step.moments])
    v = fp32_copies([v for _, v in step.moments])
    values = [float(s["step"]) + 1 for s in states]
    device = new[0].device
    filled = {t: torch.full((), t, dtype=torch.float32, device=device) for t in set(values)}
    _fused_step(step, list(new), gs, m, v, [filled[t] for t in values])


def _fused_step(
    step: AdamStep,
    new: list[torch.Tensor],
    gs: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    counts: list[torch.Tensor],
) -> None:
    """torch's fused Adam / AdamW step of ``step``'s group over float32 ``new``, ``m``, ``v``
    (moved in place) with gradients ``gs``, at the step ``counts`` (one float32 tensor each on
    ``new``'s device, the step being taken)."""
    group = step.group
    # AdamW, or Adam(decoupled_weight_decay=True) of torch >= 2.6
    decoupled = group.get("decoupled_weight_decay", step.adamw)
    beta1, beta2 = group["betas"]
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(
        new,
        gs,
        m,
        v,
        [],
        counts,
        amsgrad=False,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


@torch.no_grad()
def stepped(xs: Sequence[torch.Tensor], step: AdamStep) -> tuple[list[torch.Tensor], list[dict]]:
    """Where ``optimizer.step()`` will leave ``xs`` (each parameter's local values) and its
    state when it applies ``step``'s estimates as the gradients (times its ``clip_coef``):
    float32 copies of the values and moments moved by torch's fused step, the optimizer's own
    state read, not written. Returns the new values and, per parameter, the state after the
    step (``step``, ``exp_avg``, ``exp_avg_sq``), from which :func:`predict_step` predicts the
    step after it (the gathers ahead: [Note: the next step's weights in this backward] in
    ``qsdp.runtime.gathered``). A parameter without state yet starts from zero moments, as
    the optimizer's first step does. ``step``'s estimates (the gradients) are float32 and
    finite: the caller sets non-finite elements to 0 ([Note: a non-finite estimate predicts
    nothing]), once for a whole flat buffer rather than once per tensor."""
    new = fp32_copies(xs)
    gs = list(step.estimates)
    if isinstance(step.clip_coef, torch.Tensor) or step.clip_coef != 1.0:
        torch._foreach_mul_(gs, step.clip_coef)
    ms, vs, counts = [], [], []
    for x, s in zip(new, step.states, strict=True):
        if s:
            ms.append(local_of(s["exp_avg"]))
            vs.append(local_of(s["exp_avg_sq"]))
            counts.append(s["step"])
        else:  # (the optimizer's first step for it: zero moments, count 0)
            ms.append(torch.zeros_like(x))
            vs.append(torch.zeros_like(x))
            counts.append(0.0)
    m, v = fp32_copies(ms), fp32_copies(vs)
    device = new[0].device
    on_device = [c for c in counts if isinstance(c, torch.Tensor) and c.device == device]
    if len(on_device) == len(counts):  # a fused or capturable optimizer's: no host read
        after = torch._foreach_add([c.to(torch.float32) for c in on_device], 1.0)
        kept: list = after
    else:
        kept = [float(c) + 1 for c in counts]
        filled = {t: torch.full((), t, dtype=torch.float32, device=device) for t in set(kept)}
        after = [filled[t] for t in kept]
    _fused_step(step, new, gs, m, v, after)
    states = [
        {"step": c, "exp_avg": mi, "exp_avg_sq": vi} for c, mi, vi in zip(kept, m, v, strict=True)
    ]
    return new, states


@torch.no_grad()
def adam_next(
    optimizer: torch.optim.Optimizer, estimates: dict, clip_coef: float | torch.Tensor
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
        step = AdamStep(
            group=group,
            adamw=adamw,
            estimates=[g for _, g, _ in picked],
            states=[s for _, _, s in picked],
            clip_coef=clip_coef,
        )
        predict_step(xs, xs=xs, step=step)  # moved in place
        saved += list(zip(xs, copies, strict=True))
    return saved


@torch.no_grad()
def predict_step(
    outs: Sequence[torch.Tensor], *, xs: Sequence[torch.Tensor], step: AdamStep
) -> None:
    """Write into ``outs[i]`` (its own dtype, cast; ``xs[i]`` itself to move it in place, or a
    tensor of its element count, read flat) the values of ``xs[i]`` after the step
    ``optimizer.step()`` would take with ``step``'s estimates as gradients: one kernel per
    group on CUDA, torch's fused step elsewhere ([Note: the prediction in one kernel])."""
    if _kernel_applies(outs, xs, step):
        from ._adam_triton import predict_into  # (triton imported on first use)

        predict_into(outs, xs=xs, step=step)
        return
    if all(o is x for o, x in zip(outs, xs, strict=True)):  # moved: fp32 ones in place
        new = [x.float() for x in xs]
    else:
        new = fp32_copies(xs)
    predicted_into(new, step)
    pairs = [(o, n.view(o.shape)) for o, n in zip(outs, new, strict=True) if o is not n]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [n for _, n in pairs])


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_applies(outs, xs, step: AdamStep) -> bool:
    """Whether the kernel computes this step: every tensor on CUDA, contiguous, of a dtype it
    reads in float32 without loss (not float64)."""
    ts = [*outs, *xs, *step.estimates, *(t for mv in step.moments for t in mv)]
    coef = step.clip_coef
    if isinstance(coef, torch.Tensor) and not (coef.is_cuda and coef.dtype == torch.float32):
        return False
    return all(t.is_cuda and t.is_contiguous() and t.dtype in _KERNEL_DTYPES for t in ts)


def fp32_copies(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New float32 tensors equal to ``ts`` (one launch set when they are float32 already)."""
    if all(t.dtype == torch.float32 for t in ts):
        return torch._foreach_mul(list(ts), 1.0)
    return [t.to(torch.float32, copy=True) for t in ts]
