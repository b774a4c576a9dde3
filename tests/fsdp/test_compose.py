"""qsdp where FSDP2 composes: tensor parallelism on a (dp, tp) mesh, HSDP arguments that
contradict the model's layout, pipeline stages with their own recipes (issue 31)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import qsdp
from qsdp.policy import AutoDecision
from qsdp.testing import assert_same_on_all_ranks, run_distributed

from ..models import VOCAB, batch, classifier, dist_calls, sharded_classifier, train

D = 48
STEPS = 12


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class _Net(nn.Module):
    """Tokens in, class out (the task of ``tests.models``), through two MLP blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([_MLP(), _MLP()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h.mean(1)))


def _tp_model(mesh) -> nn.Module:
    """Each block's MLP tensor-parallel over ``tp`` (up column-wise, down row-wise, as
    torchtitan does), every block and the root ``fully_shard``-ed over ``dp``."""
    model = _Net()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


_COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_reduce",
)


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _tp_worker(rank: int, world: int, recipes: list[str]) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh.get_group("dp")
    plain = _tp_model(mesh)
    out = {"plain": _train_on(plain, dp_rank, dp)}
    with torch.no_grad():
        assert_same_on_all_ranks(plain(batch(0, 999)[0]))
    for name in recipes:
        model = _tp_model(mesh)
        qsdp.compress_fsdp(model, name)
        groups = qsdp.fsdp.fsdp_groups(model)
        # FSDP2's own view: the shard group is dp, no replicate group; TP's stays PyTorch's
        assert all(g.shard_ranks == tuple(dist.get_process_group_ranks(dp)) for g in groups)
        assert all(g.replicate_ranks is None for g in groups)
        out[name] = _train_on(model, dp_rank, dp)
        with torch.no_grad():  # every rank computes the same function of the same batch
            try:
                assert_same_on_all_ranks(model(batch(0, 999)[0]))
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None
        stats = qsdp.fsdp_comm_stats(model)
        # only the dp collectives are qsdp's: its counters hold no TP all-reduce, and every
        # torch.distributed collective of a step runs over this rank's dp ranks (TP's own run
        # as DTensor functional collectives, untouched)
        assert "all_reduce_replicate" not in stats.snapshot(), (name, stats)
        before = stats.total_bytes
        with contextlib.ExitStack() as stack:
            calls = [stack.enter_context(dist_calls(n)) for n in _COLLECTIVES if hasattr(dist, n)]
            x, y = batch(dp_rank, STEPS)
            nn.functional.cross_entropy(model(x), y).backward()
        groups = {_ranks(c["group"]) for called in calls for c in called}
        assert groups == {tuple(dist.get_process_group_ranks(dp))}, (name, groups)
        assert stats.total_bytes > before, name
    return out


#: SDP4Bit's ablations: their collectives are the main recipes' (4-bit quantized weights as
#: qsdp-w8g8's at other bits, weight differences and two-level gradients as sdp4bit's halves,
#: gradients without a rotation as cgx's)
_ABLATIONS = ("w4-direct", "qwd-only", "tlq-hs-only", "tlq-no-hadamard")


def test_fsdp_with_tensor_parallel_trains_like_plain_fsdp_for_every_recipe():
    recipes = [n for n in qsdp.RECIPES if n not in ("bf16", *_ABLATIONS)]
    results = run_distributed(_tp_worker, 4, recipes, timeout_s=240)
    for r in results:
        assert r == results[0]  # the loss is averaged over dp: the same on every rank
    plain = results[0]["plain"]
    for name in recipes:
        # the compressed runs end near the uncompressed one (the bounds of test_compress_fsdp)
        assert results[0][name] == pytest.approx(plain, rel=0.15), (name, results[0])


