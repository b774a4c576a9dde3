"""DDP training step time: DDP and PyTorch's own comm hooks beside qsdp's, on one host's GPUs.

    torchrun --nproc-per-node 4 benchmarks/bench_ddp_step.py --regime socket --out r.json

GPT-125M (12 layers, d 768, 12 heads, sequence 1024, GPT-2 vocabulary), micro-batch 8 per GPU,
bf16 autocast, AdamW, ``DistributedDataParallel`` with its default 25 MiB buckets. Variants,
side by side in one run on the same weights and batches: ``ddp-fp32`` (DDP's own all-reduce),
``bf16_compress_hook`` and ``powerSGD`` (rank 4, PyTorch's hooks), and each ``--recipes`` entry
through ``qsdp.ddp.register`` (``NAME+s1``: the recipe at staleness 1, whose steps apply the
previous step's gradient while their own reduction overlaps the next step; their step ends
when the compute stream is done; ``+ef``: with error feedback; ``+g256``: gradient groups of
256 elements; ``+pipe``: ``Schedule(pipeline=True)``; ``+graphs``: ``Schedule(graphs=True)``,
CGX's two phases replayed from CUDA graphs (``cgx``, ``qsdp-g8``); ``+prop``:
``nonfinite="propagate"``, no NaN/Inf check at all; ``+bN``, on any variant, baselines
included: DDP buckets of N MiB instead of ``--bucket-mb``; e.g. ``cgx+ef+g256``,
``bf16_compress_hook+b100``). Each figure is set against two bounds measured in the same run:

- compute: the same step under ``no_sync()`` (no communication at all);
- wire: the variant's bytes per step (qsdp's counter, or the hook's known size) over the
  all-reduce bandwidth measured in this run (a plain 256 MiB fp32 all-reduce, qsdp's byte
  convention: the tensor's bytes over the time).

Rows: median s/step, tokens/s, ratios to ``ddp-fp32`` and ``bf16_compress_hook``, bytes per
step, wire time, peak memory, first and last loss. ``--device cpu`` is a gloo smoke test.
``--rounds R`` runs the variant list R times, every other round reversed, and takes each
variant's median over all its rounds' steps (``round_medians``: each round's), as
``bench_fsdp_step.py --rounds`` does: one pass puts each variant in one window of the machine's
drift (the judged socket ratios of three single-pass runs of one day spread from 1.69x to 1.95x).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import profiling  # benchmarks/, the script's own folder
import qsdp
import regimes
import variants
from qsdp.testing import assert_replicas_agree
from qsdp_train.model import GPT, PRESETS

GPT_125M = PRESETS["gpt-125m"].with_vocab(50257)
TINY = replace(GPT_125M, n_layer=2, d_model=128, n_head=4, block_size=64, vocab_size=512)


def _batches(cfg, n: int, batch: int, device: torch.device, rank: int):
    g = torch.Generator().manual_seed(1234 + rank)  # random data, never zeros
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        yield x[:, :-1].to(device), x[:, 1:].to(device)


def _hook_bytes(name: str, model: DDP, numel: int, state) -> int | None:
    """Bytes per step of PyTorch's hooks by qsdp's convention (the tensors handed over)."""
    if name == "ddp-fp32":
        return 4 * numel
    if name == "bf16_compress_hook":
        return 2 * numel
    if name == "powerSGD":  # P and Q per matrix of rank r, the rest (1-D) uncompressed fp32
        total = 0
        for p in model.parameters():
            if p.dim() >= 2:
                m = p.shape[0]
                n = p.numel() // m
                total += 4 * state.matrix_approximation_rank * (m + n)
            else:
                total += 4 * p.numel()
        return total
    return None


def _bucket_mb(options: list[str], default: float) -> float:
    """A variant's DDP bucket size: its ``+bN`` option (N MiB), else ``default``."""
    sizes = [o[1:] for o in options if o.startswith("b") and o[1:].isdigit()]
    if len(sizes) > 1:
        raise SystemExit(f"+bN given {len(sizes)} times ({sizes}): give one bucket size")
    return float(sizes[0]) if sizes else default


