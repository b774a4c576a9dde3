"""``compress_fsdp``: one call after the user's ``fully_shard`` calls."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from .. import comm as qc
from ..comm import CommStats
from ..config import (
    CompressionConfig,
    IntegerGrads,
    NonFinite,
    QuantizedGrads,
    QuantizedMaster,
    QuantizedWeights,
    Schedule,
    WeightDiffs,
    as_schedule,
    recipe,
)
from ..policy import auto
from ..runtime import NonfiniteCheck, SideStreams, side_mesh
from ..runtime.agreement import agree_verdict, check_same_arguments
from ..runtime.delayed import DelayedReductions, padded_slots
from ..runtime.gathered import GatheredPrediction
from ..runtime.prediction import AutoPrediction
from ..runtime.streams import twin_groups
from ..runtime.widths import WidthController
from ._gathers import QuantizedAllGather, QuantizedMasterAllGather, WeightDiffAllGather
from ._groups import FSDPGroup, fsdp_groups
from ._hooks import StepClock
from ._reduce import QuantizedReduceScatter, compressed_runs
from ._replicate import ReplicateAllReduce, ReplicateCounter
from ._state import (
    _install,
    _Installed,
    comm_state,
)

__all__ = ["compress_fsdp"]


# Every FSDPModule that carries qsdp's hooks, so a second compress_fsdp (on the model or on a
# part of it) is refused instead of stacking a second set of hooks.
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def compress_fsdp(
    model: nn.Module,
    config: CompressionConfig | str,
    *,
    mesh: DeviceMesh | None = None,
    replicate: DeviceMesh | dist.ProcessGroup | None = None,
    schedule: Schedule | None = None,
) -> nn.Module:
    """Route every ``FSDPModule`` of ``model`` through qsdp's compressed collectives.

    Call it after ``fully_shard`` (on the blocks, then the root), once, on every rank.
    Parameters, optimizer and training loop stay as they are; only what FSDP2 sends changes.
    With native HSDP (``fully_shard`` on a 2-D mesh) the gradients' reduce-scatter inside the
    shard group is compressed and FSDP2's own replicate all-reduce is counted in
    :func:`fsdp_comm_stats` (as ``"all_reduce_replicate"``), not compressed: for that, shard on
    the intra-node mesh and pass ``replicate=``.

    Args:
        model: a model whose modules were wrapped by ``torch.distributed.fsdp.fully_shard``; it
            must be the root module (its forward starts a training step).
        config: a :class:`qsdp.CompressionConfig` or a recipe name (``"qsdp-w8g8"``, ...).
        mesh: for two-level gradients (``grads=TwoLevelGrads(...)``, e.g. ``"sdp4bit"``): a 2-D
            ``DeviceMesh`` (inter-node, intra-node) over exactly the ranks FSDP shards on, listed
            in any order. ``None`` treats every peer as remote (only the inter-node quantizer).
        replicate: compressed HSDP (see [Note: compressed HSDP]): the 1-D mesh (or process
            group) across which the shards FSDP reduces inside a node are replicated. The
            modules must be sharded on the intra-node mesh only; the config's gradients then
            compress this replicate all-reduce (``QuantizedGrads``: CGX's two phases,
            ``IntegerGrads``: Global-QSGD; None: uncompressed, counted) and the reduce-scatter
            inside the node stays FSDP2's own; weights are gathered inside the node as the
            config says.
        schedule: when and on which communicators the collectives run (a
            :class:`qsdp.Schedule`; default: synchronous, on FSDP2's communicators, the
            reduce-scatters on their own when the weights are gathered again in the backward;
            see [Note: what and when]): ``staleness=1`` ([Note: one staleness core] in
            ``qsdp.runtime.delayed``),
            ``own_reduce_group``, ``pipeline=True`` for compressed HSDP with compressed
            gradients (the replicate all-reduce's later exchange on a second communicator and
            the modules' hooks on two alternating CUDA streams; [Note: pipelined modules] in
            ``qsdp/fsdp/_replicate.py``; with ``"auto"``: when it chooses to compress).

    Returns:
        ``model``, modified in place. :func:`fsdp_comm_stats` gives its byte counter.

    Raises:
        ValueError: no FSDPModule in ``model``, an unknown recipe, a mesh that is not 2-D, given
            to a one-level recipe or not FSDP's shard group, a ``replicate`` group under native
            HSDP or overlapping FSDP's shard group, a model (or part of one) already compressed,
            another config, schedule or mesh shape on another rank (each found by collectives
            over the model's groups, so every rank of them raises: [Note: one config on every
            rank], [Note: agreement over the model's groups]), ``schedule.pipeline`` without
            ``replicate``, with uncompressed gradients or at staleness 1.
        TypeError: ``config`` or ``schedule`` of the wrong type.
    """
    # what each rank can check alone, the same on every rank passing the same arguments
    schedule = as_schedule(schedule, where="compress_fsdp")
    arguments = (config, schedule, _shape(mesh), _shape(replicate))
    if isinstance(config, str) and config != "auto":
        config = recipe(config)
    elif not isinstance(config, (str, CompressionConfig)):
        raise TypeError(
            f"config must be a qsdp.CompressionConfig or a recipe name, got {type(config).__name__}"
        )
    if mesh is not None and config != "auto" and not config.two_level:
        raise ValueError(
            "compress_fsdp(mesh=...) is for two-level gradients (grads=TwoLevelGrads(...), "
            "e.g. 'sdp4bit'); this config reduces over FSDP's own group: drop the mesh"
        )
    if mesh is not None:
        _check_two_dimensional(mesh)
    modules, groups = _fsdp_groups_of(model)
    replicate_pg = _as_group(replicate)
    # the same on every rank of the model's groups, and a layout that agrees with the
    # arguments, before anything can raise on one rank alone ([Note: agreement over the
    # model's groups] in qsdp.runtime.agreement)
    _check_agreed(groups, arguments, replicate_pg, mesh)
    decision = None
    if config == "auto" and schedule.graphs:
        raise ValueError(
            "Schedule(graphs=True) with config='auto': 'auto' may keep the gradients "
            "uncompressed, where there is no codec to replay; pass the recipe it reports"
        )
    if config == "auto":  # measure, predict, pick: see qsdp.policy.auto
        decision = _auto(
            model, groups, mesh=mesh, replicate=replicate_pg, pipeline=schedule.pipeline
        )
        config = decision.config()  # pipelined when it compresses (it says when it turns it off)
        schedule = dataclasses.replace(schedule, pipeline=decision.pipeline)
        if not decision.two_level:
            mesh = None
    _check_replicate_grads(replicate_pg, config)
    _check_pipeline(schedule, replicate_pg, config)
    shared = _shared(model, config, schedule, groups, mesh=mesh, replicate=replicate_pg)
    _check_graphs(schedule, shared, groups)
    hooks: list[object] = []
    slots: list[tuple[int, int]] = []  # (group, 0: all-gather / 1: reduction) of each hook
    for i, group in enumerate(groups):
        if group.replicate_group is not None:  # HSDP: FSDP2's own replicate all-reduce, counted
            group.module.set_all_reduce_hook(ReplicateCounter(shared.stats))
        replicate_hook = _replicate_hook(shared, model, group, i, len(groups))
        gather = _gather_hook(shared, model, group, i)
        reduce = _reduce_hook(shared, model, group, i)
        if schedule.gather_ahead:  # [Note: the next step's weights in this backward]
            _check_ahead(gather, reduce, group)
            reduce.ahead = gather
        for column, hook in ((1, replicate_hook), (0, gather), (1, reduce)):
            if hook is not None:
                hooks.append(hook)
                slots.append((i, column))
    installed = _Installed(
        config=config,
        schedule=schedule,
        stats=shared.stats,
        clock=shared.clock,
        gathers=[h for h in hooks if isinstance(h, WeightDiffAllGather)],
        hooks=hooks,
        slots=slots,
        groups=len(groups),
        stale=shared.stale,
        widths=shared.widths,
        decision=decision,
        check=shared.check,
        replayed=tuple(groups[i].name for i in sorted(shared.replayed)),
    )
    _install(model, installed)
    if schedule.prediction == "local":  # [Note: prediction in the schedule]
        installed.predict = AutoPrediction(
            model,
            comm_state(model),
            clip=schedule.predict_clip,
            gathers=shared.prediction,
            gathered=frozenset(shared.gathered),
        )
    _HOOKED.update(modules)
    return model


@dataclass
class _Shared:
    """What the hooks of every FSDP group of one model share, decided once at installation
    (the hooks themselves are built complete, per group, from it)."""

    config: CompressionConfig
    stats: CommStats
    check: NonfiniteCheck | None
    """The NaN/Inf check of the model's reductions (None: ``nonfinite="propagate"``)."""
    clock: StepClock | None
    """Weight differences and the quantized master: the steps as FSDP2 sees them."""
    reduce: qc.ReducePlan | None
    """The reduce-scatter's plan (None: FSDP2's own, uncompressed and not moved)."""
    replicate_plan: qc.ReducePlan | None
    """Compressed HSDP: the replicate all-reduce's plan."""
    replicate: dist.ProcessGroup | None
    stale: DelayedReductions | None
    """Staleness 1: the reductions in flight ([Note: one staleness core])."""
    twins: dict[str, dist.ProcessGroup] | None
    """The reductions' own communicators by group name (``own_reduce_group``, staleness 1)."""
    second: dist.ProcessGroup | None
    """``pipeline=True``: the later exchange's communicator ([Note: pipelined modules])."""
    widths: WidthController | None
    param_widths: dict[int, tuple[list[int], list[tuple[int, int]]]]
    """Widths per parameter: each group's keys and chunk runs ([Note: widths per parameter])."""
    streams: SideStreams
    piped: int = 0
    """Pipelined HSDP hooks made so far (they alternate between two streams)."""
    prediction: GatheredPrediction | None = None
    """Staleness 1's prediction where qsdp gathers ([Note: the prediction in the gathers])."""
    gathered: set[int] = dataclasses.field(default_factory=set)
    """The ids of the parameters the gathers predict."""
    ahead: SideStreams | None = None
    """``Schedule(gather_ahead=True)``: the stream the gathers made ahead run on."""
    graphs: qc.CodecGraphs | None = None
    """``Schedule(graphs=True)``: the hooks' captured codec segments, the reduce-scatters' and
    the quantized gathers' ([Note: codec segments replayed] in ``qsdp.comm._graphs``)."""
    replayed: frozenset[int] = frozenset()
    """The groups whose collectives replay :attr:`graphs` ([Note: only repeated shapes
    replayed]); the others run eagerly."""

    def graphs_of(self, i: int) -> qc.CodecGraphs | None:
        """Group ``i``'s replayed segments, or None where it runs eagerly."""
        return self.graphs if i in self.replayed else None

    def split(self, layout: list) -> qc.Split | None:
        """The policy's split of a group's chunk (None: everything quantized)."""
        policy = self.config.policy
        return policy.split(layout) if policy is not None and layout else None


def _shared(
    model: nn.Module,
    config: CompressionConfig,
    schedule: Schedule,
    groups: list[FSDPGroup],
    *,
    mesh: DeviceMesh | None,
    replicate: dist.ProcessGroup | None,
) -> _Shared:
    """The plans, communicators, check, clock and widths every group's hooks share."""
    check = None
    if config.nonfinite is not NonFinite.PROPAGATE:
        check = NonfiniteCheck(config.nonfinite.value)
    clock = None
    if isinstance(config.weights, (WeightDiffs, QuantizedMaster)):
        clock = StepClock()
        # before FSDP's own pre-forward (and its all-gathers): a new step begins
        model.register_forward_pre_hook(clock.tick, prepend=True)
        model.register_load_state_dict_post_hook(clock.request_resync)
    plan = config.grads.plan(mesh=mesh) if config.grads is not None else None
    own = schedule.own_group(config)  # (always at staleness 1)
    replicate_plan = None
    if replicate is not None:  # the gradients' config is for the replicate all-reduce
        replicate_plan = plan or qc.PlainReduce(name="all_reduce_replicate")
        plan = None
    elif plan is None and own:
        plan = qc.PlainReduce(name="reduce_scatter")  # a hook to move: FSDP2's reduction, counted
    stale = None
    if schedule.staleness:  # [Note: one staleness core] in qsdp.runtime.delayed
        # under compressed HSDP each replica's local estimates (the node's average) differ
        tag = f"replica{replicate.rank()}" if replicate is not None else ""
        stale = DelayedReductions(
            dict(model.named_parameters()), local_tag=tag, start=schedule.start
        )
    twins = None
    if own and (schedule.staleness or replicate is None):
        # the reductions' own communicators (see Schedule.own_reduce_group)
        used = [replicate] if replicate is not None else []
        used += [g.shard_group for g in groups if g.shard_group is not None and plan is not None]
        twins = twin_groups(used)
        if isinstance(plan, qc.TwoLevelReduce) and plan.mesh is not None:
            plan = dataclasses.replace(plan, mesh=side_mesh(plan.mesh))  # the twin mesh
    second = twin_groups([replicate])[replicate.group_name] if schedule.pipeline else None
    widths, param_widths = _widths(
        config, groups, plan=replicate_plan or plan, hsdp=replicate, stale=bool(stale)
    )
    prediction = None
    if schedule.staleness and schedule.prediction == "local":
        prediction = GatheredPrediction()
    return _Shared(
        graphs=qc.CodecGraphs() if schedule.graphs else None,
        replayed=repeated_shapes(groups) if schedule.graphs else frozenset(),
        ahead=SideStreams(1) if schedule.gather_ahead else None,
        prediction=prediction,
        config=config,
        stats=CommStats(),
        check=check,
        clock=clock,
        reduce=plan,
        replicate_plan=replicate_plan,
        replicate=replicate,
        stale=stale,
        twins=twins,
        second=second,
        widths=widths,
        param_widths=param_widths,
        streams=SideStreams(2),
    )


def _widths(
    config: CompressionConfig,
    groups: list[FSDPGroup],
    *,
    plan: qc.ReducePlan | None,
    hsdp: dist.ProcessGroup | None,
    stale: bool,
) -> tuple[WidthController | None, dict[int, tuple[list[int], list[tuple[int, int]]]]]:
    """Adaptive widths ([Note: adaptive widths at run time]): the controller, a key per group
    or, ``per_parameter``, per compressed parameter ([Note: widths per parameter])."""
    if config.adaptive is None:
        return None, {}
    keys, per_param = len(groups), {}
    if config.adaptive.per_parameter:  # one key per compressed parameter of each group
        if hsdp is not None or stale:
            raise ValueError(
                "AdaptiveWidths(per_parameter=True) is built for FSDP2's synchronous "
                "reduce-scatter; under compressed HSDP or at staleness 1 use "
                "per_parameter=False (a width per group)"
            )
        keys = 0
        for i, group in enumerate(groups):
            runs = compressed_runs(group.layout(grads_only=True), config.policy)
            per_param[i] = (list(range(keys, keys + len(runs))), runs)
            keys += len(runs)
    widths = WidthController(
        config.adaptive, reference=plan.width_spec.bits, keys=keys, seed=config.seed
    )
    return widths, per_param


def _key(shared: _Shared, group: FSDPGroup, bucket: int) -> dict:
    """A hook's noise key, byte counter and name."""
    return dict(seed=shared.config.seed, stats=shared.stats, bucket=bucket, module_name=group.name)


def _replicate_hook(
    shared: _Shared, model: nn.Module, group: FSDPGroup, i: int, n_groups: int
) -> ReplicateAllReduce | None:
    """Compressed HSDP: group ``i``'s replicate all-reduce, installed with FSDP2's all-reduce
    hook ([Note: compressed HSDP])."""
    if shared.replicate is None or group.shard_group is None or group.replicate_group is not None:
        return None
    layout = group.layout(grads_only=True)
    stale = shared.stale if layout else None
    hook = ReplicateAllReduce(
        plan=shared.replicate_plan,
        replicate=shared.replicate,
        shard=group.shard_group,
        # uncompressed: as native HSDP, NaN/Inf travel as they are
        check=shared.check if shared.config.grads is not None else None,
        layout=[(n, k) for n, k, _ in layout] if layout else None,
        split=shared.split(layout),
        params=group.params,
        widths=shared.widths,
        width_key=i,
        second_group=shared.second,  # [Note: pipelined modules]
        **({"stale": stale, "twins": shared.twins} if stale else {}),
        chunk=_grad_params(model, layout) if stale else (),
        **_key(shared, group, 2 * n_groups + i),
    )
    stream = None  # FSDP2's all-reduce stream, unless pipelined on CUDA
    if shared.second is not None:
        stream = _hook_stream(hook.params, shared.piped, shared.streams)
        shared.piped += 1
    group.module.set_all_reduce_hook(hook, **({} if stream is None else {"stream": stream}))
    return hook


def _gather_hook(shared: _Shared, model: nn.Module, group: FSDPGroup, i: int):
    """Group ``i``'s weight all-gather as the config's weights say (None: FSDP2's own)."""
    weights, key = shared.config.weights, _key(shared, group, 2 * i)
    if isinstance(weights, WeightDiffs):
        gather = WeightDiffAllGather(
            weights.spec,
            clock=shared.clock,
            params=list(group.params),
            resync_every=weights.resync_every,
            check_replicas=weights.check_replicas,
            streams=shared.ahead,
            graphs=shared.graphs_of(i),
            **_predicting(shared, model, group),
            **key,
        )
    elif isinstance(weights, QuantizedMaster):
        params = _master_params(model, group)
        gather = QuantizedMasterAllGather(weights.spec, clock=shared.clock, params=params, **key)
    elif isinstance(weights, QuantizedWeights):
        layout = group.layout(grads_only=False)
        gather = QuantizedAllGather(
            weights.spec,
            split=shared.split(layout),
            graphs=shared.graphs_of(i),
            **_predicting(shared, model, group),
            **key,
        )
    else:
        return None
    group.module.set_custom_all_gather(gather)
    return gather


def _predicting(shared: _Shared, model: nn.Module, group: FSDPGroup) -> dict:
    """A gather hook's share of staleness 1's prediction ([Note: the prediction in the
    gathers]): its input's slots, where every parameter is sharded on dim 0 (the input holds
    each local shard as it is laid out); ``{}`` otherwise, and those parameters are moved."""
    if shared.prediction is None:
        return {}
    params = _master_params(model, group)
    if not all(_dim0(p) for p, _ in params):
        return {}
    shared.gathered.update(id(p) for p, _ in params)
    return {"prediction": shared.prediction, "slots": padded_slots(params)}


def _check_ahead(gather: object, reduce: object, group: FSDPGroup) -> None:
    """``Schedule(gather_ahead=True)`` needs each group's weight differences gathered by qsdp
    with the prediction, and its gradients reduced by qsdp at staleness 1."""
    if not isinstance(gather, WeightDiffAllGather):
        why = "gathers no weight differences (use a WeightDiffs recipe such as 'sdp4bit')"
    elif gather.prediction is None:
        why = "has parameters not sharded on dim 0 (predicted by moving them, not in the gather)"
    elif reduce is None:
        why = "has no gradients qsdp reduces (compressed HSDP reduces FSDP2's all-reduce)"
    else:
        return
    raise ValueError(
        "Schedule(gather_ahead=True) gathers the next step's weight differences in the "
        f"backward; FSDP module '{group.name or '<root>'}' {why}: drop gather_ahead"
    )


def _dim0(p: nn.Parameter) -> bool:
    placements = getattr(p, "placements", None)
    if placements is None:
        return False
    return all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in placements)


