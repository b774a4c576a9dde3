"""The one staleness core (``qsdp.runtime.delayed``) on its own, in one process: results applied
one step late per parameter, whatever layout the hooks send them in; drained with the sending
hook's NaN/Inf check; the checkpoint form per parameter. The integrations' end-to-end tests
(FSDP2, compressed HSDP, DDP against the delay done by hand) are in ``tests/fsdp`` and
``tests/ddp``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qsdp.runtime.delayed import (
    DelayedReductions,
    Slot,
    packed_slots,
    padded_slots,
    slot_views,
)


def _params(*sizes: int) -> dict[str, nn.Parameter]:
    return {f"p{i}": nn.Parameter(torch.zeros(n)) for i, n in enumerate(sizes)}


def _double(result: torch.Tensor, keep) -> None:
    """A stand-in reduction: the result is twice the input (written by ``send``'s launch)."""
    result.mul_(2)


class _Owner:
    def __init__(self) -> None:
        self.checked: list[torch.Tensor] = []

    def check_applied(self, flat: torch.Tensor) -> None:
        self.checked.append(flat.clone())
        flat.masked_fill_(~torch.isfinite(flat).all(), 0)


def test_results_are_applied_one_step_late_through_a_rebuilt_layout():
    params = _params(3, 2, 4)
    p0, p1, p2 = params.values()
    core = DelayedReductions(params)
    first = packed_slots([p0, p1, p2])  # one bucket
    bucket = torch.arange(9.0)
    assert core.previous(first, like=bucket) is None and core.applied_nothing
    core.send(
        _double, key=0, slots=first, like=bucket, input=bucket.clone(), owner=None, in_place=True
    )
    assert core.in_flight
    # the layout changes (DDP's rebuild): two buckets, another order
    a, b = packed_slots([p2, p0]), packed_slots([p1])
    got_a = core.previous(a, like=torch.empty(7))
    got_b = core.previous(b, like=torch.empty(2))
    assert not core.applied_nothing
    want = 2 * torch.arange(9.0)
    torch.testing.assert_close(got_a, torch.cat([want[5:9], want[0:3]]), rtol=0, atol=0)
    torch.testing.assert_close(got_b, want[3:5], rtol=0, atol=0)
    # the same layout as sent: the buffer itself, no copy
    core.send(_double, key=1, slots=a, like=got_a, input=torch.ones(7), owner=None, in_place=True)
    again = core.previous(a, like=torch.empty(7))
    assert again.data_ptr() == core._last[1].result.data_ptr()
    # pieces of two reductions (p1's from the first step), and zeros for a parameter with
    # nothing in flight
    fresh = nn.Parameter(torch.zeros(1))
    mixed = core.previous(packed_slots([p1, fresh, p2]), like=torch.empty(7))
    want = torch.tensor([6.0, 8.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    torch.testing.assert_close(mixed, want, rtol=0, atol=0)


def test_padded_slots_skip_the_padding_and_reuse_keeps_one_buffer():
    params = _params(3, 1)
    chunk = [(p, 4) for p in params.values()]  # FSDP2 pads each to 4 elements
    slots = padded_slots(chunk)
    assert slots == [Slot(params["p0"], 0, 3, (3,)), Slot(params["p1"], 4, 1, (1,))]
    core = DelayedReductions(params)
    out = torch.empty(8)

    def launch(result, keep):
        result.copy_(torch.arange(8.0))

    core.send(launch, key="hook", slots=slots, like=out, input=out, owner=None, reuse=True)
    buffer = core._last["hook"].result
    out.copy_(core.previous(slots, like=out))
    core.send(launch, key="hook", slots=slots, like=out, input=out, owner=None, reuse=True)
    assert core._last["hook"].result is buffer  # written again: its hook copied it out
    core.drain()
    torch.testing.assert_close(params["p0"].grad, torch.tensor([0.0, 1.0, 2.0]))
    torch.testing.assert_close(params["p1"].grad, torch.tensor([4.0]))
    assert not core.in_flight and core.applied_nothing


def test_drain_checks_each_reduction_with_the_hook_that_sent_it():
    params = _params(2, 2)
    p0, p1 = params.values()
    default, named = _Owner(), _Owner()
    core = DelayedReductions(params, owner=default)
    bad = torch.tensor([1.0, float("nan")])
    core.send(
        _double,
        key=0,
        slots=packed_slots([p0]),
        like=bad,
        input=bad.clone(),
        owner=None,
        in_place=True,
    )
    good = torch.tensor([1.0, 2.0])
    core.send(
        _double,
        key=1,
        slots=packed_slots([p1]),
        like=good,
        input=good.clone(),
        owner=named,
        in_place=True,
    )
    core.drain()
    assert len(default.checked) == 1 and len(named.checked) == 1
    torch.testing.assert_close(p0.grad, torch.zeros(2))  # zeroed by its owner's check
    torch.testing.assert_close(p1.grad, torch.tensor([2.0, 4.0]))


def test_a_synchronous_backward_with_a_reduction_in_flight_raises():
    params = _params(2)
    core = DelayedReductions(params)
    slots = packed_slots(params.values())
    core.check_synchronous(slots)  # nothing in flight: fine
    x = torch.ones(2)
    core.send(_double, key=0, slots=slots, like=x, input=x.clone(), owner=None, in_place=True)
    with pytest.raises(RuntimeError, match="call drain"):
        core.check_synchronous(slots)


def test_a_checkpoint_restores_each_hook_s_layout_and_its_estimates():
    params = _params(3, 1, 2)
    p0, p1, p2 = params.values()
    owner = _Owner()
    chunk = [(p0, 4), (p1, 4)]

    def build() -> DelayedReductions:
        core = DelayedReductions(params, local_tag="replica1")
        core.register(owner, padded_slots(chunk), size=8)
        core.keep_local_gradients()
        return core

    core = build()
    flat = torch.arange(8.0)
    core.send(
        _double,
        key="hook",
        slots=padded_slots(chunk),
        like=flat,
        input=flat.clone(),
        owner=owner,
        in_place=True,
        local=flat,
    )
    loose = torch.tensor([5.0, 6.0])
    core.send(
        _double,
        key="other",
        slots=packed_slots([p2]),
        like=loose,
        input=loose.clone(),
        owner=None,
        in_place=True,
        local=loose,
    )
    state = core.state_dict()
    starts = ["start.backwards", "start.started_at", "start.norms"]  # (when staleness started)
    assert sorted(state) == sorted(
        ["pending", *starts]
        + [f"pending.{n}" for n in params]
        + [f"local.replica1.{n}" for n in params]
    )
    assert all(
        v.dtype == torch.float32 for k, v in state.items() if k != "pending" and k not in starts
    )
    torch.testing.assert_close(state["pending.p0"], torch.tensor([0.0, 2.0, 4.0]))
    torch.testing.assert_close(state["local.replica1.p1"], torch.tensor([4.0]))

    restored = build()
    restored.load_state_dict({k: v.clone() for k, v in state.items()})
    assert restored.in_flight and not restored.applied_nothing
    # laid out as the hook sends (one buffer, padding zero): the hook's own layout comes back
    got = restored.previous(padded_slots(chunk), like=torch.empty(8))
    torch.testing.assert_close(got, torch.tensor([0.0, 2.0, 4.0, 0.0, 8.0, 0.0, 0.0, 0.0]))
    local = restored.local_gradients()
    torch.testing.assert_close(local[p2], loose)
    restored.drain()
    assert len(owner.checked) == 1  # the registered hook checked its buffer once
    torch.testing.assert_close(p2.grad, 2 * loose)

    empty = build()
    empty.load_state_dict({**state, "pending": torch.tensor([0])})
    assert not empty.in_flight and empty.applied_nothing


def test_slot_views_are_the_slots_pieces_from_one_split():
    """``slot_views``: the same views as slicing each slot (padding between them and after the
    last skipped), shaped or flat; slots out of order are sliced one by one; slots past the
    buffer's end are refused."""
    params = [
        nn.Parameter(torch.zeros(2, 3)),
        nn.Parameter(torch.zeros(5)),
        nn.Parameter(torch.zeros(1, 4)),
    ]
    slots = padded_slots([(params[0], 8), (params[1], 5), (params[2], 7)])
    flat = torch.arange(20.0)
    for shaped in (True, False):
        got = slot_views(flat, slots, shaped=shaped)
        want = [s.of(flat) if shaped else s.of(flat).view(-1) for s in slots]
        assert all(torch.equal(g, w) and g.shape == w.shape for g, w in zip(got, want, strict=True))
        assert all(g.data_ptr() == w.data_ptr() for g, w in zip(got, want, strict=True))
    backwards = list(reversed(slots))
    got = slot_views(flat, backwards)
    assert all(torch.equal(g, s.of(flat)) for g, s in zip(got, backwards, strict=True))
    with pytest.raises(ValueError, match="slots end at element 17 of a buffer of 16"):
        slot_views(torch.zeros(16), slots)