def _release(device: torch.device) -> None:
    """Free the last variant's model once its run has returned (its locals keep the model's
    reference cycles reachable until then: ``bench_fsdp_step._release``), and reset the peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_variant(name: str, a, cfg, device: torch.device, rank: int) -> dict:
    torch.manual_seed(0)
    module = GPT(cfg).to(device)
    base, *options = name.split("+")
    bucket_mb = _bucket_mb(options, a.bucket_mb)
    model = DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
    )
    hook_state = None
    qsdp_state = None
    if base == "bf16_compress_hook":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif base == "powerSGD":
        hook_state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        model.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
    elif base == "auto":  # measures DDP's group and picks (qsdp.policy.auto)
        qsdp_state = qsdp.ddp.register(model, "auto")
    elif base != "ddp-fp32":
        # +prop: no NaN/Inf check at all
        config = qsdp.recipe(base, **({"nonfinite": "propagate"} if "prop" in options else {}))
        group = variants.group_size(options)
        if group:  # +gN: gradients in groups of N
            config = variants.with_group_size(config, group)
        schedule = qsdp.Schedule(
            staleness=int("s1" in options),
            pipeline="pipe" in options,
            graphs="graphs" in options,
            start=0,
        )
        qsdp_state = qsdp.ddp.register(
            model, config, schedule=schedule, error_feedback="ef" in options
        )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times, losses, compute = [], [], []
    numel = sum(p.numel() for p in model.parameters())
    stale = qsdp_state is not None and qsdp_state.schedule.staleness
    # a stale step ends when the compute stream is done: its reduction runs on into the next
    # step (that is the point); a synchronous step's compute stream waits for every reduction
    step_sync = profiling.compute_sync if stale else profiling.sync
    # staleness 1 computes ahead on the schedule's hooks (predict="local", the default); no
    # WeightPrediction by hand ([Note: one prediction per parameter])
    for i, (x, y) in enumerate(_batches(cfg, a.warmup + a.steps, a.batch, device, rank)):
        step_sync(device)  # (a full sync would wait for a stale step's reduction untimed)
        t0 = time.perf_counter()
        loss = _forward_backward(model, amp, x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_sync(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    if stale:  # the last gradient, as a training loop ends
        qsdp_state.drain()
        opt.step()
        opt.zero_grad(set_to_none=True)
    # every rank is a replica: a run whose replicas drifted apart measured a broken exchange
    assert_replicas_agree(model)
    if a.profile is not None:  # one more step, profiled, after the measured ones
        _profiled_step(name, a, cfg, model, opt, amp, device, rank)
    for x, y in _batches(cfg, 3, a.batch, device, rank + 100):  # the compute bound
        profiling.sync(device)
        t0 = time.perf_counter()
        with model.no_sync(), amp:
            _, loss = model(x, y)
            loss.backward()
        profiling.sync(device)
        compute.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    step_bytes = (
        qsdp_state.wire_bytes_per_step()
        if qsdp_state is not None
        else _hook_bytes(base, model, numel, hook_state)
    )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    decision = getattr(qsdp_state, "decision", None)
    return {
        "variant": name,
        "bucket_cap_mb": bucket_mb,
        **({"auto": decision.record()} if decision else {}),
        "times": times,  # this rank's; main() takes the slowest rank's median over rounds
        "compute": compute,
        "bytes_per_step": step_bytes,
        "peak_gib": peak,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def _forward_backward(model, amp, x, y) -> torch.Tensor:
    """A training step's forward (under ``amp``) and backward; returns the loss."""
    with amp:
        _, loss = model(x, y)
    loss.backward()
    return loss


def _step(model, opt, amp, x, y) -> torch.Tensor:
    """One training step (forward under ``amp``, backward, AdamW); returns the loss."""
    loss = _forward_backward(model, amp, x, y)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _profiled_step(name, a, cfg, model, opt, amp, device, rank) -> None:
    (x, y), prof = next(_batches(cfg, 1, a.batch, device, rank + 200)), profiling.profiler(device)
    profiling.sync(device)
    t0 = time.perf_counter()
    with prof:
        _step(model, opt, amp, x, y)
        profiling.sync(device)
    if rank == 0:
        profiling.write_profile(
            prof, a.profile / f"ddp_{a.regime}_{name}.txt", time.perf_counter() - t0
        )


