"""A collective call refused on one rank: every rank of it raises, when asked to check.

[Note: a call refused on one rank]
Each collective validates its arguments on the calling rank before its first exchange. Ranks
that run the same program pass the same shapes, dtypes and specs, and all raise together; but
a call made differently on one rank (a tensor of another length there, another quantizer, a
rank-dependent branch) raises on that rank alone, and its peers wait in the first exchange
until the process group's timeout, or, where payload sizes happen to match, decode garbage.
Agreeing on every call costs a collective and a host sync per call, too much for a DDP bucket
or an FSDP group, so it is opt-in, as torch's own collective checks are: with
``QSDP_CHECK_CALLS=1`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` each public collective of
``qsdp.comm`` (not the hierarchical one, whose first exchange is on a sub-mesh) starts with one
all-gather over its group of what each rank was asked to do: whether its checks passed (and
their error) and a description of the call (the function, every tensor's shape and dtype, the
quantizer, the split, the op and the noise key). Every rank then raises the same
``ValueError`` naming the ranks and their differences, or none does. The all-gather runs just
before the call's first exchange (the first ``torch.distributed`` call the collective would
make, see ``_common``), or, for a rank whose checks failed, in their place; a call that makes no
exchange on some rank still agrees on its way out.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from ._dist import dist_all_gather, group_device

__all__ = ["before_exchange", "checked", "checking"]

F = TypeVar("F", bound=Callable)
_TEXT = 480  # bytes of each rank's description or error in the all-gather
_IGNORED = {"stats", "async_op", "backend"}  # may differ between ranks without harm
_state = threading.local()


def checking() -> bool:
    """Whether calls are agreed on: ``QSDP_CHECK_CALLS=1`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    if os.environ.get("QSDP_CHECK_CALLS", "") not in ("", "0"):
        return True
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device.type}"
    if isinstance(value, dist.ProcessGroup):
        return f"group {dist.get_process_group_ranks(value)}"
    return repr(value)


def _call_text(name: str, arguments: dict) -> str:
    """The call as a text that ranks compare: a digest of the whole description first (a long
    split may be cut off in the all-gather), then the description."""
    parts = [
        f"{k}={_describe(v)}" for k, v in arguments.items() if k not in _IGNORED and v is not None
    ]
    text = f"{name}({', '.join(parts)})"
    return f"[{hashlib.sha256(text.encode()).hexdigest()[:12]}] {text}"


def _agree(group: dist.ProcessGroup | None, error: str | None) -> None:
    """One all-gather over ``group`` of ``[ok, text]``; raise on every rank unless every rank's
    checks passed and every rank describes the same call."""
    text = error if error is not None else _state.text
    raw = text.encode()[:_TEXT]
    mine = torch.zeros(1 + _TEXT, dtype=torch.uint8)
    mine[0] = 1 if error is None else 0
    mine[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    device = group_device(group)
    mine = mine.to(device)
    n = dist.get_world_size(group)
    every = torch.empty(n * (1 + _TEXT), dtype=torch.uint8, device=device)
    dist_all_gather()(every, mine, group=group)
    rows = every.cpu().view(n, 1 + _TEXT)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    ok = [bool(r[0]) for r in rows]
    texts = [bytes(r[1:].tolist()).rstrip(b"\0").decode(errors="replace") for r in rows]
    name = _state.name
    if not all(ok):
        refused = [f"rank {ranks[i]}: {texts[i]}" for i in range(n) if not ok[i]]
        raise ValueError(
            f"qsdp.comm.{name} was refused on {len(refused)} of {n} ranks, so no rank ran it "
            f"(QSDP_CHECK_CALLS): {'; '.join(refused)}"
        )
    if len(set(texts)) > 1:
        differ = [f"rank {ranks[i]}: {texts[i]}" for i in range(n) if texts[i] != texts[0]]
        raise ValueError(
            f"qsdp.comm.{name}: the ranks were asked for different calls, which would hang or "
            f"decode garbage (QSDP_CHECK_CALLS); rank {ranks[0]}: {texts[0]}; "
            f"{'; '.join(differ)}. Pass the same shapes, dtypes, quantizer, split, op and noise "
            "key on every rank"
        )


def before_exchange(group: dist.ProcessGroup | None) -> None:
    """Called by ``_common`` before each ``torch.distributed`` call of a collective: the first
    one of a checked call agrees on the call over ``group`` first."""
    if getattr(_state, "pending", False):
        _state.pending = False
        _agree(group, None)


def checked(name: str) -> Callable[[F], F]:
    """Decorate a public collective whose ``group`` argument is the group of its first exchange:
    see [Note: a call refused on one rank]. Without checking, a plain call."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not checking() or getattr(_state, "active", False) or not dist.is_initialized():
                return fn(*args, **kwargs)
            arguments = signature.bind(*args, **kwargs).arguments
            group = arguments.get("group")
            _state.active, _state.pending, _state.name = True, True, name
            try:
                _state.text = _call_text(name, arguments)
                result = fn(*args, **kwargs)
            except (ValueError, TypeError) as e:
                if not _state.pending:  # raised after the agreement: on every rank alike
                    raise
                _state.pending = False
                _agree(group, f"{type(e).__name__}: {e}")
                raise  # (only a rank whose own checks passed gets here without an error)
            finally:
                _state.active = False
            if _state.pending:  # no exchange on this rank: agree on the way out
                _state.pending = False
                _agree(group, None)
            return result

        return call  # type: ignore[return-value]

    return wrap
