"""Weight prediction's step for one FSDP2 group: host and device time per call, against the bound.

    PYTHONPATH=src python benchmarks/bench_prediction.py --out r.json          # a GPU
    PYTHONPATH=src python benchmarks/bench_prediction.py --world 4 --out r.json

Staleness 1 writes each group's predicted weights into its all-gather's input
(``qsdp.runtime.adam_step.predict_step``, [Note: the prediction in one kernel]). This times that
call for one block of the 1.42 B GPT of ``docs/gpu.md`` (d 2048: two LayerNorms, the attention's
two Linears, the MLP's two, weights and biases: 12 parameters, 50.4 M elements), each parameter
this rank's float32 shard of ``--world`` ranks, AdamW's moments set by two steps, the estimates
bf16 views of one buffer and the output bf16 views of one flat buffer (a gather's input), as the
hooks hand them over. Rows:

- ``kernel``: ``predict_step`` (the Triton kernel on CUDA);
- ``torch reference``: the same step by torch's fused AdamW on float32 copies
  (``predicted_into``) and the cast into the output, what runs where the kernel does not apply.

Per row: the host's microseconds a call (``--calls`` calls issued back to back, no
synchronisation: what the host pays to issue it), the device's milliseconds a call (CUDA
events around ``--calls`` calls), and the bytes the step must move (read the parameter 4 B, the
estimate 2 B, both moments 8 B; write the output 2 B: 16 B an element) over the device time,
against the device's memory bandwidth (``--hbm-gbs``, H200: 4800 GB/s), the bound.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

import profiling  # benchmarks/, the script's own folder: the timing of both rows
from qsdp.runtime import adam_step

D = 2048
#: One GPT block's parameters (d 2048): LayerNorm 1, qkv, proj, LayerNorm 2, fc1, fc2.
SHAPES = [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,), (D,), (D,), (4 * D, D), (4 * D,)]
SHAPES += [(D, 4 * D), (D,)]
BYTES_PER_ELEMENT = 4 + 2 + 8 + 2


def _group(world: int, device: torch.device):
    """This rank's shards of one block, AdamW's state after two steps, the estimates and the
    gather's input laid out as the hooks hand them over."""
    g = torch.Generator(device=device).manual_seed(0)
    numels = [-(-torch.Size(s).numel() // world) for s in SHAPES]  # (FSDP2 pads the last shard)
    params = [torch.nn.Parameter(torch.randn(n, generator=g, device=device)) for n in numels]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, device=device)
        opt.step()
    total = sum(numels)
    estimates_flat = torch.randn(total, generator=g, device=device).to(torch.bfloat16)
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    estimates, outs, offset = [], [], 0
    for n in numels:
        estimates.append(estimates_flat[offset : offset + n])
        outs.append(flat[offset : offset + n])
        offset += n
    step = adam_step.AdamStep(
        group=opt.param_groups[0],
        adamw=True,
        estimates=estimates,
        states=[opt.state[p] for p in params],
        clip_coef=1.0,
    )
    return [p.detach() for p in params], outs, step, total


def _reference(outs, xs, step) -> None:
    new = adam_step.fp32_copies(xs)
    adam_step.predicted_into(new, step)
    torch._foreach_copy_(list(outs), new)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world", type=int, default=2, help="ranks the parameters are sharded over")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hbm-gbs", type=float, default=4800.0, help="the device's memory bandwidth")
    p.add_argument("--label", default="", help="a name for this code version in the JSON")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prediction.py times the kernel on a GPU; none is visible here")
    device = torch.device("cuda")
    xs, outs, step, total = _group(a.world, device)
    moved = total * BYTES_PER_ELEMENT
    bound_ms = moved / (a.hbm_gbs * 1e9) * 1e3
    rows = []
    for name, fn in (
        ("kernel", lambda: adam_step.predict_step(outs, xs=xs, step=step)),
        ("torch reference", lambda: _reference(outs, xs, step)),
    ):
        r = profiling.host_and_device(fn, a.calls, a.rounds)
        r |= {
            "variant": name,
            "gb_per_s": round(moved / (r["device_ms"] * 1e-3) / 1e9, 1),
            "x_bound": round(r["device_ms"] / bound_ms, 2),
        }
        rows.append(r)
        print(
            f"{name:16s} host {r['host_us']:7.1f} us/call  device {r['device_ms']:.3f} ms/call "
            f"({r['gb_per_s']:.0f} GB/s, {r['x_bound']:.2f}x the {bound_ms:.3f} ms bound)"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "bench_prediction",
                "label": a.label,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "world": a.world,
                "parameters": len(SHAPES),
                "elements": total,
                "bytes_moved": moved,
                "bound_ms": round(bound_ms, 4),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
