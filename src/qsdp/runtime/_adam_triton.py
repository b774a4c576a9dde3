"""Triton kernel of weight prediction's Adam / AdamW step ([Note: the prediction in one kernel]
in ``qsdp.runtime.adam_step``): each parameter's predicted values written, cast, where they go.

Imported lazily (on CUDA, or by the tests under ``TRITON_INTERPRET=1``): ``import qsdp`` never
imports triton. The torch reference is ``adam_step.predicted_into`` (torch's own fused step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..quant._triton.kernels import _INTERPRETED, _cast_out, _load

if TYPE_CHECKING:
    from .adam_step import AdamStep

__all__ = ["adam_predict_kernel", "predict_into"]

#: Elements per program.
_BLOCK = 2048
_NUM_WARPS = 4


@triton.jit
def adam_predict_kernel(
    x_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
    n,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    coef,
    bias1,
    bias2_sqrt,
    DECOUPLED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out = x`` after one Adam (AdamW: ``DECOUPLED``) step with gradient ``g * coef`` (0
    where ``g`` is NaN or infinite, [Note: a non-finite estimate predicts nothing]) from
    moments ``m``, ``v`` (read, not written), in float32 as torch's fused kernel computes it,
    stored in ``out``'s dtype (rounded to nearest even). ``bias1``: ``1 - beta1^t``;
    ``bias2_sqrt``: ``sqrt(1 - beta2^t)``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # (the quantizers' float32 load and rounding store: exact for bf16 in the interpreter too)
    x = _load(x_ptr + offs, mask, TAIL=True)
    g = _load(g_ptr + offs, mask, TAIL=True)
    g = tl.where((g == g) & (tl.abs(g) != float("inf")), g, 0.0) * coef  # (non-finite: 0)
    m = _load(m_ptr + offs, mask, TAIL=True)
    v = _load(v_ptr + offs, mask, TAIL=True)
    if DECOUPLED:
        x = x - lr * weight_decay * x
    else:
        g = g + x * weight_decay
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = tl.sqrt(v) / bias2_sqrt + eps
    x = x - (lr / bias1) * m / denom
    out = _cast_out(x, DTYPE=out_ptr.dtype.element_ty, INTERPRET=_INTERPRETED)
    tl.store(out_ptr + offs, out, mask=mask)


def predict_into(
    outs: Sequence[torch.Tensor], *, xs: Sequence[torch.Tensor], step: AdamStep
) -> None:
    """One launch per parameter: ``outs[i]`` (contiguous, any float dtype; ``xs[i]`` itself to
    move it in place) gets ``xs[i]`` after the step ``optimizer.step()`` would take with
    ``step``'s estimate ``i`` (times its ``clip_coef``) from its state ``i``'s moments; every
    tensor contiguous with ``xs[i]``'s element count."""
    group = step.group
    decoupled = bool(group.get("decoupled_weight_decay", step.adamw))
    beta1, beta2 = (float(b) for b in group["betas"])
    for out, x, g, state, (m, v) in zip(
        outs, xs, step.estimates, step.states, step.moments, strict=True
    ):
        n = x.numel()
        t = float(state["step"]) + 1
        adam_predict_kernel[(triton.cdiv(n, _BLOCK),)](
            x_ptr=x,
            g_ptr=g,
            m_ptr=m,
            v_ptr=v,
            out_ptr=out,
            n=n,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            coef=float(step.clip_coef),
            bias1=1 - beta1**t,
            bias2_sqrt=math.sqrt(1 - beta2**t),
            DECOUPLED=decoupled,
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )
