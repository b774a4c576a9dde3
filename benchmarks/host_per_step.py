"""Host time of a whole FSDP2 training step, plain beside qsdp's recipes, without wire or kernels.

    PYTHONPATH=src python benchmarks/host_per_step.py --out r.json [--recipes qsdp-w8g8 ...]
    PYTHONPATH=src python benchmarks/host_per_step.py --device cuda --block gpt --out r.json \
        --cprofile prof.txt      # a GPU's host, the real kernels, where the Python goes

What a compressed FSDP2 step adds on the CPU (issue 32: on NVLink the step is host-bound): a
stack of ``--blocks`` small residual MLP blocks (d ``--d``, a LayerNorm and two Linears each,
every block ``fully_shard``-ed, 1-D parameters sent raw by the recipes' policies), a forward and
backward per step on a ``fake`` process group of 4 ranks (collectives return at once) with every
quantizer kernel a no-op (``host_per_bucket.py``'s stubs), so neither wire nor kernel time is
counted: plain FSDP2's own Python and dispatch, and each recipe's on top. Recipes run with
``nonfinite="zero"`` (stubbed kernels leave garbage behind; the verdict still runs, its zeroing
on the device counted like the rest). Rows: median milliseconds per step over ``--steps``;
the torch ops the Python issued in one profiled step (not those inside other ops; by name and
by the qsdp hook that issued them, ``issued_ops_by_hook`` / ``_by_name``); qsdp's hook
calls and microseconds per call of each hook kind (the ``qsdp::`` profiler scopes; profiled,
so slower than the timed steps). ``--rounds R`` times the steps in R rounds that interleave the
variants (each round in another order; every model is built first), so a host that drifts
during a run reaches every variant alike; each row keeps its rounds' medians.
Runs on any machine; compare rows of one run.

``--device cuda`` runs the same on a GPU with the real Triton kernels (``--stub`` keeps them
no-ops): the model is so small that the device never holds the host back, and each step starts
from an empty device queue (a synchronisation before it, untimed), so a row is what the host
pays to issue a step, launches included. ``--block gpt`` uses a GPT block's 12 parameters (two
LayerNorms, the attention's two Linears and the MLP's two, attention itself left out: it adds no
collective) instead of the 6 of a LayerNorm and an MLP. ``--cprofile FILE`` writes, per recipe,
cProfile's functions by own and by cumulative time over ``--steps`` more steps, the backward
run on the calling thread (``torch.autograd.set_multithreading_enabled(False)``: on a GPU the
backward's hooks otherwise run on autograd's device thread, which cProfile does not see).

``--ddp BUCKET_KB`` times DDP instead (the same blocks in ``DistributedDataParallel`` with buckets
of that many KiB, on the fake group): ``noop`` (a hook that hands each bucket back: DDP's own
all-reduce and PyTorch's ``bf16_compress_hook`` need results from the process group, which the fake
one does not give: ``bench_ddp_step.py`` runs them) is the floor, then qsdp's DDP recipes (``cgx``,
``qsdp-g8``, ``global-qsgd``; ``NAME+pipeline``, ``NAME+graphs``, ``NAME+s1`` with
``--optimizer``). ``--ddp 64`` gives a small model
about as many buckets as a GPT-124M has of DDP's 25 MiB.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.distributed.fake_pg import FakeStore

import host_per_bucket  # benchmarks/, the script's own folder: the kernel stubs
import qsdp


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 3 * d)
        self.fc2 = nn.Linear(3 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class GPTBlock(nn.Module):
    """A GPT block's parameters (12: two LayerNorms, qkv and proj, the MLP's two Linears), its
    attention a plain mix of the qkv projections (no collective depends on what it computes)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) * v)
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


