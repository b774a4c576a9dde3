"""``Schedule(gather_ahead=True)``: the next step's weights gathered in this step's backward.

The reference is staleness 1 as shipped without it (each forward gathers its predicted
weights): with a fused AdamW (the step the gather ahead takes on copies is the optimizer's own
kernel) every parameter ends the same bit for bit, on every rank, while the forwards after the
first predicted one are served from what the backward gathered (no all-gather in them). A
forward that is not the anticipated one (an evaluation, a parameter written after the step, no
step taken) gathers anew and lands where the reference lands."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import qsdp
from qsdp.fsdp._state import _installed
from qsdp.testing import assert_same_on_all_ranks, run_distributed

from ..models import batch, classifier

STEPS = 6


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def _model(kind: str, ahead: bool, *, fused: bool = True, nonfinite: str = "raise") -> tuple:
    """(model, comm state, AdamW): the classifier under FSDP2 with ``sdp4bit`` at staleness 1
    as shipped (``kind``: ``flat``, ``bf16`` compute, ``2level`` on 2 x 2)."""
    model = classifier()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"mp_policy": mp} if kind == "bf16" else {}
    for i in (2, 5):
        fully_shard(model[i], **kw)
    fully_shard(model, **kw)
    mesh = None
    if kind == "2level":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    schedule = qsdp.Schedule(staleness=1, start=0, gather_ahead=ahead)
    config = qsdp.recipe("sdp4bit", nonfinite=nonfinite)
    qsdp.compress_fsdp(model, config, mesh=mesh, schedule=schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused)
    return model, qsdp.fsdp.comm_state(model), opt


def _train(
    rank: int,
    kind: str,
    ahead: bool,
    *,
    fused: bool = True,
    between=None,
    micro: int = 1,
) -> dict:
    """``STEPS`` steps of the README loop (``micro`` micro-batches a step); ``between(step,
    model)`` runs after each step's ``optimizer.step()``. The parameters after the drained
    last step, and the gathers' counts."""
    model, state, opt = _model(kind, ahead, fused=fused)
    for step in range(STEPS):
        for k in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(k == micro - 1)
            _loss(model, rank, step * micro + k).backward()
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
        if between is not None:
            between(step, model)
    state.drain()
    opt.step()
    gathers = _installed(model).gathers
    return {
        "params": [p.full_tensor().detach().clone() for p in model.parameters()],
        "ahead": [g.gathered_ahead for g in gathers],
        "served": [g.served_ahead for g in gathers],
    }


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def _both(rank: int, world: int, kind: str) -> dict:
    want = _train(rank, kind, False)
    got = _train(rank, kind, True)
    assert_same_on_all_ranks(got["params"][0])
    return {"same": _same(want, got), "ahead": got["ahead"], "served": got["served"]}


@pytest.mark.parametrize("kind, world", [("flat", 3), ("bf16", 3), ("2level", 4), ("flat", 1)])
def test_gathered_ahead_the_run_is_the_shipped_one_bit_for_bit(kind, world):
    """Step 0 applies nothing; step 1 predicts nothing yet (the optimizer is learned at its
    first step); from step 2 on each backward gathers ahead (4 per group in 6 steps), and
    the forwards of steps 3-5 are served from it (3 per group). On one rank, with no peer to
    gather from: the same run, nothing gathered ahead or served."""
    n_ahead, n_served = (4, 3) if world > 1 else (0, 0)
    for got in run_distributed(_both, world, kind):
        want = {"same": True, "ahead": [n_ahead] * 3, "served": [n_served] * 3}
        assert got == want, got


def _wire(rank: int, world: int, ahead: bool) -> dict:
    """The weight differences' bytes each forward and each backward sent, step by step."""
    model, state, opt = _model("flat", ahead)
    stats = qsdp.fsdp.fsdp_comm_stats(model)
    sent = {"forward": [], "backward": []}
    for step in range(STEPS):
        for phase in ("forward", "backward"):
            before = stats["all_gather_diff"].bytes
            if phase == "forward":
                loss = _loss(model, rank, step)
            else:
                loss.backward()
            sent[phase].append(stats["all_gather_diff"].bytes - before)
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
    return sent


def test_a_forward_served_ahead_sends_nothing_and_the_bytes_move_to_the_backward():
    """From step 3 on the forwards send nothing and the backwards send what the shipped
    schedule's forwards send (step 2's backward the first gathers ahead): the same bytes in
    all, moved."""
    runs = run_distributed(_wire, 3, False), run_distributed(_wire, 3, True)
    for shipped, ahead in zip(*runs, strict=True):
        assert shipped["backward"] == [0] * STEPS, shipped
        assert ahead["forward"][:3] == shipped["forward"][:3], (shipped, ahead)
        assert ahead["forward"][3:] == [0, 0, 0], ahead
        assert ahead["backward"][2:5] == shipped["forward"][3:], (shipped, ahead)
        assert ahead["backward"][:2] == [0, 0] and ahead["backward"][5] > 0, ahead


