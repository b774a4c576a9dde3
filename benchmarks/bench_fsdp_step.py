"""FSDP2 training step time: plain FSDP2 beside qsdp's recipes, on the GPUs of one host.

    torchrun --nproc-per-node 4 benchmarks/bench_fsdp_step.py --regime socket --out r.json

(``benchmarks/run_fsdp_step.sh`` runs the regimes of ``docs/gpu.md``.) The model is the GPT of
``docs/gpu.md`` (``qsdp_train.model.GPT`` with ``GPT_1_4B`` below): a pre-norm decoder, 24
layers, d 2048, 16 heads, sequence 1024, vocabulary 50304 (1.42 B parameters), micro-batch 8 per
GPU, fp32 master weights with bf16 compute (``MixedPrecisionPolicy(param_dtype=bf16)``),
AdamW, every block ``fully_shard``-ed. Variants, side by side in one run on the same data:
``fsdp2-fp32-reduce`` (torchtitan's default), ``fsdp2-bf16-reduce``, and each ``--recipes``
entry through ``qsdp.compress_fsdp`` (bf16 gradients into the compressed reduce-scatter;
two-level recipes get the regime's (inter, intra) mesh: 2x2 on ``2x2``, 1x4 on ``nvlink``, none
on ``socket`` where every GPU is a node). Variant ``auto`` is ``compress_fsdp(model, "auto",
mesh=...)`` on the same mesh: it measures, chooses and records its choice in its row.
Rows: median seconds per step, tokens/s, ratio to both baselines, peak memory, first and last
loss (all variants start from the same weights and see the same batches). ``--device cpu``
runs a gloo smoke test with a tiny model.

``--loop-steps K`` also times K steps back to back per variant, one full synchronisation at
the end (row ``loop_s_per_step``): the timed steps each start after a barrier and the benchmark
all-reduces each one's time between them, gaps through which a staleness-1 reduction runs on
untimed; back to back it cannot. With ``--profile`` the K steps run once more under the
profiler (``NAME_loop.txt`` and its trace): the profiled step proper synchronises the device
after its forward and its backward (per-phase memory), so a staleness-1 reduction never
overlaps the next step there; in the loop's profile it does.

``--rounds R`` runs the variant list R times, every other round in reverse order, each variant
built afresh each round; its median is over the timed steps of all rounds and its row keeps
each round's median (``round_medians``). One pass measures each variant in one window of a few
seconds, so a drift of the machine (clocks, the other variants' leftovers) lands on whichever
variant ran then: two variants that run the same program (``auto`` where it keeps compression
off, beside plain FSDP2) differed by 2-4% over 5 steps each. Alternating rounds put every
variant on both sides of the drift.

``--hsdp`` (run it in the ``2x2`` regime): HSDP over 2 nodes, a (replicate, shard) mesh of
2 x world/2. The baselines are native HSDP (``fully_shard`` on the 2-D mesh) with fp32 and with
bf16 reduce (its replicate all-reduce crosses the nodes in that dtype); each recipe (default
``cgx``, ``global-qsgd``) is compressed HSDP: modules sharded on the intra-node mesh, the
replicate all-reduce through ``compress_fsdp(..., replicate=mesh["replicate"])``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import memory_peak  # benchmarks/, the script's own folder
import profiling
import qsdp
import regimes
import variants
import wire_replay
from qsdp.testing import assert_replicas_agree
from qsdp_train.model import GPT, ModelConfig

# The GPT of docs/gpu.md, 1.42 B parameters: qsdp's model with the options that reproduce this
# benchmark's own copy of it, which it carried until the model moved to the package (biased
# LayerNorms, untied head, PyTorch's default initialisation with zero positions; the same
# weights from the same seed), so results from before and after the move compare. See
# qsdp_train.model's [Note: the benchmark's GPT].
GPT_1_4B = ModelConfig(
    n_layer=24,
    n_head=16,
    d_model=2048,
    block_size=1024,
    vocab_size=50304,
    norm_bias=True,
    tie_head=False,
    init="torch",
)
TINY = replace(GPT_1_4B, n_layer=2, d_model=128, n_head=4, block_size=64, vocab_size=512)


def model_meta(c: ModelConfig) -> dict:
    """The JSON's ``model`` entry, under the keys summarize.py reads."""
    return {
        "layers": c.n_layer,
        "d": c.d_model,
        "heads": c.n_head,
        "seq": c.block_size,
        "vocab": c.vocab_size,
    }