def build(
    recipe: str,
    blocks: int,
    d: int,
    *,
    block: str = "mlp",
    device: str = "cpu",
    schedule: qsdp.Schedule | None = None,
    ddp_bucket_kb: float | None = None,
    mesh=None,
) -> nn.Module:
    name, *options = recipe.split("+")
    if ddp_bucket_kb is not None:
        pass  # (DDP's variants: _ddp)
    elif [o for o in options if o != "graphs"] not in ([], ["s1"], ["s1", "ahead"]):
        raise SystemExit(
            f"recipe {recipe!r}: the options are +s1 (staleness 1), +s1+ahead (with the "
            "next step's weights gathered in the backward) and +graphs (the codecs replayed "
            "from CUDA graphs, --device cuda), last"
        )
    if options:  # +s1: the delayed schedule from the first step, as bench_fsdp_step.py's
        schedule = qsdp.Schedule(  # +graphs: [Note: codec segments replayed]
            graphs="graphs" in options,
            staleness=int("s1" in options),
            start=0,
            gather_ahead="ahead" in options,
        )
    torch.manual_seed(0)
    kind = GPTBlock if block == "gpt" else Block
    model = nn.Sequential(*[kind(d) for _ in range(blocks)]).to(device)
    if ddp_bucket_kb is not None:
        return _ddp(model, name, options, ddp_bucket_kb)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    if name != "plain":
        config = qsdp.recipe(name, nonfinite="zero")
        qsdp.compress_fsdp(model, config, schedule=schedule, **_mesh_for(config, mesh))
    return model


def _mesh_for(config, mesh) -> dict:
    """``mesh=`` for a recipe with two-level gradients (``sdp4bit``) under ``--mesh``."""
    two_level = isinstance(getattr(config, "grads", None), qsdp.TwoLevelGrads)
    return {"mesh": mesh} if mesh is not None and two_level else {}


def _noop_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks unannotated or exact types
    """DDP's bucketing and nothing else (the floor a hook's host work adds to): ``state`` counts
    the calls."""
    state.append(bucket.index())
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _ddp(model: nn.Module, name: str, options: list[str], bucket_kb: float) -> nn.Module:
    """``model`` in DDP with buckets of ``bucket_kb`` KiB (a GPT-124M's step has ~20 buckets of
    DDP's 25 MiB: as many here on a small model), and ``name``'s hook: ``noop`` (hands each
    bucket back) or qsdp's recipe (``+pipeline``:
    ``Schedule(pipeline=True)``, the buckets alternating between two communicators and hook
    streams; ``+graphs``: ``Schedule(graphs=True)``, CGX's two phases replayed; ``+s1``:
    ``Schedule(staleness=1, start=0)``, as ``bench_ddp_step.py``'s, needs ``--optimizer``)."""
    if options not in ([], ["pipeline"], ["graphs"], ["s1"]) or (options and name == "noop"):
        raise SystemExit(
            f"DDP variant {name!r}+{'+'.join(options)}: the options are +pipeline, +graphs and +s1"
        )
    model = DDP(model, bucket_cap_mb=bucket_kb / 1024)
    if name == "noop":
        model.hook_calls = []
        model.register_comm_hook(model.hook_calls, _noop_hook)
    else:
        if options == ["s1"]:  # the delayed schedule from the first step
            schedule = qsdp.Schedule(staleness=1, start=0)
        else:
            schedule = qsdp.Schedule(**{options[0]: True}) if options else None
        qsdp.ddp.register(model, qsdp.recipe(name, nonfinite="zero"), schedule=schedule)
    return model


def _in_aten(event) -> bool:
    """Whether a profiler event runs inside a torch op (not one the Python issued itself)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _hook_of(event) -> str:
    """The qsdp hook scope (``qsdp::reduce-scatter``, ...) an event runs in, or ``""``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("qsdp::"):
            return parent.name.split(" (")[0]
        parent = parent.cpu_parent
    return ""