def _reduce_hook(
    shared: _Shared, model: nn.Module, group: FSDPGroup, i: int
) -> QuantizedReduceScatter | None:
    """Group ``i``'s gradient reduce-scatter through the plan (None: FSDP2's own)."""
    if shared.reduce is None:
        return None
    layout = group.layout(grads_only=True)
    key = _key(shared, group, 2 * i + 1)
    if group.replicate_group is not None:  # [Note: noise per place in the group]
        key["seed"] = qc.replica_seed(shared.config.seed, group.replicate_group.rank())
    stale = shared.stale if layout else None
    reduce = QuantizedReduceScatter(
        plan=shared.reduce,
        check=shared.check,
        layout=[(n, k) for n, k, _ in layout] if layout else None,
        split=shared.split(layout),
        params=group.params,
        widths=shared.widths,
        width_key=i,
        param_widths=shared.param_widths.get(i),  # [Note: widths per parameter]
        stale=stale,
        chunk=_grad_params(model, layout) if stale else (),
        twins=shared.twins,
        graphs=shared.graphs_of(i),
        **key,
    )
    group.module.set_custom_reduce_scatter(reduce)
    return reduce


def _auto(
    model: nn.Module,
    groups: list[FSDPGroup],
    *,
    mesh: DeviceMesh | None,
    replicate: dist.ProcessGroup | None,
    pipeline: bool,
) -> auto.AutoDecision:
    """``compress_fsdp(model, "auto")``: the policy's decision over FSDP's shard group (compressed
    HSDP: over the replicate group, whose all-reduce is the one to compress; the gathers and
    reduce-scatters inside the node stay FSDP2's own) for the model's groups as FSDP2 set them
    up, printed on rank 0 (qsdp.policy.auto)."""
    if mesh is not None and replicate is not None:
        raise ValueError(
            "recipe 'auto' with replicate= decides the all-reduce across the nodes; the mesh is "
            "for two-level reduce-scatters over FSDP's shard group: pass one of them"
        )
    shard = next((g.shard_group for g in groups if g.shard_group is not None), None)
    if shard is None or any(g.replicate_group is not None for g in groups):
        raise ValueError(
            "recipe 'auto' needs modules fully_shard-ed on one mesh dimension (no native HSDP)"
        )
    shards, gather_bytes, reduce_bytes = [], [], []
    for g in groups:
        if g.slots:
            shards.append(sum(s.elements for s in g.slots))
            gather_bytes.append(g.param_dtype.itemsize)
            reduce_bytes.append(g.reduce_dtype.itemsize)
    device = next(g.device for g in groups if g.params)
    if replicate is None:  # each collective apart: the weights' gathers, the gradients'
        decision = auto.decide_fsdp(
            shard,
            device,
            shards=shards,
            compute_bytes=gather_bytes,
            reduce_bytes=reduce_bytes,
            mesh=mesh,
            pipeline=pipeline,
        )
    else:  # one all-reduce of each module's shard across the nodes
        if len(set(reduce_bytes)) > 1:
            raise ValueError(
                f"recipe 'auto' with replicate=: the modules reduce in dtypes of {reduce_bytes} "
                "bytes; give them one MixedPrecisionPolicy(reduce_dtype=...)"
            )
        decision = auto.decide_all_reduce(
            replicate,
            device,
            numel=sum(shards),
            buckets=len(shards),
            element_size=reduce_bytes[0],
            pipeline=pipeline,
        )
    if dist.get_rank() == 0:
        print(decision.report(), flush=True)
    return decision