@dataclass
class Row:
    variant: str
    s_per_step: float
    cpu_s_per_step: float
    tokens_per_s: float
    ratio_vs_fp32_reduce: float
    ratio_vs_bf16_reduce: float
    peak_mem_gib: float
    first_loss: float
    last_loss: float
    steps: int
    peak_alone_gib: float = 0.0
    """The peak above what was allocated when the variant started (a previous variant's
    leftover is not this variant's): its peak as if measured alone, with the model built."""
    wire_serial_s: float | None = None
    """--bounds: this step's collectives replayed with no compute, one after another."""
    wire_concurrent_s: float | None = None
    """--bounds: the same, gathers and reductions on two communicators at once."""
    step_over_wire: float | None = None
    """s_per_step / wire_serial_s."""
    step_over_bound: float | None = None
    """s_per_step / max(wire_concurrent_s, the compute-alone step)."""
    wire: dict | None = None
    auto: dict | None = None
    """Variant ``auto``: what it chose and the communication it predicted per step (s)."""
    round_medians: list[float] | None = None
    """--rounds: the median of each round's timed steps (s), in round order."""
    profile: dict | None = None
    """--profile: the profiled step's kernel launches, host ops and kernel time (rank 0's;
    ``profiling.counts``)."""
    loop_s_per_step: float | None = None
    """--loop-steps K: K steps run back to back as a training loop runs them, no
    synchronisation or collective of the benchmark between them, one full synchronisation at
    the end (every stream: a staleness-1 step's last reduction included); the slowest rank's
    seconds over K (the median over rounds)."""
    loop_clocks: dict | None = None
    """--loop-steps on CUDA: rank 0's SM clock (MHz), board power (W) and the share of samples
    the power limit held the clock down, sampled every 20 ms over those K steps (the means over
    rounds; ``profiling.Clocks``), and the board's joules over the K steps: at the power limit,
    added device work slows the matmuls though it overlaps them."""


