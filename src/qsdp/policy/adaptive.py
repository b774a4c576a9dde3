"""Layer-wise adaptive bit widths (CGX): the fewest bytes at no more error than a uniform width.

[Note: choosing widths]
Each compressed parameter group ``i`` can travel at any width ``w`` of a set (``WIDTHS``: those
the payload format packs), costing ``bytes[i][w]`` (the quantizer's payload) and adding
``error[i][w]`` (its squared quantization error, measured on the group's real gradients by
:func:`measure_errors`). Squared errors of independent groups add, so the plan is a
multiple-choice knapsack: choose one width per group to minimise the total bytes subject to the
total error staying within the uniform reference's (every group at ``reference`` bits).

:func:`choose_widths` solves it exactly by dynamic programming over the groups, keeping only the
Pareto frontier of (bytes, error) of the partial plans: a partial plan that has more bytes and
no less error than another can never be completed into a better plan. The uniform reference is
itself a plan, so the problem is always feasible and the result never costs more bytes than it.
Partial plans that exceed the budget even with the least error the remaining groups can add are
dropped (exact). A frontier above ``max_points`` plans (hundreds of groups) is thinned to one
plan per byte grain, which bounds the bytes above the optimum by the grains (reported). Tested
against brute force on small cases.

The default set is every width the payload format packs, (2, 3, 4, 6, 8): the CGX paper's
in-between widths 3 and 6 let a group step down (or up) by less than a factor of two in bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..comm import group_device
from ..quant import BITS, QuantSpec, decode, encode

__all__ = ["WIDTHS", "WidthPlan", "agree", "choose_widths", "measure_errors"]

WIDTHS = BITS


@dataclass(frozen=True)
class WidthPlan:
    """One width per group, with what it costs and what the uniform reference would."""

    widths: tuple[int, ...]
    bytes: int
    error: float
    reference_bytes: int
    reference_error: float
    excess_bytes: int = 0
    """At most this many bytes above the optimum (0: exact; see :func:`choose_widths`)."""

    @property
    def bytes_saved(self) -> float:
        """The share of the reference's bytes the plan saves (0.25: a quarter fewer)."""
        return 1 - self.bytes / self.reference_bytes if self.reference_bytes else 0.0