def _misuse_worker(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name in ("cgx", "bf16"):
        # the README's HSDP snippet without fully_shard(mesh=mesh["shard"]): FSDP shards over
        # the world, which the replicate group overlaps
        model = sharded_classifier(None)
        try:
            qsdp.compress_fsdp(model, name, replicate=mesh["replicate"])
            out[name] = "installed"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_a_replicate_group_overlapping_fsdp_shards_raises_on_every_rank():
    for r in run_distributed(_misuse_worker, 4):
        for name in ("cgx", "bf16"):
            message = r[name]
            assert "overlaps the group FSDP shards" in message, (name, message)
            assert "mesh=mesh_2d['shard']" in message, message


def _stages_worker(rank: int, world: int) -> dict:
    """Two pipeline stages of two ranks each, every stage sharding its own model over its own
    pair and compressing it with its own recipe (no collective over the world)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp = rank // 2, mesh.get_group("dp")
    name = ("sdp4bit", "qsdp-w8g8")[stage]
    plain = sharded_classifier(mesh["dp"])
    losses = {"plain": _train_on(plain, rank % 2, dp)}
    model = sharded_classifier(mesh["dp"])
    qsdp.compress_fsdp(model, name)
    losses[name] = _train_on(model, rank % 2, dp)
    for p in model.parameters():  # the stage's shards keep in step: same bits on both ranks
        assert_same_on_all_ranks(p.full_tensor().detach(), group=dp)
    return {"stage": stage, **losses}


def _train_on(model: nn.Module, dp_rank: int, dp: dist.ProcessGroup) -> float:
    """The last of :data:`STEPS` steps' losses, averaged over ``dp``."""
    return train(model, dp_rank, STEPS, group=dp)[-1]


def test_pipeline_stages_compress_with_their_own_recipes():
    results = run_distributed(_stages_worker, 4)
    for stage, name in ((0, "sdp4bit"), (1, "qsdp-w8g8")):
        pair = [r for r in results if r["stage"] == stage]
        assert pair[0] == pair[1]
        assert pair[0][name] == pytest.approx(pair[0]["plain"], rel=0.15), pair[0]


def _auto_worker(rank: int, world: int, hsdp: bool) -> dict:
    """``"auto"`` where a group has one rank: the whole world of one, or an HSDP replicate
    dimension of one; it leaves torch's RNG state as it was."""
    out = {"plain": _train_on(sharded_classifier(None), rank, dist.group.WORLD)}
    if hsdp:
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
        model = sharded_classifier(mesh["shard"])
        before = torch.get_rng_state()
        qsdp.compress_fsdp(model, "auto", replicate=mesh["replicate"])
    else:
        model = sharded_classifier(None)
        before = torch.get_rng_state()
        qsdp.compress_fsdp(model, "auto")
    out["rng_kept"] = bool(torch.equal(before, torch.get_rng_state()))
    decision = qsdp.fsdp.comm_state(model).decision
    out["recipe"], out["report"] = decision.recipe, decision.report()
    # no link: an infinite bandwidth, which JSON has not, survives the record
    record = json.loads(json.dumps(decision.record()))
    out["round_trip"] = AutoDecision.from_record(record) == decision
    out["loss"] = _train_on(model, rank, dist.group.WORLD)
    return out


@pytest.mark.parametrize("world,hsdp", [(1, False), (2, True)])
def test_auto_with_a_group_of_one_rank(world, hsdp):
    results = run_distributed(_auto_worker, world, hsdp)
    for r in results:
        assert r["rng_kept"], r
        # no link to save time on: uncompressed, training as plain FSDP2 does
        assert r["recipe"] == "bf16", r
        assert "no link (one rank)" in r["report"] and r["round_trip"], r
        assert r["loss"] == pytest.approx(r["plain"], rel=1e-6), r


def _oom_worker(rank: int, world: int) -> str:
    """An out-of-memory error inside a reduce-scatter hook reaches the caller as one."""
    model = sharded_classifier(None)
    qsdp.compress_fsdp(model, "qsdp-g8")
    plan_type = type(qsdp.recipe("qsdp-g8").grads.plan())

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")

    real, plan_type.reduce_scatter = plan_type.reduce_scatter, out_of_memory
    try:
        x, y = batch(rank, 0)
        nn.functional.cross_entropy(model(x), y).backward()
    except Exception as e:  # what the training loop sees
        return f"{type(e).__name__}: {e} {getattr(e, '__notes__', '')}"
    finally:
        plan_type.reduce_scatter = real
    return "no error"


def test_out_of_memory_in_a_hook_reaches_the_caller_as_one():
    for message in run_distributed(_oom_worker, 2):
        assert message.startswith("OutOfMemoryError: injected"), message
        assert "reduce-scatter of FSDP module" in message, message  # where, as a note


def _other_recipe_worker(rank: int, world: int, path: str) -> dict:
    """A checkpoint's qsdp state loaded into a model compressed with another recipe."""
    from torch.distributed import checkpoint as dcp

    saved = sharded_classifier(None)
    qsdp.compress_fsdp(saved, "qsdp-w8g8")
    _train_on(saved, rank, dist.group.WORLD)
    dcp.save({"qsdp": qsdp.fsdp.comm_state(saved)}, checkpoint_id=path)
    out = {}
    for name in ("qsdp-w8g8", "global-qsgd", "cgx"):
        model = sharded_classifier(None)
        qsdp.compress_fsdp(model, name)
        try:
            dcp.load({"qsdp": qsdp.fsdp.comm_state(model)}, checkpoint_id=path)
            out[name] = "loaded"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_loading_another_recipes_state_says_what_was_saved(tmp_path):
    for r in run_distributed(_other_recipe_worker, 2, str(tmp_path / "ckpt")):
        assert r["qsdp-w8g8"] == "loaded"
        for name in ("global-qsgd", "cgx"):
            assert "saved with recipe 'qsdp-w8g8'" in r[name], r[name]
            assert f"compressed with recipe '{name}'" in r[name], r[name]


def _master_dtype_worker(rank: int, world: int) -> dict:
    """The quantized-master recipe on bf16 parameters, and under a bf16 param_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for case in ("bf16 parameters", "param_dtype"):
        model = classifier()
        if case == "bf16 parameters":
            model = model.bfloat16()
            mp = MixedPrecisionPolicy()
        else:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for i in (2, 5):
            fully_shard(model[i], mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        qsdp.compress_fsdp(model, "qsdp-quantized-master")
        try:
            model(batch(rank, 0)[0])
            out[case] = "ran"
        except ValueError as e:
            out[case] = str(e)
    return out


def test_quantized_master_names_what_the_user_did():
    for r in run_distributed(_master_dtype_worker, 2):
        assert "stores its parameters in ['torch.bfloat16']" in r["bf16 parameters"], r
        assert "param_dtype" not in r["bf16 parameters"], r  # the user passed none
        assert "MixedPrecisionPolicy(param_dtype=...)" in r["param_dtype"], r


def _tp_stale(rank: int, world: int, recipe: str) -> dict:
    """Staleness 1 on the (dp, tp) model: the schedule's prediction (in the gathers where they
    are qsdp's and the shards lie on dim 0; moved elsewhere, as TP's row-wise shards) against
    the loop by hand, which moves every parameter ([Note: the prediction in the gathers])."""
    from qsdp.runtime import WeightPrediction

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    out = {}
    for how in ("schedule", "hand", "none"):
        model = _tp_model(mesh)
        predict = "local" if how == "schedule" else "none"
        schedule = qsdp.Schedule(staleness=1, start=0, predict=predict)
        qsdp.compress_fsdp(model, recipe, schedule=schedule)
        state = qsdp.fsdp.comm_state(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        by_hand = WeightPrediction(opt, local=state) if how == "hand" else None
        for step in range(6):
            ahead = by_hand.ahead(enabled=state.in_flight) if by_hand else contextlib.nullcontext()
            with ahead:
                x, y = batch(dp_rank, step)
                nn.functional.cross_entropy(model(x), y).backward()
            if not state.applied_nothing:
                opt.step()
            opt.zero_grad()
        state.drain()
        opt.step()
        out[how] = [p.full_tensor() for p in model.parameters()]
    pairs = zip(out["schedule"], out["hand"], strict=True)
    moved = zip(out["hand"], out["none"], strict=True)
    return {
        "same": all(torch.equal(a, b) for a, b in pairs),
        "moved": any(not torch.equal(a, b) for a, b in moved),
    }


@pytest.mark.parametrize("recipe", ["qsdp-w8g8", "sdp4bit"])
def test_staleness_1_with_tensor_parallel_predicts_as_the_loop_by_hand(recipe):
    for got in run_distributed(_tp_stale, 4, recipe, timeout_s=240):
        assert got == {"same": True, "moved": True}, got