def two_level_mesh(regime: str, device: torch.device):
    """The (inter, intra) mesh of the regime for two-level recipes: 2 nodes x 2 GPUs on 2x2,
    one node on NVLink; None on sockets, where every GPU is its own node (inter level only)."""
    ws = dist.get_world_size()
    shape = {"2x2": (2, ws // 2), "nvlink": (1, ws)}.get(regime)
    if shape is None:
        return None
    return init_device_mesh(device.type, shape, mesh_dim_names=("inter", "intra"))


def hsdp_mesh(device: torch.device):
    """HSDP's (replicate, shard) mesh: 2 nodes of world/2 GPUs."""
    ws = dist.get_world_size()
    if ws % 2:
        raise SystemExit(f"--hsdp needs an even number of GPUs (2 nodes), got {ws}")
    return init_device_mesh(device.type, (2, ws // 2), mesh_dim_names=("replicate", "shard"))


def build(
    c: ModelConfig,
    device: torch.device,
    reduce_dtype,
    recipe: str | None,
    compute_dtype,
    mesh=None,
    hsdp=None,
):
    """The sharded GPT. ``hsdp``: the (replicate, shard) mesh: native HSDP without a recipe,
    compressed HSDP (sharded inside the node, replicate all-reduce by qsdp) with one."""
    torch.manual_seed(0)
    with device:
        model = GPT(c)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    shard_on = None if hsdp is None else (hsdp if recipe is None else hsdp["shard"])
    if recipe == "compute-alone":  # every rank alone: a 1-GPU step of the same shape
        shard_on = _solo_mesh(device)
    for block in model.blocks:
        fully_shard(block, mesh=shard_on, mp_policy=mp)
    fully_shard(model, mesh=shard_on, mp_policy=mp)
    if recipe is None or recipe == "compute-alone":
        return model
    # NAME+s1: the recipe at staleness 1 as shipped (Schedule(staleness=1): its default
    # predict="local" computes each delayed gradient at Adam's next step from each rank's own
    # gradient, on hooks; +local, once the prediction by hand, is that default and kept as a name);
    # NAME+own: its reduce-scatters on their own communicator (Schedule.own_reduce_group; off
    # without it, also for qsdp-w8g8); NAME+pipe (--hsdp): Schedule(pipeline=True); NAME+prop:
    # nonfinite="propagate"; NAME+gN: gradients in groups of N; NAME+s1+ahead: the next step's
    # weights gathered in the backward (Schedule(gather_ahead=True)); NAME+graphs: the
    # codecs replayed from CUDA graphs (Schedule(graphs=True): the reduce-scatter's, of one
    # level or two, at staleness 1 too, and the weight gathers')
    name, *options = recipe.split("+")
    group = variants.group_size(options)
    if (
        set(options) - {"s1", "own", "local", "pipe", "prop", "ahead", "graphs", f"g{group}"}
        or (("local" in options or "ahead" in options) and "s1" not in options)
        or ("pipe" in options and hsdp is None)
        or ("graphs" in options and hsdp is not None)
    ):
        raise SystemExit(
            f"variant {recipe!r}: options are +s1 (+local, +ahead with it), +own, +prop, +gN, "
            "+graphs (FSDP2 alone) and, with --hsdp, +pipe"
        )
    if name == "auto":  # measures the regime's groups and picks (qsdp.policy.auto)
        if options:
            raise SystemExit(f"variant {recipe!r}: 'auto' takes no +options")
        if hsdp is not None:
            return qsdp.compress_fsdp(model, "auto", replicate=hsdp["replicate"])
        return qsdp.compress_fsdp(model, "auto", mesh=mesh)
    # +prop: no NaN/Inf check at all
    config = qsdp.recipe(name, **({"nonfinite": "propagate"} if "prop" in options else {}))
    schedule = qsdp.Schedule(
        staleness=int("s1" in options),
        own_reduce_group="own" in options,
        pipeline="pipe" in options,
        gather_ahead="ahead" in options,
        graphs="graphs" in options,
        start=0,  # (a few timed steps: the delayed schedule from the first)
    )
    if group:
        config = variants.with_group_size(config, group)
    if hsdp is not None:
        qsdp.compress_fsdp(model, config, replicate=hsdp["replicate"], schedule=schedule)
    else:
        two_level = mesh if config.two_level else None
        qsdp.compress_fsdp(model, config, mesh=two_level, schedule=schedule)
    return model


def _solo_mesh(device: torch.device):
    """A 1-rank mesh of this rank (``new_group`` is collective: every rank makes them all)."""
    from torch.distributed.device_mesh import DeviceMesh

    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return DeviceMesh.from_group(mine, device.type)


@dataclass
class Measured:
    """One variant's timed steps, over one round or several (:func:`merge`)."""

    times: list[float]
    cpu_times: list[float]
    losses: list[float]
    peak: float
    start: float
    wire: dict
    decision: dict | None
    round_medians: list[float]
    profile: dict | None = None
    loop_times: list[float] | None = None
    loop_clocks: list[dict] | None = None


def _mean_clocks(rounds: list[dict] | None) -> dict | None:
    """The rounds' clock summaries (``profiling.Clocks.summary``) as one: each figure's mean
    weighted by the samples, the samples summed, the joules of a round's steps averaged."""
    if not rounds:
        return None
    n = sum(k["samples"] for k in rounds)
    out = {f: sum(k[f] * k["samples"] for k in rounds) / n for f in ("sm_mhz", "power_w")}
    capped = sum(k["power_capped"] * k["samples"] for k in rounds) / n
    joules = [k.get("joules") for k in rounds]
    return {
        **{f: round(v) for f, v in out.items()},
        "power_capped": round(capped, 2),
        "samples": n,
        "joules": None if None in joules else round(sum(joules) / len(joules), 1),
    }


def _choice(decision: dict | None) -> dict | None:
    """What an ``auto`` decision chose (its strings), without what it measured (numbers, which
    differ from round to round)."""
    if decision is None:
        return None
    return {k: v for k, v in decision.items() if isinstance(v, str)}


def merge(rounds: list[Measured]) -> Measured:
    """A variant's rounds as one measurement: every round's timed steps; losses, wire and the
    start from the first round (the same weights and batches each round); the highest peak.
    An ``auto`` variant measures and decides again each round: its choices must agree, or the
    rounds would time different programs (the first round's measurement is kept)."""
    first = rounds[0]
    decisions = {json.dumps(_choice(r.decision), sort_keys=True) for r in rounds}
    if len(decisions) > 1:
        raise SystemExit(
            f"--rounds: 'auto' chose differently in different rounds ({sorted(decisions)}); "
            "its steps would mix programs: run with --rounds 1 and say so"
        )
    return Measured(
        times=[t for r in rounds for t in r.times],
        cpu_times=[t for r in rounds for t in r.cpu_times],
        losses=first.losses,
        peak=max(r.peak for r in rounds),
        start=first.start,
        wire=first.wire,
        decision=first.decision,
        round_medians=[m for r in rounds for m in r.round_medians],
        profile=first.profile,
        loop_times=[t for r in rounds for t in (r.loop_times or [])] or None,
        loop_clocks=[k for r in rounds for k in (r.loop_clocks or [])] or None,
    )


def _allocated_now(device: torch.device) -> int:
    """The bytes allocated once the device is idle: a block freed while a side stream still
    used it (``record_stream``) counts as allocated until the caching allocator's next malloc
    reads its stream's event, so one tiny allocation first."""
    torch.cuda.synchronize(device)
    torch.empty(1, device=device)
    return torch.cuda.memory_allocated(device)


def run_variant(
    name, c, args, device, recipe, reduce_dtype, compute_dtype, *, extras: bool = True
) -> Measured:
    """Build the variant and time its steps (``extras``: also the --profile / --bounds steps,
    which later rounds skip)."""
    if device.type == "cuda":
        left = _allocated_now(device)
        if left > 2**28 and dist.get_rank() == 0:
            print(f"  warning: {left / 2**30:.2f} GiB still allocated before {name}", flush=True)
    record = args.mem_peak is not None and device.type == "cuda" and dist.get_rank() == 0
    before = memory_peak.start() if record else 0
    hsdp = hsdp_mesh(device) if args.hsdp else None
    mesh = None if args.hsdp else two_level_mesh(args.regime, device)
    model = build(c, device, reduce_dtype, recipe, compute_dtype, mesh, hsdp)
    _LAST_MODEL[0] = weakref.ref(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    times, cpu_times, losses = [], [], []
    start = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device) / 2**30  # the model, and any leftover
        torch.cuda.reset_peak_memory_stats(device)
    timed = args.warmup + args.steps
    state = qsdp.fsdp.comm_state(model) if recipe not in (None, "compute-alone") else None
    stale = state is not None and "+s1" in recipe
    # a stale step ends when the compute stream is done: its reduction runs on into the next
    # step (that is the point), so no full device sync may wait for it, before or after a step
    step_sync = profiling.compute_sync if stale else profiling.sync
    # staleness 1 computes ahead on the schedule's hooks (predict="local", the default; one
    # more buffer of the local shards, in the peak memory). No WeightPrediction by hand: it
    # would move the parameters a second time ([Note: one prediction per parameter])
    # extra steps after the measured ones: one profiled (--profile), one whose collectives are
    # read for the wire-alone replay (--bounds)
    bounds = args.bounds and recipe != "compute-alone"  # (no communication to replay)
    extra = (["profile"] if args.profile else []) + (["bounds"] if bounds else [])
    extra += ["cprofile"] * (3 if args.cprofile else 0)
    extra = extra if extras else []
    wire: dict = {}
    counted: dict | None = None
    for i in range(timed + len(extra)):
        what = extra[i - timed] if i >= timed else None
        profiled = what == "profile"
        prof = profiling.profiler(device) if what in ("profile", "bounds") else None
        host = profiling.host_profiler() if what == "cprofile" else None
        if prof is not None:
            prof.__enter__()
        if args.mem_trace and device.type == "cuda" and dist.get_rank() == 0:
            print(
                f"  {name} step {i} starts at {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB"
            )
        batch = _batch(c, args, device, g)
        step_sync(device)
        dist.barrier()
        if host is not None:
            host.enable()
        t0 = time.perf_counter()
        phases = _Phases(device, profiled)
        loss = _train_step(model, opt, batch, c, skip=stale and state.applied_nothing, at=phases)
        cpu_elapsed = time.perf_counter() - t0  # the host's launch time; < elapsed: GPU-bound
        step_sync(device)
        elapsed = time.perf_counter() - t0
        if host is not None:
            host.disable()
            if i == timed + len(extra) - 1 and dist.get_rank() == 0:
                profiling.write_host_profile(host, args.cprofile / f"{args.regime}_{name}.txt")
            continue
        if prof is not None:
            prof.__exit__(None, None, None)
            if what == "bounds":
                wire = _wire_alone(prof, device)
                continue
            counted = profiling.counts(prof)
            if dist.get_rank() == 0 or args.profile_all_ranks:
                suffix = f"_rank{dist.get_rank()}" if args.profile_all_ranks else ""
                path = args.profile / f"{args.regime}_{name}{suffix}.txt"
                profiling.write_profile(prof, path, elapsed, phases.report())
            continue
        slowest = torch.tensor([elapsed], device=device, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(float(slowest))
            cpu_times.append(cpu_elapsed)
        losses.append(float(loss.detach()))
        if dist.get_rank() == 0:
            print(f"  {name} step {i}: {float(slowest):.3f} s loss {losses[-1]:.4f}", flush=True)
        if i == timed - 1:  # the measured steps' peak, before a profiled step resets it
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    loop, loop_clocks = None, None
    if args.loop_steps:
        clocks = profiling.Clocks(device)
        loop = _loop_time(model, opt, state, stale, c, args, device, g, clocks=clocks)
        loop_clocks = clocks.summary
        if args.profile and extras:  # the same steps again, profiled: steps as a loop runs them
            prof = profiling.profiler(device, device_only=args.profile_device_only)
            with prof:
                elapsed = _loop_time(model, opt, state, stale, c, args, device, g)
            if dist.get_rank() == 0 or args.profile_all_ranks:
                suffix = f"_rank{dist.get_rank()}" if args.profile_all_ranks else ""
                path = args.profile / f"{args.regime}_{name}_loop{suffix}.txt"
                what = f"{args.loop_steps} steps back to back, the wall per step above"
                profiling.write_profile(prof, path, elapsed, what)
    if stale:  # the last gradient, as a training loop ends
        state.drain()
        opt.step()
        opt.zero_grad(set_to_none=True)
        profiling.sync(device)
    if record:  # who held the memory at the highest point of the build and the steps
        profiling.sync(device)
        memory_peak.write(args.mem_peak / f"{args.regime}_{name}.txt", device, before=before)
    if hsdp is not None:  # a shard's replicas that drifted apart measured a broken exchange
        assert_replicas_agree(model, hsdp["replicate"].get_group())
    decision = getattr(state, "decision", None)  # an "auto" variant's choice, as JSON
    decision = decision.record() if decision is not None else None
    return Measured(
        times=times,
        cpu_times=cpu_times,
        losses=losses,
        peak=peak,
        start=start,
        wire=wire,
        decision=decision,
        round_medians=[statistics.median(times)],
        profile=counted,
        loop_times=[loop] if loop is not None else None,
        loop_clocks=[loop_clocks] if loop_clocks is not None else None,
    )


_LAST_MODEL: list = [None]
"""A weak reference to the model the last run built (``_release`` says whether it went)."""


def _release(name: str, device: torch.device, trace: bool) -> None:
    """Free what the variant ``name`` built before the next one is built: one collection once
    its run has returned. FSDP2's module <-> state references form cycles, which the run's
    own locals keep reachable until it returns: a collection inside it freed none of them, and
    on 2x H200 every variant began with the last one's still allocated (2.70 GiB after plain
    FSDP2, a float32 shard of the 1.42 B GPT; after the return one collection frees all:
    session 39's ``probe_leftover.py``). ``trace``: rank 0 prints whether the model is gone
    (any device) and, on CUDA, what is left allocated, and 2 s later."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not trace or dist.get_rank() != 0:
        return
    ref = _LAST_MODEL[0]
    gone = "freed" if ref is None or ref() is None else "still alive"
    line = f"  {name}: model {gone} after the run and a collection"
    if device.type == "cuda":
        left = _allocated_now(device) / 2**30
        time.sleep(2.0)  # NCCL's watchdog releases the tensors of finished collectives
        gc.collect()
        later = _allocated_now(device) / 2**30
        line += f", {left:.2f} GiB left, {later:.2f} 2 s later"
    print(line, flush=True)


def _batch(c, args, device: torch.device, g) -> torch.Tensor:
    """One step's tokens (inputs and next-token targets), drawn on the device."""
    shape = (args.batch, c.block_size + 1)
    return torch.randint(0, c.vocab_size, shape, device=device, generator=g)


def _train_step(model, opt, batch, c, *, skip: bool, at: _Phases | None = None) -> torch.Tensor:
    """Forward, backward and AdamW (``skip``: no ``optimizer.step()``, as a staleness-1 step
    that applied nothing); ``at`` marks the phases. Returns the loss."""
    # the loss outside the model, as before the model moved to the package: FSDP's root
    # pre-backward hook (the last block's prefetch) fires on the logits, after its backward
    logits, _ = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, c.vocab_size), batch[:, 1:].reshape(-1))
    if at is not None:
        at.mark("forward")
    loss.backward()
    if at is not None:
        at.mark("backward")
    if not skip:
        opt.step()
    opt.zero_grad(set_to_none=True)
    if at is not None:
        at.mark("optimizer")
    return loss


def _loop_time(
    model, opt, state, stale: bool, c, args, device: torch.device, g, clocks=None
) -> float:
    """--loop-steps: the timed steps above each start after a barrier and end with a
    synchronisation, and between two of them the benchmark all-reduces the step's time: a
    staleness-1 reduction runs on through those gaps untimed, and the next step may start with
    the link free. Here ``args.loop_steps`` steps run back to back as a training loop runs them,
    one full synchronisation at the end (the last reduction in flight included, a tail once
    per K steps); the slowest rank's seconds per step. ``clocks`` (a ``profiling.Clocks``)
    samples this rank's SM clock and power over the steps."""
    profiling.sync(device)
    dist.barrier()
    profiling.sync(device)
    with clocks if clocks is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(args.loop_steps):
            batch = _batch(c, args, device, g)
            _train_step(model, opt, batch, c, skip=stale and state.applied_nothing)
        profiling.sync(device)
        elapsed = time.perf_counter() - t0
    slowest = torch.tensor([elapsed], device=device, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest) / args.loop_steps


def _wire_alone(prof, device: torch.device) -> dict:
    """The profiled step's collectives (this rank's, in issue order) replayed with no compute,
    serial and concurrent (see wire_replay.py); nothing on CPU (gloo records no collectives)."""
    if device.type != "cuda":
        return {}
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        colls, skipped = wire_replay.parse(wire_replay.read_trace(Path(tmp)))
    finally:
        os.unlink(tmp)
    replay = wire_replay.Replayer(colls, device)
    if not colls:
        raise RuntimeError(
            "--bounds: the profiled step recorded no collectives (record_param_comms events); "
            f"this torch's profiler may name them otherwise (skipped: {sorted(set(skipped))})"
        )
    out = {
        "collectives": len(colls),
        "wire_serial_s": round(replay.time(concurrent=False), 4),
        "wire_concurrent_s": round(replay.time(concurrent=True), 4),
        **wire_replay.summarize(colls),
    }
    if skipped:
        out["skipped"] = sorted(set(skipped))
    replay.close()
    return out


class _Phases:
    """Peak memory of a step's forward, backward and optimizer (CUDA, when asked)."""

    def __init__(self, device: torch.device, on: bool) -> None:
        self.on = on and device.type == "cuda"
        self.device, self.rows = device, []
        if self.on:
            torch.cuda.synchronize(device)
            self.rows.append(("start", torch.cuda.memory_allocated(device), 0))
            torch.cuda.reset_peak_memory_stats(device)

    def mark(self, name: str) -> None:
        if self.on:
            torch.cuda.synchronize(self.device)
            d = self.device
            self.rows.append(
                (name, torch.cuda.memory_allocated(d), torch.cuda.max_memory_allocated(d))
            )
            torch.cuda.reset_peak_memory_stats(d)

    def report(self) -> str:
        return "\n".join(
            f"memory {n:<10} allocated after {a / 2**30:6.2f} GiB, peak during {p / 2**30:6.2f} GiB"
            for n, a, p in self.rows
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regime", choices=sorted(regimes.REGIMES), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--recipes",
        nargs="*",
        help="default: qsdp-w8g8 global-qsgd sdp4bit sdp4bit+s1 qsdp-w8g8+s1 (with --hsdp: cgx "
        "cgx+pipe global-qsgd cgx+s1); NAME+s1 is the recipe at staleness 1, its step timed to "
        "the end of the compute stream (its reduction runs on into the next step), drained at "
        "the end; NAME+s1+ahead also gathers the next step's weights in the backward "
        "(Schedule(gather_ahead=True), weight differences); NAME+pipe (--hsdp) pipelines the "
        "replicate all-reduce across modules; NAME+graphs replays the codecs of the "
        "reduce-scatter (one level or two) and the weight gathers from CUDA graphs "
        "(Schedule(graphs=True); NAME+s1+graphs at staleness 1)",
    )
    p.add_argument("--hsdp", action="store_true", help="HSDP on 2 nodes (see the docstring)")
    p.add_argument(
        "--baselines",
        nargs="*",
        choices=["fp32", "bf16"],
        default=["fp32", "bf16"],
        help="the plain FSDP2 (or native HSDP) reduce dtypes to run first; none: only --recipes "
        "(e.g. one variant's peak memory in a process of its own)",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants this many times, every other round in reverse order; medians "
        "over all rounds' steps (see the docstring)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--loop-steps",
        type=int,
        default=0,
        help="also time K steps back to back, one synchronisation at the end (row "
        "loop_s_per_step; the timed steps each start after a barrier)",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d-128 model (smoke tests)")
    p.add_argument(
        "--mem-trace",
        action="store_true",
        help="print allocated memory per step (CUDA), and whether each variant's model was freed",
    )
    p.add_argument("--profile", type=Path, help="profile one extra step per variant into DIR")
    p.add_argument(
        "--mem-peak",
        type=Path,
        help="rank 0's peak memory by the line that allocated it, per variant into DIR "
        "(memory_peak.py; records the allocator's history: not for timing)",
    )
    p.add_argument(
        "--cprofile",
        type=Path,
        help="the host's Python time of 3 extra steps per variant (cProfile, rank 0) into DIR",
    )
    p.add_argument(
        "--profile-device-only",
        action="store_true",
        help="with --profile and --loop-steps: the back-to-back steps' profile records the "
        "device's kernels and the CUDA runtime's calls only, no host ops (the host ops' "
        "recording slows the host enough to make it the binder; trace_summary.py --lateness "
        "then reads the ranks' skew as an unprofiled loop has it)",
    )
    p.add_argument(
        "--profile-all-ranks",
        action="store_true",
        help="with --profile: every rank writes its profile (NAME_rankR.txt), not rank 0 alone "
        "(skew between ranks: a collective's kernel waits for its slowest peer)",
    )
    p.add_argument(
        "--bounds",
        action="store_true",
        help="the physical bounds, in the same run: each variant's collectives replayed with no "
        "compute (serial and concurrent, wire_replay.py; NCCL only: on CPU only the "
        "compute-alone row runs) and a compute-alone row",
    )
    a = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    env = regimes.apply(a.regime, local_rank, a.device)
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_fsdp_step.py needs CUDA GPUs (or --device cpu)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        name = torch.cuda.get_device_name(device)
        compute = torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        name = "cpu"
        compute = torch.float32  # gloo has no bf16 reduce for the baselines
    c = TINY if a.tiny else GPT_1_4B
    ws = dist.get_world_size()
    if a.recipes is None:
        a.recipes = (
            ["cgx", "cgx+pipe", "global-qsgd", "cgx+s1"]
            if a.hsdp
            else ["qsdp-w8g8", "global-qsgd", "sdp4bit", "sdp4bit+s1", "qsdp-w8g8+s1"]
        )
    base = "hsdp" if a.hsdp else "fsdp2"
    variants = [
        (f"{base}-{b}-reduce", None, torch.float32 if b == "fp32" else compute) for b in a.baselines
    ]
    variants += [(r, r, compute) for r in a.recipes]
    if a.bounds:  # the compute bound: no communication, each GPU its own 1-rank FSDP group
        variants.append(("compute-alone", "compute-alone", compute))
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: give 1 or more")
    measured: dict[str, list[Measured]] = {v: [] for v, _, _ in variants}
    for k in range(a.rounds):
        for vname, recipe, reduce_dtype in variants if k % 2 == 0 else variants[::-1]:
            m = run_variant(vname, c, a, device, recipe, reduce_dtype, compute, extras=k == 0)
            _release(vname, device, a.mem_trace)
            measured[vname].append(m)
            if m.wire and dist.get_rank() == 0:  # now: a later variant's failure keeps these
                print(f"  {vname} wire alone: {json.dumps(m.wire)}", flush=True)
    results = {v: merge(rounds) for v, rounds in measured.items()}
    tokens = a.batch * c.block_size * ws
    # (a run without a baseline, e.g. one variant's memory in a process of its own: ratios 0)
    median = {v: statistics.median(m.times) for v, m in results.items()}
    base32 = median.get(f"{base}-fp32-reduce", 0.0)
    base16 = median.get(f"{base}-bf16-reduce", 0.0)
    compute_s = median["compute-alone"] if a.bounds else None
    rows = []
    for v, m in results.items():
        t, cpu_t, losses, peak, wire = (
            median[v],
            statistics.median(m.cpu_times),
            m.losses,
            m.peak,
            m.wire,
        )
        serial, both = wire.get("wire_serial_s"), wire.get("wire_concurrent_s")
        bound = max(both, compute_s) if both and compute_s else None
        rows.append(
            Row(
                v,
                round(t, 4),
                round(cpu_t, 4),
                round(tokens / t, 1),
                round(base32 / t, 3),
                round(base16 / t, 3),
                round(peak, 2),
                round(losses[0], 4),
                round(losses[-1], 4),
                a.steps,
                peak_alone_gib=round(peak - m.start, 2),
                wire_serial_s=serial,
                wire_concurrent_s=both,
                step_over_wire=round(t / serial, 3) if serial else None,
                step_over_bound=round(t / bound, 3) if bound else None,
                wire=wire or None,
                auto=m.decision,
                round_medians=[round(x, 4) for x in m.round_medians] if a.rounds > 1 else None,
                profile=m.profile,
                loop_s_per_step=round(statistics.median(m.loop_times), 4) if m.loop_times else None,
                loop_clocks=_mean_clocks(m.loop_clocks),
            )
        )
    if dist.get_rank() == 0:
        for r in rows:
            print(
                f"{a.regime:<7} {r.variant:<20} {r.s_per_step:8.3f} s/step "
                f"(host {r.cpu_s_per_step:.3f}) "
                f"{r.tokens_per_s:10.0f} tok/s  x{r.ratio_vs_fp32_reduce:.2f} vs fp32-reduce "
                f"x{r.ratio_vs_bf16_reduce:.2f} vs bf16-reduce  peak {r.peak_mem_gib:.1f} GiB "
                f"loss {r.first_loss:.3f}->{r.last_loss:.3f}",
                flush=True,
            )
            if r.profile:
                print(f"        profiled step: {json.dumps(r.profile)}", flush=True)
            if r.loop_s_per_step:
                k = r.loop_clocks
                at = (
                    f" (rank 0: SM {k['sm_mhz']} MHz, {k['power_w']} W, power-capped in "
                    f"{k['power_capped']:.0%} of samples"
                    + (f", {k['joules'] / a.loop_steps:.1f} J/step)" if k["joules"] else ")")
                    if k
                    else ""
                )
                loop = f"{a.loop_steps} steps back to back: {r.loop_s_per_step:.3f} s/step"
                print(f"        {loop}{at}", flush=True)
            if r.round_medians:
                print(
                    f"        rounds: {' '.join(f'{x:.3f}' for x in r.round_medians)} s", flush=True
                )
            if r.wire_serial_s:
                print(
                    f"        wire alone {r.wire_serial_s:.3f} s serial, "
                    f"{r.wire_concurrent_s:.3f} s concurrent: step = x{r.step_over_wire:.2f} "
                    f"serial wire, x{r.step_over_bound or 0:.2f} max(concurrent wire, compute "
                    f"{compute_s or 0:.3f} s); peak alone {r.peak_alone_gib:.1f} GiB",
                    flush=True,
                )
        meta = {
            "benchmark": "bench_fsdp_step",
            "device": name,
            "world_size": ws,
            "torch": torch.__version__,
            "regime": a.regime,
            "hsdp": a.hsdp,
            "env": env,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": model_meta(c),
            "micro_batch": a.batch,
            "rounds": a.rounds,
            "compute_dtype": str(compute),
            "params": c.n_params(),
            "rows": [asdict(r) for r in rows],
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(meta, indent=2))
        print(f"wrote {a.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