def _check_graphs(schedule: Schedule, shared: _Shared, groups: list[FSDPGroup]) -> None:
    """``Schedule(graphs=True)``'s conditions (the same on every rank: checked after the
    agreement): a codec to replay (a quantized reduce-scatter of one or two levels, quantized
    weights or weight differences gathered) and CUDA parameters."""
    if not schedule.graphs:
        return
    plan = shared.reduce
    gathers = isinstance(shared.config.weights, (QuantizedWeights, WeightDiffs))
    if not gathers and (plan is None or not plan.replayable):
        what = type(plan).__name__ if plan is not None else "FSDP2's own"
        raise ValueError(
            "Schedule(graphs=True) replays the codec of a quantized reduce-scatter or of a "
            f"quantized weight all-gather; this config reduces with {what} (compressed "
            "HSDP's all-reduce, Global-QSGD integers or "
            "uncompressed gradients have none) and gathers neither quantized weights nor "
            "weight differences: drop graphs, or use 'qsdp-w8g8', 'cgx' or 'sdp4bit'"
        )
    if not shared.replayed:
        raise ValueError(
            f"Schedule(graphs=True) replays the collectives of the FSDP modules whose shapes "
            f"another one shares (a model's repeated blocks: [Note: only repeated shapes "
            f"replayed] in qsdp.fsdp.api); this model's {len(groups)} FSDP modules each have "
            "shapes of their own: fully_shard each repeated block, or drop graphs"
        )
    qc.CodecGraphs.check_parameters(p for g in groups for p in g.params)