class Variant:
    """One recipe's model, built and warmed up, whose steps are timed in rounds."""

    def __init__(
        self,
        recipe: str,
        *,
        blocks: int,
        d: int,
        block: str,
        device: str,
        optimizer: bool,
        single_thread: bool = False,
        ddp_bucket_kb: float | None = None,
        mesh=None,
    ) -> None:
        self.recipe, self.device, self.single_thread = recipe, device, single_thread
        model = build(
            recipe, blocks, d, block=block, device=device, ddp_bucket_kb=ddp_bucket_kb, mesh=mesh
        )
        self.model = model
        x = torch.randn(4, d, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer else None

        def step() -> None:
            model(x).pow(2).mean().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)

        self.step = step
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.round_medians: list[float] = []
        for _ in range(5):  # first-call work (plans, caches, captures) out of the timing
            step()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time(self, steps: int) -> None:
        """``steps`` steps, each from an empty device queue, the host's time of each."""
        with torch.autograd.set_multithreading_enabled(not self.single_thread):
            self._time(steps)

    def _time(self, steps: int) -> None:
        times = []
        for _ in range(steps):
            self.sync()
            t0, c0 = time.perf_counter(), time.process_time()
            self.step()
            times.append(time.perf_counter() - t0)
            self.cpu_times.append(time.process_time() - c0)
        self.sync()
        self.times += times
        self.round_medians.append(round(statistics.median(times) * 1e3, 3))

    def profile(self, cprofile: list[str] | None, steps: int) -> dict:
        """The row: the median step, the torch ops one profiled step issued, the hooks."""
        if cprofile is not None:
            cprofile.append(_cprofile(self.recipe, self.step, steps))
            self.sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            self.step()
            self.sync()
        events = prof.events()
        issued = [e for e in events if e.name.startswith("aten::") and not _in_aten(e)]
        ops = len(issued)
        # where the issued ops come from: each hook kind's, and the rest (FSDP2, the model)
        by_hook = collections.Counter(_hook_of(e) or "outside qsdp hooks" for e in issued)
        by_name = collections.Counter(
            f"{_hook_of(e) or 'outside'}: {e.name.removeprefix('aten::')}" for e in issued
        )
        hooks: dict[str, list[float]] = collections.defaultdict(list)
        for e in events:
            if e.name.startswith("qsdp::"):
                kind = e.name.split(" (")[0]
                hooks[kind].append(e.cpu_time_total)
        return {
            "recipe": self.recipe,
            "ms_per_step": round(statistics.median(self.times) * 1e3, 3),
            "round_medians_ms": self.round_medians,
            # the CPU time of the process (all its threads: the backward's too), which a host
            # shared with other work (CPU time taken from this VM) does not inflate as it
            # inflates the wall time
            "cpu_ms_per_step": round(statistics.median(self.cpu_times) * 1e3, 3),
            "issued_ops": ops,
            "issued_ops_by_hook": dict(sorted(by_hook.items())),
            "issued_ops_by_name": dict(by_name.most_common()),
            "hook_calls": sum(len(v) for v in hooks.values()),
            "hooks": {
                k: {"calls": len(v), "us_per_call": round(statistics.mean(v), 1)}
                for k, v in sorted(hooks.items())
            },
        }


