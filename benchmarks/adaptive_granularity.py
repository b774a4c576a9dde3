"""How many gradient bytes can adaptive widths save, by the granularity of a width?

CGX's plan (``qsdp.policy.adaptive.choose_widths``: the fewest bytes at no more squared error
than every group at the reference width) on real gradients of a GPT trained for a few steps on
the debian-docs corpus, for three groupings of the compressed parameters (the policy's: matrices
of 1024+ elements; 1-D ones travel raw):

- ``bucket``: DDP's buckets, 25 MiB of fp32 gradients in reverse parameter order (what
  ``qsdp.ddp.register(..., adaptive=...)`` adapts today);
- ``block``: one group per transformer block, plus the embeddings (FSDP2's groups);
- ``parameter``: one group per parameter tensor (CGX's layer-wise widths).

Prints and writes (``--out``, JSON) the share of the uniform width's bytes each plan saves at
each measured step, with every width qsdp packs (2, 3, 4, 6, 8) and with 2, 4 and 8 only (the
widths before 3 and 6 were packed), all measured. No GPU: a CPU run of a few minutes.
``--group-sizes`` adds, per parameter, plans over (width, group size) options (the group size is
the other lever: groups of 256 took DDP ``cgx`` from +0.91% to +0.09-0.43% in the convergence
study), with errors as they are and relative to each parameter's mean squared gradient (what
AdamW sees), and each uniform option's bytes and error against CGX's 4 bits in groups of 1024.

    PYTHONPATH=src python benchmarks/adaptive_granularity.py --data data/debian-docs-gpt2 \
        --out benchmarks/results/adaptive_granularity_<date>.json [--preset gpt-125m]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

import qsdp
from qsdp.policy.adaptive import WIDTHS, choose_widths, measure_errors
from qsdp.policy.params import ParamPolicy
from qsdp_train.batches import Batches
from qsdp_train.data import open_data
from qsdp_train.model import GPT, PRESETS

BUCKET_BYTES = 25 * 2**20


def groupings(model: GPT, policy: ParamPolicy) -> dict[str, list[list[str]]]:
    """Parameter names per group, for each granularity."""
    named = [(n, p) for n, p in model.named_parameters() if policy.compresses(n, p.shape)]
    per_param = [[n] for n, _ in named]
    blocks: dict[str, list[str]] = {}
    for n, _ in named:
        key = ".".join(n.split(".")[:2]) if n.startswith("blocks.") else "embeddings"
        blocks.setdefault(key, []).append(n)
    buckets, current, size = [], [], 0
    for n, p in reversed(named):  # DDP fills buckets in reverse order of the parameters
        if current and size + p.numel() * 4 > BUCKET_BYTES:
            buckets.append(current)
            current, size = [], 0
        current.append(n)
        size += p.numel() * 4
    if current:
        buckets.append(current)
    return {"bucket": buckets, "block": list(blocks.values()), "parameter": per_param}


NARROW = (2, 4, 8)
"""The widths the payload format packed before 3 and 6 bits (for comparison)."""

REFERENCE = replace(qsdp.recipe("cgx").grads.spec, group_size=1024)
"""The uniform reference of the committed studies: CGX's 4-bit min-max codes in its examples'
groups of 1024 (the ``cgx`` recipe's default until 2026-11-27; 256 since)."""

GROUP_SIZES = (64, 128, 256, 1024)
"""``--group-sizes``: the quantization group sizes a plan may also choose among (CGX: 1024)."""


def _key(bits: int, group: int) -> int:
    """One (width, group size) option as the integer key ``choose_widths`` sorts and returns."""
    return bits * 100_000 + group


def saved_with_groups(grads, groups: list[list[str]], spec, *, relative: bool) -> dict:
    """The plan over (width, group size) options against the uniform (``spec.bits``,
    ``spec.group_size``) reference, with squared errors as they are or (``relative``) over each
    group's mean squared gradient; and each uniform option's bytes and error against the
    reference (no adaptivity: what one setting for every group gives)."""
    flats = [torch.cat([grads[n].reshape(-1) for n in g]) for g in groups]
    errors = [{} for _ in flats]
    nbytes = [{} for _ in flats]
    for size in GROUP_SIZES:
        e, b = measure_errors(
            flats, replace(spec, group_size=size), widths=WIDTHS, sample=1 << 18, relative=relative
        )
        for i in range(len(flats)):
            for w in WIDTHS:
                errors[i][_key(w, size)] = e[i][w]
                nbytes[i][_key(w, size)] = b[i][w]
    reference = _key(spec.bits, spec.group_size)
    plan = choose_widths(errors, nbytes, reference=reference)
    chosen: dict[str, int] = {}
    for k in plan.widths:
        name = f"{k // 100_000}b/g{k % 100_000}"
        chosen[name] = chosen.get(name, 0) + 1
    ref_bytes = sum(b[reference] for b in nbytes)
    ref_error = sum(e[reference] for e in errors)
    uniform = {
        f"{w}b/g{size}": {
            "bytes": sum(b[_key(w, size)] for b in nbytes) / ref_bytes,
            "error": sum(e[_key(w, size)] for e in errors) / ref_error,
        }
        for size in GROUP_SIZES
        for w in WIDTHS
    }
    return {
        "bytes_saved": plan.bytes_saved,
        "error_vs_reference": plan.error / plan.reference_error,
        "chosen": chosen,
        "uniform": uniform,
    }


def saved(grads: dict[str, torch.Tensor], groups: list[list[str]], spec) -> dict:
    flats = [torch.cat([grads[n].reshape(-1) for n in g]) for g in groups]
    errors, nbytes = measure_errors(flats, spec, widths=WIDTHS)
    plan = choose_widths(errors, nbytes, reference=spec.bits)
    narrow = choose_widths(
        [{w: e[w] for w in NARROW} for e in errors],
        [{w: b[w] for w in NARROW} for b in nbytes],
        reference=spec.bits,
    )
    return {
        "groups": len(groups),
        "bytes_saved": plan.bytes_saved,
        "widths": list(plan.widths),
        "error_vs_reference": plan.error / plan.reference_error,
        "bytes_saved_2_4_8": narrow.bytes_saved,
        "widths_2_4_8": list(narrow.widths),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="gpt-125m", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--measure-at", type=int, nargs="+", default=[5, 15, 30])
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--warmup", type=int, default=10, help="linear learning-rate warm-up steps")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast)")
    p.add_argument(
        "--group-sizes",
        action="store_true",
        help=f"also plan over (width, group size in {GROUP_SIZES}) options, with absolute and "
        "relative errors, and list every uniform option's bytes and error (per parameter only)",
    )
    a = p.parse_args()
    torch.manual_seed(0)
    device = torch.device(a.device)
    data = open_data(Path(a.data))
    batches = Batches(data, order="pass")
    model = GPT(PRESETS[a.preset].with_vocab(data.vocab_size)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    spec = REFERENCE
    groups = groupings(model, ParamPolicy())
    results = []
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, step / a.warmup)
        for micro in range(a.accum):
            x, y = batches.train_batch(
                step,
                micro,
                rank=0,
                world_size=1,
                micro_batch=a.micro,
                block_size=a.block,
                seed=0,
                grad_accum=a.accum,
            )
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                _, loss = model(x.to(device), y.to(device))
            (loss / a.accum).backward()
        if step in a.measure_at:
            grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
            row = {"step": step, "loss": float(loss.detach())}
            row.update({k: saved(grads, g, spec) for k, g in groups.items()})
            if a.group_sizes:
                for how in ("absolute", "relative"):
                    row[f"parameter_groups_{how}"] = saved_with_groups(
                        grads, groups["parameter"], spec, relative=how == "relative"
                    )
                    r = row[f"parameter_groups_{how}"]
                    print(
                        f"  (width, group size) per parameter, {how} errors: saves "
                        f"{r['bytes_saved']:.1%}, chose {r['chosen']}",
                        flush=True,
                    )
            results.append(row)
            print(
                f"step {step} loss {float(loss):.3f}: "
                + ", ".join(
                    f"{k} ({row[k]['groups']} groups) saves {row[k]['bytes_saved']:.1%} "
                    f"(2/4/8 bits only: {row[k]['bytes_saved_2_4_8']:.1%})"
                    for k in groups
                )
                + f" ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": vars(a),
        "spec": {"bits": spec.bits, "group_size": spec.group_size, "scheme": spec.scheme},
        "widths": list(WIDTHS),
        "narrow_widths": list(NARROW),
        "group_sizes": list(GROUP_SIZES) if a.group_sizes else None,
        "results": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
