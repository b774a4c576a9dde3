"""Adaptive widths: the knapsack is exact (brute force on small cases), never costs more bytes
than the uniform reference, measures errors that fall with width, and every rank applies rank
0's plan."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import qsdp
from qsdp import QuantSpec
from qsdp.policy.adaptive import agree, choose_widths, measure_errors
from qsdp.testing import run_distributed

SPEC = QuantSpec(bits=4, group_size=128, scheme="minmax", rounding="stochastic")


def _brute(errors, nbytes, reference):
    budget = sum(e[reference] for e in errors)
    best = None
    for combo in itertools.product(*[sorted(e) for e in errors]):
        b = sum(nb[w] for nb, w in zip(nbytes, combo, strict=True))
        e = sum(er[w] for er, w in zip(errors, combo, strict=True))
        if e <= budget * (1 + 1e-12) and (best is None or b < best[0]):
            best = (b, e)
    return best


def _case(rng: random.Random, groups: int):
    errors, nbytes = [], []
    for _ in range(groups):
        n = rng.choice([256, 1000, 5000, 20000])
        spread = rng.uniform(0.01, 10)
        errors.append({w: spread * n * 4.0 ** (-w) * rng.uniform(0.5, 2) for w in (2, 4, 8)})
        nbytes.append({w: n * w // 8 + 8 * (n // 128 + 1) for w in (2, 4, 8)})
    return errors, nbytes


@pytest.mark.parametrize("seed", range(40))
def test_the_knapsack_matches_brute_force(seed):
    rng = random.Random(seed)
    errors, nbytes = _case(rng, rng.randint(1, 7))
    reference = rng.choice([2, 4, 8])
    plan = choose_widths(errors, nbytes, reference=reference)
    best_bytes, _ = _brute(errors, nbytes, reference)
    assert plan.bytes == best_bytes
    assert plan.error <= plan.reference_error * (1 + 1e-12)
    assert plan.bytes == sum(b[w] for b, w in zip(nbytes, plan.widths, strict=True))
    assert plan.bytes <= plan.reference_bytes


def test_a_hand_made_case():
    # two groups; budget = both at 4 bits
    nbytes = [{2: 250, 4: 500, 8: 1000}, {2: 25, 4: 50, 8: 100}]
    errors = [{2: 10.0, 4: 2.0, 8: 0.1}, {2: 50.0, 4: 3.0, 8: 0.2}]
    plan = choose_widths(errors, nbytes, reference=4)  # budget 5.0: nothing beats uniform
    assert plan.widths == (4, 4) and plan.bytes == plan.reference_bytes == 550
    # the big group now tolerates 2 bits if the small, spiky one gets 8: 350 bytes at error 1.2
    errors[0] = {2: 1.0, 4: 0.5, 8: 0.01}
    plan = choose_widths(errors, nbytes, reference=4)  # budget 3.5; (2, 4) would be 4.0
    assert plan.widths == (2, 8) and plan.bytes == 350 and plan.error == pytest.approx(1.2)
    assert plan.bytes_saved == pytest.approx(1 - 350 / 550)


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="one error and one byte table per group"):
        choose_widths([], [])
    with pytest.raises(ValueError, match="must offer the same"):
        choose_widths([{2: 1.0, 4: 0.5}], [{2: 1, 8: 2}])
    with pytest.raises(ValueError, match="must be finite"):
        choose_widths([{2: float("nan"), 4: 0.5}], [{2: 1, 4: 2}])
    with pytest.raises(ValueError, match="reference width 3"):
        choose_widths([{2: 1.0, 4: 0.5}], [{2: 1, 4: 2}], reference=3)


def test_measured_errors_fall_with_width_and_follow_the_spread():
    g = torch.Generator().manual_seed(0)
    smooth = torch.randn(40_000, generator=g) * 1e-3
    spiky = torch.randn(3_000, generator=g)
    spiky[::97] *= 50  # outliers widen each group's range
    errors, nbytes = measure_errors([smooth, spiky], SPEC, sample=8192)
    for e in errors:
        assert e[2] > e[4] > e[8] > 0
    assert nbytes[0][2] < nbytes[0][4] < nbytes[0][8]
    assert nbytes[0][4] == SPEC.payload_bytes(40_000)
    # the sampled error estimates the full one (whole groups, scaled to the size)
    full, _ = measure_errors([smooth], SPEC, sample=1 << 20)
    assert errors[0][4] == pytest.approx(full[0][4], rel=0.15)
    plan = choose_widths(errors, nbytes, reference=4)
    assert plan.bytes < plan.reference_bytes  # the tiny-error group gives bits away
    assert plan.widths[0] <= 4 <= plan.widths[1]


def test_relative_errors_ignore_a_groups_scale():
    # Adam's view: a group whose gradients are 1000x smaller tolerates no more relative error,
    # so it gets no fewer bits; the absolute budget hands its bits to the large group
    g = torch.Generator().manual_seed(1)
    big = torch.randn(40_000, generator=g)
    small = big.roll(1) * 1e-3
    absolute, nbytes = measure_errors([big, small], SPEC, sample=8192)
    relative, _ = measure_errors([big, small], SPEC, sample=8192, relative=True)
    for w in (2, 4, 8):
        assert absolute[1][w] == pytest.approx(absolute[0][w] * 1e-6, rel=0.1)
        assert relative[1][w] == pytest.approx(relative[0][w], rel=0.1)
        ms = float(big.square().mean())
        assert relative[0][w] == pytest.approx(absolute[0][w] / ms, rel=0.05)
    assert choose_widths(absolute, nbytes, reference=4).widths[1] < 4
    assert choose_widths(relative, nbytes, reference=4).widths == (4, 4)
    with pytest.raises(ValueError, match="AdaptiveWidths.error='squared' must be"):
        qsdp.AdaptiveWidths(error="squared")


def _agree(rank: int, world: int) -> tuple[int, ...]:
    # each rank measures its own gradients, so plans differ; rank 0's is applied everywhere
    errors = [{2: 1.0 + rank, 4: 0.5, 8: 0.1}, {2: 9.0, 4: 0.5 + rank, 8: 0.1}]
    nbytes = [{2: 10, 4: 20, 8: 40}, {2: 10, 4: 20, 8: 40}]
    return agree(choose_widths(errors, nbytes, reference=4).widths)


def test_every_rank_applies_rank_0s_plan():
    plans = run_distributed(_agree, 3)
    assert len(set(plans)) == 1
    assert (
        plans[0]
        == choose_widths(
            [{2: 1.0, 4: 0.5, 8: 0.1}, {2: 9.0, 4: 0.5, 8: 0.1}],
            [{2: 10, 4: 20, 8: 40}, {2: 10, 4: 20, 8: 40}],
            reference=4,
        ).widths
    )


@pytest.mark.parametrize("seed", range(10))
def test_a_thinned_frontier_stays_within_its_reported_excess(seed):
    rng = random.Random(100 + seed)
    errors, nbytes = _case(rng, 7)
    plan = choose_widths(errors, nbytes, reference=4, max_points=4)
    best_bytes, _ = _brute(errors, nbytes, 4)
    assert plan.error <= plan.reference_error * (1 + 1e-12)
    assert best_bytes <= plan.bytes <= best_bytes + plan.excess_bytes
    assert choose_widths(errors, nbytes, reference=4).excess_bytes == 0