def _interrupted(rank: int, world: int, fused: bool) -> dict:
    """Between steps 3 and 4 an evaluation forward, and after step 4's step a parameter of
    ``model[2]`` written in place: each forward after them gathers anew."""
    seen: dict[bool, list] = {False: [], True: []}

    def between(ahead: bool):
        def run(step: int, model: nn.Module) -> None:
            if step == 3:
                actual = model[2].weight.full_tensor().detach().clone()
                hook = model[2].register_forward_pre_hook(
                    lambda m, *_: seen[ahead].append((m.weight.detach() - actual).abs().max())
                )
                model.eval()
                with torch.no_grad():
                    _loss(model, rank, 99)
                model.train()
                hook.remove()
            if step == 4:
                with torch.no_grad():
                    model[2].weight.mul_(0.5)

        return run

    want = _train(rank, "flat", False, fused=fused, between=between(False))
    got = _train(rank, "flat", True, fused=fused, between=between(True))
    pairs = zip(want["params"], got["params"], strict=True)
    gap = max(float((a - b).abs().max()) for a, b in pairs)
    return {
        "eval_error": (float(seen[False][0]), float(seen[True][0])),
        "gap": gap,
        "served": got["served"],
    }


@pytest.mark.parametrize("fused", [True, False])
def test_an_evaluation_or_a_write_after_the_step_gathers_anew(fused):
    """The evaluation computes at the parameters as they are, within the weight differences'
    quantization as the shipped schedule's does (not at the predicted weights the backward
    gathered); step 3's forward was served, step 4's (after the evaluation) was not, and
    step 5's only for the groups not written. The evaluation's gather quantizes its
    difference against another reconstruction than the shipped run's, so the runs part in
    the last bits, which the next gathers correct."""
    for got in run_distributed(_interrupted, 3, fused):
        shipped, ahead = got["eval_error"]
        assert got["served"] == [2, 1, 2], got
        assert ahead < 3 * shipped, got
        assert got["gap"] < 1e-2, got


def _unstepped(rank: int, world: int) -> list[int]:
    """A step whose optimizer.step() is skipped (as a loss scaler skips one): the forward
    after it gathers anew, at the parameters as they are (the shipped schedule serves the
    predicted weights of the skipped step again, which the gather ahead overwrote)."""
    model, state, opt = _model("flat", True)
    for step in range(STEPS):
        _loss(model, rank, step).backward()
        if not state.applied_nothing and step != 3:
            opt.step()
        opt.zero_grad()
    return [g.served_ahead for g in _installed(model).gathers]


def test_a_skipped_step_is_never_served_ahead():
    for got in run_distributed(_unstepped, 3):
        assert got == [2, 2, 2], got  # steps 3 and 5; not 4


def _refused(rank: int, world: int) -> str:
    model = classifier()
    fully_shard(model)
    try:
        qsdp.compress_fsdp(
            model, "qsdp-w8g8", schedule=qsdp.Schedule(staleness=1, gather_ahead=True)
        )
    except ValueError as e:
        return str(e)
    return "accepted"


def test_gather_ahead_needs_weight_differences_and_a_prediction():
    for got in run_distributed(_refused, 2):
        assert "gathers no weight differences" in got and "drop gather_ahead" in got, got
    with pytest.raises(ValueError, match="there is no prediction"):
        qsdp.Schedule(staleness=1, predict="none", gather_ahead=True)
    with pytest.raises(ValueError, match="there is no prediction"):
        qsdp.Schedule(gather_ahead=True)
    with pytest.raises(ValueError, match="drop predict_clip or gather_ahead"):
        qsdp.Schedule(staleness=1, predict_clip=1.0, gather_ahead=True)
    with pytest.raises(TypeError, match="must be a bool"):
        qsdp.Schedule(staleness=1, gather_ahead=1)


def _nan(rank: int, world: int) -> list[float]:
    """Rank 1's gradient of step 3 is NaN: its estimate reaches step 3's gather ahead and its
    reduction step 4's, where the check zeroes it only when the backward ends."""
    model, state, opt = _model("flat", True, nonfinite="zero")
    losses = []
    for step in range(STEPS + 1):
        loss = _loss(model, rank, step)
        (loss * (float("nan") if (rank, step) == (1, 3) else 1.0)).backward()
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert_same_on_all_ranks(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
    assert state.zeroed > 0
    return losses + [min(g.served_ahead for g in _installed(model).gathers)]


def test_a_nan_gradient_never_reaches_the_weights_gathered_ahead():
    for got in run_distributed(_nan, 3):
        *losses, served = got
        assert all(math.isfinite(v) for v in losses) and served == 4, got


def _accumulated(rank: int, world: int) -> dict:
    """Two micro-batches a step: the first forward of a step is served from the gather made
    ahead, the second from the reconstruction, as the shipped schedule serves it."""
    want = _train(rank, "flat", False, micro=2)
    got = _train(rank, "flat", True, micro=2)
    return {"same": _same(want, got), "served": got["served"]}


def test_gradient_accumulation_gathered_ahead_is_the_shipped_run():
    for got in run_distributed(_accumulated, 3):
        assert got == {"same": True, "served": [3, 3, 3]}, got


def _another_optimizer_instead(rank: int, world: int) -> list[int]:
    """At step 3 the model's optimizer.step() is skipped and another optimizer (over a
    parameter of no model) steps: that is not the step the gather made ahead anticipated, so
    step 4's forward gathers anew (served: steps 3 and 5 only)."""
    model, state, opt = _model("flat", True)
    other = torch.zeros(1, requires_grad=True)
    sgd = torch.optim.SGD([other], lr=0.1)
    for step in range(STEPS):
        _loss(model, rank, step).backward()
        if step == 3:
            other.grad = torch.ones(1)
            sgd.step()
        elif not state.applied_nothing:
            opt.step()
        opt.zero_grad()
    return [g.served_ahead for g in _installed(model).gathers]


def test_another_optimizers_step_is_not_the_one_anticipated():
    for got in run_distributed(_another_optimizer_instead, 3):
        assert got == [2, 2, 2], got