def _cprofile(recipe: str, step, steps: int) -> str:
    """cProfile's view of ``steps`` steps, the backward on this thread: the top functions by
    own time, then by cumulative time, as text."""
    profile = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profile.enable()
        for _ in range(steps):
            step()
        profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(60)
    return f"== {recipe}: {steps} steps\n{text.getvalue()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipes", nargs="*", default=["qsdp-w8g8", "sdp4bit", "cgx"])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="timed steps of each variant")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="split the steps into this many rounds, the variants interleaved",
    )
    p.add_argument("--label", default="", help="a name for this code version in the JSON")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--block", choices=["mlp", "gpt"], default="mlp")
    p.add_argument(
        "--stub",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the quantizer kernels as no-ops (default: on the CPU only)",
    )
    p.add_argument(
        "--single-thread",
        action="store_true",
        help="time the backward on the calling thread (torch.autograd."
        "set_multithreading_enabled(False)), as --cprofile runs it; by default on a GPU it runs "
        "on autograd's device thread",
    )
    p.add_argument("--cprofile", type=Path, help="write cProfile's functions per recipe here")
    p.add_argument(
        "--optimizer",
        action="store_true",
        help="each step ends with AdamW's step (needed by NAME+s1, whose prediction runs on it)",
    )
    p.add_argument(
        "--ddp",
        type=float,
        metavar="BUCKET_KB",
        help="DDP instead of FSDP2, with DDP buckets of this many KiB: a hook that hands each "
        "bucket back (noop) in place of plain, the recipes DDP's (cgx, global-qsgd, qsdp-g8; "
        "NAME+pipeline, NAME+graphs)",
    )
    p.add_argument(
        "--mesh",
        action="store_true",
        help="the fake group of 4 as 2 nodes x 2 GPUs: recipes with two-level gradients "
        "(sdp4bit) reduce over that mesh (compress_fsdp(mesh=...)), the others as ever",
    )
    a = p.parse_args()
    if a.mesh and a.ddp is not None:
        raise SystemExit("--mesh is for FSDP2's two-level reduce-scatter; drop it with --ddp")
    if any("+s1" in r for r in a.recipes) and not a.optimizer:
        raise SystemExit("a NAME+s1 recipe predicts at the optimizer's step: pass --optimizer")
    stub = a.device == "cpu" if a.stub is None else a.stub
    if stub:
        host_per_bucket._stub_kernels()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = None
    if a.mesh:
        mesh = init_device_mesh(a.device, (2, 2), mesh_dim_names=("inter", "intra"))
    profiles: list[str] | None = [] if a.cprofile else None
    variants = [
        Variant(
            r,
            blocks=a.blocks,
            d=a.d,
            block=a.block,
            device=a.device,
            optimizer=a.optimizer,
            single_thread=a.single_thread,
            ddp_bucket_kb=a.ddp,
            mesh=mesh,
        )
        for r in ["plain" if a.ddp is None else "noop", *a.recipes]
    ]
    # the rounds interleave the variants, each round in another order: the host's drift over
    # a run (on the GPU machine more than the recipes differ) reaches every variant alike
    per_round = max(1, a.steps // a.rounds)
    for k in range(a.rounds):
        for v in variants[k % len(variants) :] + variants[: k % len(variants)]:
            v.time(per_round)
    rows = [v.profile(profiles, per_round) for v in variants]
    if a.cprofile:
        a.cprofile.parent.mkdir(parents=True, exist_ok=True)
        a.cprofile.write_text("\n".join(profiles))
    plain = rows[0]["ms_per_step"]
    for r in rows:
        r["extra_ms_vs_plain"] = round(r["ms_per_step"] - plain, 3)
        # each round's median over plain's in the same round, then their median: what a
        # drifting host changes least (both sides of a ratio ran seconds apart)
        paired = [
            v / p for v, p in zip(r["round_medians_ms"], rows[0]["round_medians_ms"], strict=True)
        ]
        r["x_plain_by_round"] = [round(x, 3) for x in paired]
        r["x_plain"] = round(statistics.median(paired), 3)
        kinds = ", ".join(
            f"{k} {v['calls']} x {v['us_per_call']:.0f} us" for k, v in r["hooks"].items()
        )
        print(
            f"{r['recipe']:10s} {r['ms_per_step']:7.2f} ms a step (x{r['x_plain']:.2f} "
            f"{rows[0]['recipe']} by "
            f"round, +{r['extra_ms_vs_plain']:.2f}, "
            f"CPU {r['cpu_ms_per_step']:.2f} ms), "
            f"{r['issued_ops']} ops; {kinds or 'no qsdp hooks'}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "host_per_step",
                "label": a.label,
                "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                "kernels": "stubbed" if stub else "real",
                "block": a.block,
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "world_size": 4,
                "mesh": "2 nodes x 2" if a.mesh else None,
                "parallel": "fsdp2" if a.ddp is None else f"ddp, buckets of {a.ddp} KiB",
                "ddp_buckets": (None if a.ddp is None else len(set(variants[0].model.hook_calls))),
                "blocks": a.blocks,
                "d": a.d,
                "optimizer": a.optimizer,
                "rounds": a.rounds,
                "single_thread": a.single_thread,
                "rows": rows,
            },
            indent=2,
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