def repeated_shapes(groups: list[FSDPGroup]) -> frozenset[int]:
    """The indices of ``groups`` whose parameters' shapes, dtypes and gradients another group
    has too: the groups ``Schedule(graphs=True)`` replays.

    [Note: only repeated shapes replayed]
    A replayed collective holds buffers per shape and stream for the whole run (its input copied
    in, its payloads, its output: about one group's gradient and weights, [Note: codec segments
    replayed] in ``qsdp.comm._graphs``), shared by every group of that shape. A model's repeated
    blocks share one set, so replaying them costs one block's buffers and saves the host work
    of every block's calls; a group of shapes of its own (the root: embeddings and the head)
    holds a set for its one call a step. On the 1.42 B GPT the root is about four blocks' worth
    of parameters (untied 50 K x 2048 embedding and head): of the replays' buffers (counted on
    the CPU by ``benchmarks/replay_buffers.py`` for a GPT of those proportions, ``sdp4bit``, two
    ranks) 1.51 B a parameter with every module replayed, 0.30 without the root (+0.96 B a
    parameter of peak on 2x H200 with every module: ``benchmarks/results/session37_2026-11-29/``),
    for the host time of one reduce-scatter and one gather a step (~1 ms of a ~180 ms step, by
    the per-call times on one H200 in docs/fsdp.md). So only groups whose shapes repeat replay;
    the others stay eager, the same bits either way."""
    signature = [
        (tuple((s.elements, s.shape, s.requires_grad) for s in g.slots), g.param_dtype,
         g.reduce_dtype, tuple(p.dtype for p in g.params))
        for g in groups
    ]  # fmt: skip
    counts: dict[tuple, int] = {}
    for sig in signature:
        counts[sig] = counts.get(sig, 0) + 1
    return frozenset(
        i for i, (g, sig) in enumerate(zip(groups, signature, strict=True))
        if g.params and counts[sig] > 1
    )  # fmt: skip


