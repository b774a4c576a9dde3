"""Which FSDP modules ``Schedule(graphs=True)`` replays ([Note: only repeated shapes replayed]
in ``qsdp.fsdp.api``): those whose shapes another module shares, never the root of its own
shapes; a model with none is refused on every rank, naming the fix. Real gloo processes (the
replays themselves run on a GPU: ``tests/fsdp/test_graphs_gpu.py``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import qsdp
from qsdp.fsdp.api import repeated_shapes
from qsdp.testing import run_distributed


class _Net(nn.Module):
    """An embedding and a head on the root, blocks of ``widths`` (equal widths: equal shapes)."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, w), nn.GELU(), nn.Linear(w, 16)) for w in widths
        )
        self.head = nn.Linear(16, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _selected(rank: int, world: int) -> dict:
    out = {}
    for name, widths in (("equal", [32, 32, 32]), ("one differs", [32, 32, 64]), ("all", [8])):
        torch.manual_seed(0)
        model = _Net(widths)
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        groups = qsdp.fsdp.fsdp_groups(model)
        picked = repeated_shapes(groups)
        out[name] = sorted(groups[i].name for i in picked)
        if name == "all":  # nothing repeats: refused, the same on every rank
            try:
                qsdp.compress_fsdp(model, "qsdp-w8g8", schedule=qsdp.Schedule(graphs=True))
            except ValueError as e:
                out["error"] = str(e)
        if name == "equal":  # without graphs nothing replays (with them: the GPU tier's test)
            qsdp.compress_fsdp(model, "qsdp-w8g8")
            out["state"] = qsdp.fsdp.comm_state(model).replayed
    return out


def test_only_modules_of_repeated_shapes_replay():
    got = run_distributed(_selected, 3)
    assert got[0]["equal"] == ["blocks.0", "blocks.1", "blocks.2"]  # the root: shapes of its own
    assert got[0]["one differs"] == ["blocks.0", "blocks.1"]
    assert got[0]["all"] == [] and got[0]["state"] == ()
    assert "each have shapes of their own: fully_shard each repeated block" in got[0]["error"]
    assert "this model's 2 FSDP modules" in got[0]["error"]
    assert all(g == got[0] for g in got), got