def all_reduce_bandwidth(device: torch.device, mib: int = 256) -> float:
    """Bytes per second of a plain fp32 all-reduce by qsdp's convention (tensor bytes / time)."""
    x = torch.randn(mib * 2**18, device=device)
    for _ in range(2):
        dist.all_reduce(x)
    profiling.sync(device)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        profiling.sync(device)
        runs.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(runs)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return x.numel() * 4 / float(t)


def merge_rounds(rounds: list[dict], device: torch.device) -> dict:
    """One variant's rounds as its row: the slowest rank's median over all rounds' steps (and
    of the compute bound's), each round's (``round_medians``), the first round's losses and
    the highest peak. Collective: every rank calls it for every variant in the same order."""
    if len({json.dumps((r.get("auto") or {}).get("recipe")) for r in rounds}) > 1:
        raise SystemExit(
            f"--rounds: 'auto' chose differently in different rounds "
            f"({[r['auto']['recipe'] for r in rounds]}): run with --rounds 1 and say so"
        )
    times = [t for r in rounds for t in r["times"]]
    compute = [t for r in rounds for t in r["compute"]]
    medians = [statistics.median(r["times"]) for r in rounds]
    t = torch.tensor(
        [statistics.median(times), statistics.median(compute), *medians], device=device
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    row = {k: v for k, v in rounds[0].items() if k not in ("times", "compute")}
    return row | {
        "median_s": float(t[0]),
        "compute_s": float(t[1]),
        "round_medians": [round(float(x), 4) for x in t[2:]],
        "peak_gib": max(r["peak_gib"] for r in rounds),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regime", choices=sorted(regimes.REGIMES), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--recipes",
        nargs="*",
        default=["cgx", "cgx+pipe", "global-qsgd", "qsdp-g8", "cgx+s1", "global-qsgd+s1"],
    )
    p.add_argument("--baselines", nargs="*", default=["ddp-fp32", "bf16_compress_hook", "powerSGD"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants this many times, every other round reversed (see the docstring)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d-128 model (smoke tests)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--profile", type=Path, help="profile one extra step per variant into DIR")
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    regimes.apply(a.regime, local, a.device)
    if a.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    cfg = TINY if a.tiny else GPT_125M
    bw = all_reduce_bandwidth(device, 16 if a.tiny else 256)
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: give 1 or more")
    names = [
        n
        for n in [*a.baselines, *a.recipes]
        # the bf16 hook refuses gloo; PowerSGD deadlocks there with 2+ buckets
        if device.type == "cuda" or n.split("+")[0] not in ("bf16_compress_hook", "powerSGD")
    ]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for k in range(a.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            runs[name].append(run_variant(name, a, cfg, device, dist.get_rank()))
            _release(device)
    rows = []
    for name in names:
        row = merge_rounds(runs[name], device)
        if a.rounds == 1:
            del row["round_medians"]
        row["wire_s"] = row["bytes_per_step"] / bw if row["bytes_per_step"] else None
        rows.append(row)
        if dist.get_rank() == 0:
            print(
                f"{name:20s} {row['median_s']:.3f} s/step (compute {row['compute_s']:.3f} s, "
                f"wire {row['wire_s'] or 0:.3f} s, {row['bytes_per_step'] or 0:,} B) "
                f"peak {row['peak_gib']:.1f} GiB loss {row['loss_first']:.3f}->"
                f"{row['loss_last']:.3f}"
                + (f" rounds {row['round_medians']}" if a.rounds > 1 else ""),
                flush=True,
            )
    tokens = a.batch * cfg.block_size * dist.get_world_size()
    by = {r["variant"]: r for r in rows}
    for r in rows:
        r["tokens_per_s"] = tokens / r["median_s"]
        for base in ("ddp-fp32", "bf16_compress_hook", "powerSGD"):
            if base in by:
                r[f"x_{base}"] = by[base]["median_s"] / r["median_s"]
    if dist.get_rank() == 0:
        meta = {
            "benchmark": "ddp_step",
            "regime": a.regime,
            "world_size": dist.get_world_size(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": {
                "preset": "gpt-125m" if not a.tiny else "tiny",
                "params": sum(p.numel() for p in GPT(cfg).parameters()),
            },
            "micro_batch": a.batch,
            "bucket_cap_mb": a.bucket_mb,
            "rounds": a.rounds,
            "all_reduce_bytes_per_s": bw,
            "rows": rows,
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(meta, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
