"""Batches of a prepared token directory: deterministic ``(x, y)`` windows for train and val.

[Note: two train orders]
``"random"`` (the default): each micro-batch's windows start at offsets drawn from a generator
seeded by ``(seed, step, micro, rank)`` alone, so a run sees the same data in the same order
whatever else happens (resume, other RNG use), but a window may come twice and some never.
``"pass"``: one pass over the train split, nothing seen twice. The split is cut into
``W = (tokens - 1) // block_size`` back-to-back windows (each ``block_size + 1`` tokens, the
last token of one the first of the next, so every target is predicted once), permuted once by
``seed``; micro-batch ``micro`` of step ``step`` on rank ``rank`` takes the ``micro_batch``
windows at ``((step * grad_accum + micro) * world_size + rank) * micro_batch`` of that order. A
run that needs more than ``W`` windows is refused (:meth:`Batches.pass_windows` tells how many
there are), as is any call past them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .data import TokenData

__all__ = ["DATA_ORDERS", "Batches"]

DATA_ORDERS = ("random", "pass")
"""The train orders (see [Note: two train orders])."""


def _seed(*parts: object) -> int:
    # A stable hash (not Python's hash(), which is salted per process) of the draw's identity.
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Batches:
    """Deterministic batches of ``(x, y)`` windows, ``y`` being ``x`` shifted by one token.

    Train windows come in ``order`` (see [Note: two train orders]). Val windows are fixed:
    ``W = n_batches * world_size * micro_batch`` windows evenly spaced over the val split, window
    ``j`` in batch ``j // (world_size * micro_batch)`` of rank ``(j // micro_batch) % world_size``;
    the same for every call.
    """

    def __init__(self, data: TokenData, *, order: str = "random") -> None:
        if order not in DATA_ORDERS:
            raise ValueError(f"data order {order!r} must be one of {DATA_ORDERS}")
        self.data = data
        self.order = order
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def pass_windows(self, block_size: int) -> int:
        """How many windows of ``block_size`` one pass over the train split holds."""
        return max(int(self.data.train.size) - 1, 0) // block_size

    def train_batch(
        self,
        step: int,
        micro: int,
        *,
        rank: int,
        world_size: int,
        micro_batch: int,
        block_size: int,
        seed: int,
        grad_accum: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s micro-batch ``micro`` of optimizer step ``step`` (of ``grad_accum``
        micro-batches; the ``"pass"`` order needs it to number the windows).

        Returns:
            ``(x, y)``, int64, shape ``[micro_batch, block_size]``.
        """
        tokens = self._check("train", rank, world_size, micro_batch, block_size)
        if step < 0 or micro < 0:
            raise ValueError(f"step={step} and micro={micro} must be >= 0")
        if self.order == "pass":
            if micro >= grad_accum:
                raise ValueError(f"micro={micro} must be < grad_accum={grad_accum}")
            n = self.pass_windows(block_size)
            first = ((step * grad_accum + micro) * world_size + rank) * micro_batch
            if first + micro_batch > n:
                raise ValueError(
                    f"data order 'pass': step {step} needs window {first + micro_batch - 1} but "
                    f"one pass over the train split holds {n} windows of {block_size} tokens; "
                    f"train at most {n // (grad_accum * world_size * micro_batch)} steps, or "
                    "use the 'random' order"
                )
            key = (n, seed)
            if key not in self._perms:
                gen = torch.Generator().manual_seed(_seed("pass", seed, n))
                self._perms[key] = torch.randperm(n, generator=gen)
            picked = self._perms[key][first : first + micro_batch]
            return _windows(tokens, (picked * block_size).tolist(), block_size)
        gen = torch.Generator().manual_seed(_seed("train", seed, step, micro, rank))
        starts = torch.randint(tokens.size - block_size, (micro_batch,), generator=gen)
        return _windows(tokens, starts.tolist(), block_size)

    def val_batches(
        self, n_batches: int, *, rank: int, world_size: int, micro_batch: int, block_size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Rank ``rank``'s share of the fixed evaluation set: ``n_batches`` batches.

        Returns:
            An iterator of ``(x, y)``, int64, shape ``[micro_batch, block_size]``.
        """
        tokens = self._check("val", rank, world_size, micro_batch, block_size)
        if n_batches < 1:
            raise ValueError(f"n_batches={n_batches} must be >= 1")
        total = n_batches * world_size * micro_batch
        last = tokens.size - block_size - 1  # the largest valid start

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for b in range(n_batches):
                first = (b * world_size + rank) * micro_batch
                js = range(first, first + micro_batch)
                starts = [j * last // max(total - 1, 1) for j in js]
                yield _windows(tokens, starts, block_size)

        return batches()

    def _check(
        self, split: str, rank: int, world_size: int, micro_batch: int, block_size: int
    ) -> np.memmap:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if micro_batch < 1 or block_size < 1:
            raise ValueError(f"micro_batch={micro_batch} and block_size={block_size} must be >= 1")
        tokens = getattr(self.data, split)
        if tokens.size < block_size + 1:
            raise ValueError(
                f"the {split} split has {tokens.size} tokens, too short for block_size="
                f"{block_size}, which needs at least {block_size + 1}; use a smaller block_size "
                "or more data"
            )
        return tokens


def _windows(
    tokens: np.ndarray, starts: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    buf = np.stack([tokens[s : s + block_size + 1] for s in starts]).astype(np.int64)
    xy = torch.from_numpy(buf)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
