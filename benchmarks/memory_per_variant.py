"""Peak device memory of a training step, plain FSDP2 beside qsdp's variants, one GPU.

    PYTHONPATH=src python benchmarks/memory_per_variant.py --mesh --out r.json \
        --recipes sdp4bit sdp4bit+graphs sdp4bit+s1 sdp4bit+s1+graphs

What a recipe and its schedule hold on the device beyond plain FSDP2's step (issue 32's bound:
plain + 2.5 B per parameter, staleness 1 included): ``--blocks`` GPT blocks of d ``--d``
(``host_per_step.py``'s model and variant names: ``NAME+s1`` staleness 1 from the first step,
``NAME+graphs`` the codecs replayed from CUDA graphs, ``--mesh`` the group as 2 nodes x 2), each
``fully_shard``-ed, on a ``fake`` process group of 4 ranks (collectives return at once: no wire,
the memory of every buffer as on four GPUs), AdamW, ``--steps`` steps. Each variant runs in a
process of its own (a model collected in the same process returns its memory only after
several garbage-collector passes, and the first model pays for cuBLAS's workspace); a row is
``torch.cuda.max_memory_allocated()`` over what the process held before the model was built,
and its excess over plain's per parameter of the model. Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch


def _one(name: str, blocks: int, d: int, mesh: bool, steps: int) -> dict:
    """One variant's peak in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import host_per_step  # benchmarks/, the script's own folder

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    two = init_device_mesh("cuda", (2, 2), mesh_dim_names=("inter", "intra")) if mesh else None
    base = torch.cuda.memory_allocated()
    model = host_per_step.build(name, blocks, d, block="gpt", device="cuda", mesh=two)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, d, device="cuda")
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    return {
        "recipe": name,
        "params": params,
        "peak_bytes": torch.cuda.max_memory_allocated() - base,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="the JSON (required)")
    p.add_argument("--recipes", nargs="*", default=["sdp4bit", "sdp4bit+graphs"])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mesh", action="store_true", help="the group of 4 as 2 nodes x 2")
    p.add_argument("--one", help=argparse.SUPPRESS)  # (a variant, in its own process)
    a = p.parse_args()
    if a.one:
        print(json.dumps(_one(a.one, a.blocks, a.d, a.mesh, a.steps)))
        return
    if a.out is None:
        p.error("--out is required")
    if not torch.cuda.is_available():
        raise SystemExit("memory_per_variant.py measures CUDA memory: run it on a GPU")
    rows = []
    for name in ["plain", *a.recipes]:
        args = [sys.executable, __file__, "--one", name, "--blocks", str(a.blocks)]
        args += ["--d", str(a.d), "--steps", str(a.steps)] + (["--mesh"] if a.mesh else [])
        run = subprocess.run(args, capture_output=True, text=True, check=False)
        if run.returncode:
            raise SystemExit(f"{name}: {run.stderr[-2000:]}")
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        plain = rows[0]["peak_bytes"]
        r = rows[-1]
        r["peak_mib"] = round(r["peak_bytes"] / 2**20, 1)
        r["bytes_per_param_over_plain"] = round((r["peak_bytes"] - plain) / r["params"], 3)
        print(
            f"{name:24s} peak {r['peak_mib']:9.1f} MiB, "
            f"+{r['bytes_per_param_over_plain']:.2f} B a parameter over plain",
            flush=True,
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "memory_per_variant",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "world_size": 4,
                "mesh": "2 nodes x 2" if a.mesh else None,
                "blocks": a.blocks,
                "d": a.d,
                "steps": a.steps,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
