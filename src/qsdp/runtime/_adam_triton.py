"""Triton kernel of weight prediction's Adam / AdamW step ([Note: the prediction in one kernel]
in ``qsdp.runtime.adam_step``): a parameter group's predicted values written, cast, where they
go, in one launch ([Note: one launch per group]).

Imported lazily (on CUDA, or by the tests under ``TRITON_INTERPRET=1``): ``import qsdp`` never
imports triton. The torch reference is ``adam_step.predicted_into`` (torch's own fused step).

[Note: one launch per group]
The prediction launched one kernel per parameter: twelve a GPT block, each through
``kernel[grid](...)``, whose argument binding cost ~56 us of the host a launch on the H200
machine (cProfile, ``benchmarks/host_per_step.py --device cuda``, 2026-11-28): 0.7 ms of host
per block gather, ~17 ms a step of the 1.42 B GPT, where staleness 1's compute stream waited
for the host 48 ms a step over sockets. Now one launch covers a group: each of the five tensor
sets (parameters, estimates, first and second moments, outputs) is passed as its first
tensor, and a device table holds every other tensor's element offset from it (tensors of one
set share a dtype, so any two of them are a whole number of elements apart, wherever they
live), with each program's parameter and first element. The table depends only on where the
tensors lie relative to each other and on their lengths, which a group keeps from step to
step (its parameters and moments stay where they are; its estimates and its gather's input are
new buffers each step, laid out alike): it is built once per layout and stream (copied from
pinned memory at the first step, the host never waiting) and looked up after that;
:data:`qsdp.quant._triton.tables.plans_built` counts the builds (``tables`` holds them, shared
with the other launches over many tensors). The grid's tables (each program's parameter: the
larger one) depend on the lengths alone and are kept apart, so a group whose buffers do move between
steps (the estimates of several DDP buckets) rebuilds only its offsets, a few words a tensor.
Where every tensor starts on a 16-byte boundary and every length is a multiple of 16 the
offsets are promised to the compiler (``ALIGNED``), so the loads stay vectorized as they were
with one tensor per launch (``tests/quant/compile_sm90.py`` counts them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..quant._triton import tables
from ..quant._triton.kernels import _INTERPRETED, _cast_out, _load

if TYPE_CHECKING:
    from .adam_step import AdamStep

__all__ = ["adam_predict_kernel", "predict_into"]

#: Elements per program.
_BLOCK = 2048
_NUM_WARPS = 4
_WHAT = "weight prediction's kernel"


@triton.jit
def _at(ptr, rel, offs, ALIGNED: tl.constexpr):
    """``ptr + rel + offs`` (``offs`` a program's contiguous block); with ALIGNED, ``rel`` a
    whole number of 16-byte words, promised to the compiler."""
    if ALIGNED:
        words: tl.constexpr = 16 // (ptr.dtype.element_ty.primitive_bitwidth // 8)
        return ptr + tl.max_contiguous(tl.multiple_of(rel + offs, words), words)
    return ptr + rel + offs


@triton.jit
def adam_predict_kernel(
    x_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
    t_ptr,
    coef_ptr,
    rel_ptr,
    numel_ptr,
    param_ptr,
    first_ptr,
    k,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    coef,
    bias1,
    bias2_sqrt,
    log_beta1,
    log_beta2,
    DECOUPLED: tl.constexpr,
    STEPS_HERE: tl.constexpr,
    COEF_HERE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """For the parameter ``i`` of this program (``param_ptr``; its first program
    ``first_ptr[i]``, its length ``numel_ptr[i]``): ``out = x`` after one Adam (AdamW:
    ``DECOUPLED``) step with gradient ``g * coef`` (0 where ``g`` is NaN or infinite, [Note: a
    non-finite estimate predicts nothing]) from moments ``m``, ``v`` (read, not written), in
    float32 as torch's fused kernel computes it, stored in ``out``'s dtype (rounded to nearest
    even). Tensor ``i`` of each set lies ``rel_ptr[s * k + i]`` elements from the set's first
    (``x``, ``g``, ``m``, ``v``, ``out``, ``t``: s = 0..5). ``bias1``: ``1 - beta1^t``;
    ``bias2_sqrt``: ``sqrt(1 - beta2^t)``; with STEPS_HERE each parameter's optimizer step
    count is read from the ``t`` set (a fused or capturable optimizer's, on the device) and
    the two are computed from it and ``log(beta)`` here, as torch's fused step does. With
    COEF_HERE ``coef`` is read from ``coef_ptr`` (a float32 on the device: [Note: a clipped
    prediction never reads the device] in ``qsdp.runtime.adam_step``).
    ALIGNED: every tensor starts on a 16-byte boundary and every length is a multiple of 16 (a
    mask the same over each vector: the loads stay vectorized)."""
    pid = tl.program_id(0)
    i = tl.load(param_ptr + pid)
    offs = (pid - tl.load(first_ptr + i)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(numel_ptr + i)
    if ALIGNED:
        n = tl.multiple_of(n, 16)
    mask = offs < n
    # (the quantizers' float32 load and rounding store: exact for bf16 in the interpreter too)
    x = _load(_at(x_ptr, tl.load(rel_ptr + i), offs, ALIGNED), mask, TAIL=True)
    g = _load(_at(g_ptr, tl.load(rel_ptr + k + i), offs, ALIGNED), mask, TAIL=True)
    m = _load(_at(m_ptr, tl.load(rel_ptr + 2 * k + i), offs, ALIGNED), mask, TAIL=True)
    v = _load(_at(v_ptr, tl.load(rel_ptr + 3 * k + i), offs, ALIGNED), mask, TAIL=True)
    if COEF_HERE:
        coef = tl.load(coef_ptr)
    g = tl.where(tl.abs(g) < float("inf"), g, 0.0) * coef  # (NaN compares false too)
    if DECOUPLED:
        x = x - lr * weight_decay * x
    else:
        g = g + x * weight_decay
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    if STEPS_HERE:  # (the step the prediction takes: the optimizer's count + 1)
        t = tl.load(_at(t_ptr, tl.load(rel_ptr + 5 * k + i), 0, False)).to(tl.float32) + 1.0
        bias1 = 1.0 - tl.exp(t * log_beta1)
        bias2_sqrt = tl.sqrt(1.0 - tl.exp(t * log_beta2))
    denom = tl.sqrt(v) / bias2_sqrt + eps
    x = x - (lr / bias1) * m / denom
    out = _cast_out(x, DTYPE=out_ptr.dtype.element_ty, INTERPRET=_INTERPRETED)
    tl.store(_at(out_ptr, tl.load(rel_ptr + 4 * k + i), offs, ALIGNED), out, mask=mask)


def _log(beta: float) -> float:
    """``log(beta)`` for the kernel's ``exp(t * log(beta))``; -inf for ``beta = 0`` (no
    momentum: ``0^t = 0`` for every step, where ``math.log`` raises)."""
    return math.log(beta) if beta > 0 else -math.inf


def _steps_here(steps: Sequence, device: torch.device) -> bool:
    """Whether every optimizer step count is a tensor on ``device`` (a fused or capturable
    optimizer's): the kernel reads them there ([Note: step counts read where they are])."""
    return all(isinstance(t, torch.Tensor) and t.device == device for t in steps)


def _host_counts(counts: Sequence) -> list[float]:
    """Each step count the host holds, plus one (the step about to be taken): the optimizer's
    CPU tensors read in one stack, not one ``item`` each (a GPT block's 12 parameters, every
    gather of a staleness-1 forward: issue 32's host); plain numbers as they are."""
    if all(isinstance(c, torch.Tensor) and c.dim() == 0 and c.device.type == "cpu" for c in counts):
        return [c + 1 for c in torch.stack(list(counts)).tolist()]
    return [float(c) + 1 for c in counts]


def _batches(sets: Sequence[list], live: list[int], taken: list) -> list[tuple[object, list[int]]]:
    """The launches of a group: ``(host step count + 1 or None, parameter indices)`` each; one
    for all ``live`` parameters where every set holds one dtype and the host's counts agree (a
    model's usual group), else one per distinct count and dtypes."""
    first = taken[0]
    if all(t == first for t in taken) and all(len({u.dtype for u in ts}) == 1 for ts in sets):
        return [(first, live)]
    batches: dict[tuple, list[int]] = {}
    for i, t in zip(live, taken, strict=True):
        dtypes = tuple(s[i].dtype for s in sets)
        batches.setdefault((t, dtypes), []).append(i)
    return [(t, picked) for (t, _), picked in batches.items()]


def predict_into(
    outs: Sequence[torch.Tensor], *, xs: Sequence[torch.Tensor], step: AdamStep
) -> None:
    """One launch per group ([Note: one launch per group]; more only where the parameters'
    dtypes differ, or their steps where the host holds them): ``outs[i]`` (contiguous, any
    float dtype; ``xs[i]`` itself to move it in place) gets ``xs[i]`` after the step
    ``optimizer.step()`` would take with ``step``'s estimate ``i`` (times its ``clip_coef``)
    from its state ``i``'s moments; every tensor contiguous with ``xs[i]``'s element count, on
    one device.

    [Note: step counts read where they are]
    The bias corrections need each parameter's step count. ``torch.optim`` keeps it on the host
    (a CPU tensor, read here without waiting for anything), except under ``fused=True`` or
    ``capturable=True``, where it lies on the device: reading it here made the host wait for
    the device once per parameter at every gather (a fused AdamW is common in GPT training).
    Those counts are read by the kernel instead, as a sixth set of the table, and the bias
    corrections computed there from ``log(beta)``, as torch's fused step computes them."""
    group = step.group
    decoupled = bool(group.get("decoupled_weight_decay", step.adamw))
    beta1, beta2 = (float(b) for b in group["betas"])
    live = [i for i, x in enumerate(xs) if x.numel()]
    if not live:
        return
    device = xs[live[0]].device
    counts = [s["step"] for s in step.states]
    here = _steps_here([counts[i] for i in live], device)
    sets = (list(xs), list(step.estimates), *map(list, zip(*step.moments, strict=True)), list(outs))
    if here:
        sets += (counts,)
    taken = _host_counts([counts[i] for i in live]) if not here else [None] * len(live)
    coef = step.clip_coef
    coef_here = isinstance(coef, torch.Tensor)
    if coef_here and (coef.device != device or coef.dtype != torch.float32 or coef.numel() != 1):
        raise ValueError(
            f"weight prediction's kernel: clip_coef must be a float or a one-element float32 "
            f"tensor on {device}, got {coef.dtype} of {coef.numel()} elements on {coef.device}"
        )
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    for t, picked in _batches(sets, live, taken):
        chosen = (
            sets
            if picked is live and len(live) == len(xs)
            else [[s[i] for i in picked] for s in sets]
        )
        numels = tuple(xs[i].numel() for i in picked)
        # (the sixth set, the step counts, read one scalar each: no alignment promised)
        layout = tables.layout_of(chosen, numels, aligned_sets=5, what=_WHAT)
        grid = tables.programs(device, stream, numels, block=_BLOCK)
        offsets = tables.offsets(device, stream, layout.rel)
        aligned = layout.aligned
        bias1, bias2_sqrt = (1.0, 1.0) if t is None else (1 - beta1**t, math.sqrt(1 - beta2**t))
        args = (
            *(ts[0] for ts in chosen[:5]),
            chosen[5][0] if here else chosen[0][0],  # (read only with STEPS_HERE)
            coef if coef_here else chosen[0][0],  # (read only with COEF_HERE)
            offsets,
            grid.numel,
            grid.param,
            grid.first,
            len(picked),
            float(group["lr"]),
            beta1,
            beta2,
            float(group["eps"]),
            float(group["weight_decay"]),
            1.0 if coef_here else float(coef),
            bias1,
            bias2_sqrt,
            _log(beta1),
            _log(beta2),
            decoupled,
            here,
            coef_here,
            aligned,
            _BLOCK,
        )
        # positional, no kernel[grid]: [Note: a launch's host cost] in qsdp.quant._triton.launch
        adam_predict_kernel.run(*args, grid=(grid.programs,), warmup=False, num_warps=_NUM_WARPS)