def choose_widths(
    errors: Sequence[dict[int, float]],
    nbytes: Sequence[dict[int, int]],
    *,
    reference: int = 4,
    max_points: int = 4096,
) -> WidthPlan:
    """The fewest-bytes widths with total error at most the uniform ``reference``'s.

    Exact while the Pareto frontier holds at most ``max_points`` partial plans (always on small
    cases); beyond, the frontier is thinned to one plan per byte grain, and the result is within
    :attr:`WidthPlan.excess_bytes` (the grains summed) of the optimum.

    Args:
        errors: per group, the squared error at each width (the same widths for every group).
        nbytes: per group, the payload bytes at each width.
        reference: the uniform width the error budget comes from; one of the widths.
        max_points: the frontier's size above which it is thinned.

    Raises:
        ValueError: no groups, groups with different widths, a reference not among them, or a
            negative or non-finite error.
    """
    if not errors or len(errors) != len(nbytes):
        raise ValueError(
            f"choose_widths needs one error and one byte table per group; got {len(errors)} "
            f"and {len(nbytes)}"
        )
    widths = sorted(errors[0])
    for i, (e, b) in enumerate(zip(errors, nbytes, strict=True)):
        if sorted(e) != widths or sorted(b) != widths:
            raise ValueError(
                f"group {i} has widths {sorted(e)} (errors) and {sorted(b)} (bytes); every "
                f"group must offer the same {widths}"
            )
        bad = [w for w, v in e.items() if not (v >= 0 and v != float("inf"))]
        if bad:
            raise ValueError(
                f"group {i}'s squared error at widths {bad} is {[e[w] for w in bad]}: errors "
                "must be finite and >= 0 (a NaN/Inf gradient cannot be measured)"
            )
    if reference not in widths:
        raise ValueError(f"reference width {reference} is not among the widths {widths}")
    budget = sum(e[reference] for e in errors)
    slack = budget * 1e-12  # a tolerance for the float sums' order
    # the least error the groups after each one can add: a partial plan above the budget minus
    # that can never be completed (exact pruning)
    least = [0.0] * (len(errors) + 1)
    for i in range(len(errors) - 1, -1, -1):
        least[i] = least[i + 1] + min(errors[i].values())
    # (bytes, error, choice index into `trail`); frontier sorted by bytes, error decreasing
    frontier: list[tuple[int, float, int]] = [(0, 0.0, -1)]
    trail: list[tuple[int, int]] = []  # (parent index, width)
    excess = 0
    for i, (e, b) in enumerate(zip(errors, nbytes, strict=True)):
        room = budget + slack - least[i + 1]
        candidates = []
        for nb, ne, parent in frontier:
            for w in widths:
                if ne + e[w] <= room:
                    candidates.append((nb + b[w], ne + e[w], parent, w))
        candidates.sort(key=lambda c: (c[0], c[1]))
        kept = []
        best = float("inf")
        for c in candidates:
            if c[1] < best:  # fewer bytes came first: keep only if it lowers the error
                best = c[1]
                kept.append(c)
        if len(kept) > max_points:  # thin: one point per byte grain (see the docstring)
            grain = -(-(kept[-1][0] - kept[0][0]) // max_points)
            excess += grain
            thinned, last = [], None
            for c in kept:  # the lowest error of each grain is its last point
                cell = (c[0] - kept[0][0]) // grain
                if thinned and cell == last:
                    thinned[-1] = c
                else:
                    thinned.append(c)
                last = cell
            kept = thinned
        frontier = []
        for nb, ne, parent, w in kept:
            trail.append((parent, w))
            frontier.append((nb, ne, len(trail) - 1))
    # the fewest bytes within the budget (every point left is within it)
    nb, ne, index = next(p for p in frontier if p[1] <= budget + slack)
    chosen = []
    while index >= 0:
        parent, w = trail[index]
        chosen.append(w)
        index = parent
    return WidthPlan(
        widths=tuple(reversed(chosen)),
        bytes=nb,
        error=ne,
        reference_bytes=sum(b[reference] for b in nbytes),
        reference_error=budget,
        excess_bytes=excess,
    )


def measure_errors(
    groups: Sequence[torch.Tensor],
    spec: QuantSpec,
    *,
    widths: Sequence[int] = WIDTHS,
    sample: int = 1 << 16,
    seed: int = 0,
    relative: bool = False,
) -> tuple[list[dict[int, float]], list[dict[int, int]]]:
    """Each group's squared quantization error and payload bytes at each width (``relative``:
    the error over the group's mean squared gradient, as measured on the sample).

    The error is measured on up to ``sample`` elements of the group (whole quantization groups,
    evenly spaced through it) with ``spec`` at each width (its scheme, group size, rounding and
    rotation) on the group's device, and scaled up to the group's size; the bytes are the full
    group's payload. One encode and decode per group and width.
    """
    errors, nbytes = [], []
    for i, g in enumerate(groups):
        flat = g.detach().reshape(-1).float()
        part = _sample(flat, spec.group_size, sample)
        scale = flat.numel() / max(part.numel(), 1)
        if relative:  # over the mean square (a group of zeros has no error to weigh)
            scale /= float(part.square().mean()) or 1.0
        err, size = {}, {}
        for w in widths:
            s = replace(spec, bits=w, nonfinite="propagate")
            approx = decode(encode(part, s, seed=seed, step=i))
            err[w] = float((approx.float() - part).square().sum()) * scale
            size[w] = s.payload_bytes(flat.numel())
        errors.append(err)
        nbytes.append(size)
    return errors, nbytes


def _sample(flat: torch.Tensor, group: int, sample: int) -> torch.Tensor:
    """Up to ``sample`` elements of ``flat`` as whole quantization groups, evenly spaced."""
    n_groups = -(-flat.numel() // group)
    keep = max(1, sample // group)
    if n_groups <= keep:
        return flat
    starts = torch.linspace(0, n_groups - 1, keep, device=flat.device).long() * group
    index = (starts[:, None] + torch.arange(group, device=flat.device)).reshape(-1)
    return flat[index[index < flat.numel()]]


def agree(widths: Sequence[int], group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
    """Rank 0's ``widths`` on every rank of ``group`` (payload sizes must match on all ranks).
    Every rank calls it with as many widths (its own plan's, or its current ones)."""
    widths = torch.tensor(tuple(widths), dtype=torch.int32, device=group_device(group))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(widths, src=src, group=group)
    return tuple(int(w) for w in widths.tolist())