def _check_pipeline(
    schedule: Schedule, replicate_pg: dist.ProcessGroup | None, config: CompressionConfig
) -> None:
    """``Schedule(pipeline=True)``'s conditions (the same on every rank: checked after the
    arguments were agreed)."""
    if not schedule.pipeline:
        return
    if replicate_pg is None:
        raise ValueError(
            "compress_fsdp(schedule=Schedule(pipeline=True)) pipelines compressed HSDP's "
            "replicate all-reduce: pass replicate= (FSDP2's own reduce-scatters are not "
            "pipelined; under DDP pass the schedule to qsdp.ddp.register), or drop it"
        )
    if config.grads is None:
        raise ValueError(
            "Schedule(pipeline=True) runs a compressed all-reduce's later exchange on a "
            "second communicator; this config's gradients are uncompressed: drop it"
        )
    if schedule.staleness:
        raise ValueError(
            "Schedule(pipeline=True) with staleness=1: the delayed reductions already "
            "overlap the next step on communicators of their own; drop one of them"
        )


def _hook_stream(params: list[nn.Parameter], k: int, made: SideStreams) -> torch.cuda.Stream | None:
    """The CUDA stream of the ``k``-th pipelined HSDP hook: two per device (``made``),
    alternating; None off CUDA, where there are no streams to alternate."""
    device = params[0].device if params else torch.device("cpu")
    return made.get(device, k) if device.type == "cuda" else None


def _fsdp_groups_of(model: nn.Module) -> tuple[list[FSDPModule], list[FSDPGroup]]:
    """The model's FSDPModules and their groups as FSDP2 set them up; refuses a model without
    any, or one whose modules already carry qsdp's hooks (the same on every rank running the
    same model: no collective)."""
    groups = fsdp_groups(model)
    if not groups:
        raise ValueError(
            "compress_fsdp found no FSDPModule in the model: call "
            "torch.distributed.fsdp.fully_shard on its blocks and its root first"
        )
    done = [g.name or "<root>" for g in groups if g.module in _HOOKED]
    if done:
        raise ValueError(
            f"compress_fsdp was already applied to FSDP modules {done[:4]} of this model: qsdp's "
            "hooks cannot be stacked or swapped in place; call it once per model (to change "
            "the recipe, build and fully_shard the model again)"
        )
    return [g.module for g in groups], groups


def _check_two_dimensional(mesh: object) -> None:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        raise ValueError(
            f"mesh must be a 2-D DeviceMesh (inter-node, intra-node); got {mesh!r}; build it "
            "with init_device_mesh(device, (nodes, gpus_per_node), "
            "mesh_dim_names=('inter', 'intra'))"
        )


def _as_group(replicate: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``replicate=`` as a process group (type checks only: the same on every rank)."""
    if replicate is None:
        return None
    if isinstance(replicate, DeviceMesh):
        if replicate.ndim != 1:
            raise ValueError(
                f"replicate must be a 1-D DeviceMesh (or process group) across nodes; got "
                f"{replicate.ndim} dims: pass mesh_2d['replicate']"
            )
        return replicate.get_group(0)
    if not isinstance(replicate, dist.ProcessGroup):
        raise TypeError(
            f"replicate must be a DeviceMesh or ProcessGroup, got {type(replicate).__name__}"
        )
    return replicate


def _check_agreed(
    groups: list[FSDPGroup],
    arguments: tuple,
    replicate: dist.ProcessGroup | None,
    mesh: DeviceMesh | None,
) -> None:
    """The same ``arguments`` on every rank of the model's groups, and arguments that agree
    with the layout FSDP2 set up; else every rank of those groups raises, naming the fix
    ([Note: agreement over the model's groups]): a ``replicate=`` group under native HSDP or
    overlapping FSDP's shard group (FSDP would reduce over those ranks twice), a two-level mesh
    that is not FSDP's shard group."""
    shard_groups = [g.shard_group for g in groups if g.shard_group is not None]
    native = [g.replicate_group for g in groups if g.replicate_group is not None]
    talk = shard_groups + native + ([replicate] if replicate is not None else []) or [None]
    check_same_arguments(arguments, groups=talk, what="qsdp.compress_fsdp")
    me = dist.get_rank()
    problem, fix = "", ""
    if mesh is not None:
        mesh_ranks = sorted(mesh.mesh.flatten().tolist())
        for g in groups:
            if g.shard_group is not None and sorted(g.shard_ranks) != mesh_ranks:
                problem = (
                    f"the two-level mesh {mesh.mesh.tolist()} ({len(mesh_ranks)} ranks) must hold "
                    f"exactly the ranks FSDP shards over; FSDP shards module "
                    f"'{g.name or '<root>'}' over ranks {list(g.shard_ranks)} (on rank {me})"
                )
                fix = (
                    "build it over FSDP's shard group, e.g. init_device_mesh(device, (nodes, "
                    "gpus_per_node)) for a model sharded over the world"
                )
                break
    if replicate is not None and not problem:
        replicas = set(dist.get_process_group_ranks(replicate))
        for g in groups:
            if g.replicate_group is not None:
                problem = (
                    f"replicate= was passed, but module '{g.name or '<root>'}' is native HSDP "
                    f"(fully_shard on a 2-D mesh, replicated over ranks {list(g.replicate_ranks)})"
                    ", whose own replicate all-reduce cannot be replaced"
                )
                fix = (
                    "shard the modules on the intra-node mesh only (fully_shard(m, "
                    "mesh=mesh_2d['shard'])) and pass replicate=mesh_2d['replicate']"
                )
                break
            both = sorted(replicas & set(g.shard_ranks or ()))
            if g.shard_group is not None and both != [me]:
                problem = (
                    f"the replicate group {sorted(replicas)} overlaps the group FSDP shards "
                    f"module '{g.name or '<root>'}' over ({list(g.shard_ranks)}) in ranks {both}: "
                    "FSDP2 already reduces over those ranks, and qsdp would average their "
                    "gradients a second time"
                )
                fix = (
                    "shard the modules on the intra-node mesh (fully_shard(m, "
                    "mesh=mesh_2d['shard'])) and pass replicate=mesh_2d['replicate'], or drop "
                    "replicate= to compress FSDP2's own reduce-scatter"
                )
                break
    agree_verdict(problem, groups=talk, what="qsdp.compress_fsdp", fix=fix)


def _check_replicate_grads(replicate: dist.ProcessGroup | None, config: CompressionConfig) -> None:
    """Compressed HSDP compresses an all-reduce: refuse a reduce-scatter's sub-config."""
    if replicate is None or config.grads is None:
        return
    if not isinstance(config.grads, (QuantizedGrads, IntegerGrads)):
        raise ValueError(
            f"compress_fsdp(replicate=...) compresses an all-reduce; "
            f"{type(config.grads).__name__} is a reduce-scatter: use QuantizedGrads ('cgx', "
            "'qsdp-g8') or IntegerGrads ('global-qsgd')"
        )


def _shape(mesh: DeviceMesh | dist.ProcessGroup | None) -> tuple[int, ...] | None:
    """What must agree across ranks of a mesh or group argument: its shape (its ranks differ
    between replicas: each node has its own replicate group)."""
    if mesh is None:
        return None
    if isinstance(mesh, DeviceMesh):
        return tuple(mesh.shape)
    return (dist.get_world_size(mesh),) if isinstance(mesh, dist.ProcessGroup) else (-1,)


def _grad_params(
    model: nn.Module, layout: list[tuple[str, int, tuple[int, ...]]]
) -> list[tuple[nn.Parameter, int]]:
    """(parameter, padded elements per rank) of a group's gradient chunk, for staleness 1."""
    return [(model.get_parameter(name), n) for name, n, _ in layout]


def _master_params(model: nn.Module, group: FSDPGroup) -> list[tuple[nn.Parameter, int]]:
    """(parameter, padded elements per rank) of the module's group, in all-gather order."""
    return [(model.get_parameter(name), n) for name, n, _ in group.layout(grads_only=False)]
