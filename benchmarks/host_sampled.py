"""Where a compressed step's host time goes, sampled from outside the process (py-spy).

    pip install py-spy
    py-spy record --nonblocking -r 1000 --format raw -o sdp4bit.txt -- \\
        python benchmarks/host_sampled.py run --recipe sdp4bit --device cuda --steps 400
    python benchmarks/host_sampled.py summarize sdp4bit.txt > sdp4bit_summary.txt

    # the real step on several GPUs (every rank's samples together; warm-up steps included)
    py-spy record --subprocesses --nonblocking -r 500 --format raw -o s1.txt -- \
        torchrun --standalone --nproc-per-node 4 benchmarks/bench_fsdp_step.py \
        --regime socket --recipes sdp4bit+s1 --baselines --out r.json
    python benchmarks/host_sampled.py summarize s1.txt --loop "run_variant ("

``run``: ``--steps`` training steps of ``host_per_step.py``'s model (GPT blocks, a ``fake``
process group of 4, real kernels on a GPU) with the backward on the calling thread, after 5
untimed ones; prints milliseconds per step. ``--optimizer`` adds an AdamW step to each step;
``--staleness 1`` runs the recipe at staleness 1 as shipped, its prediction included;
``host_per_step.py``'s variant names work too (``sdp4bit+s1+graphs``), ``--mesh`` its 2 x 2.
``summarize``: from py-spy's raw stacks, the samples of the timed loop only: each function's
share inclusive and of its own (a C call is charged to the Python line that made it), and each
qsdp line's share counting everything below it that is not qsdp's (the torch ops and launches
it issued). Sampling does not slow the Python it measures the way cProfile and line_profiler do
(their per-call and per-line costs land on the many small functions of a hook), so the shares
are the unprofiled step's.
"""

from __future__ import annotations

import argparse
import collections
import re
import time
from pathlib import Path


def run(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import host_per_step  # benchmarks/, the script's own folder
    import qsdp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    schedule = qsdp.Schedule(staleness=1, start=0) if a.staleness else None  # as shipped
    mesh = None
    if a.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(a.device, (2, 2), mesh_dim_names=("inter", "intra"))
    model = host_per_step.build(
        a.recipe, a.blocks, a.d, block="gpt", device=a.device, schedule=schedule, mesh=mesh
    )
    x = torch.randn(4, a.d, device=a.device)
    stale = a.staleness or "+s1" in a.recipe
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if a.optimizer or stale else None

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        model(x).pow(2).mean().backward()
        if opt is not None:  # (staleness 1: its prediction runs on the optimizer's hooks)
            opt.step()
            opt.zero_grad()

    for _ in range(5):
        step()
    sync()
    with torch.autograd.set_multithreading_enabled(False):  # the hooks on this thread
        t0 = time.perf_counter()
        timed_loop(step, a.steps)
        sync()
    print(f"{a.recipe} {(time.perf_counter() - t0) / a.steps * 1e3:.2f} ms a step")


def timed_loop(step, steps: int) -> None:
    """The loop ``summarize`` keeps the samples of (by this function's name)."""
    for _ in range(steps):
        step()


def summarize(a: argparse.Namespace) -> None:
    inclusive, own, lines = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for raw in Path(a.raw).read_text().splitlines():
        if not raw.strip():
            continue
        stack, n = raw.rsplit(" ", 1)
        frames = stack.split(";")
        if not any(a.loop in f for f in frames):
            continue
        count = int(n)
        total += count
        names = {re.sub(r":\d+\)$", ")", f) for f in frames}
        for name in names:
            inclusive[name] += count
        own[re.sub(r":\d+\)$", ")", frames[-1])] += count
        ours = [f for f in frames if "qsdp/" in f]
        if ours:
            lines[ours[-1]] += count
    if not total:
        raise SystemExit(f"{a.raw}: no stack holds a frame with {a.loop!r} (see --loop)")
    print(f"{total} samples in the timed loop; shares of them\n")
    print("-- inclusive: qsdp, FSDP2 and Triton functions above 1%")
    for name, count in inclusive.most_common():
        if count < 0.01 * total:
            break
        if any(k in name for k in ("qsdp", "fsdp", "triton")):
            print(f"{100 * count / total:6.1f}%  {name[:150]}")
    print("\n-- own (C calls charged to their Python line's function)")
    for name, count in own.most_common(a.top):
        print(f"{100 * count / total:6.1f}%  {name[:150]}")
    share = 100 * sum(lines.values()) / total
    print(f"\n-- qsdp lines, with what they issued: {share:.1f}% in all")
    for name, count in lines.most_common(a.top):
        print(f"{100 * count / total:6.1f}%  {name[:150]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="the timed loop, to run under py-spy record")
    r.add_argument("--recipe", default="sdp4bit")
    r.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    r.add_argument("--blocks", type=int, default=8)
    r.add_argument("--d", type=int, default=64)
    r.add_argument("--steps", type=int, default=400)
    r.add_argument("--optimizer", action="store_true", help="an AdamW step in each step")
    r.add_argument(
        "--staleness",
        type=int,
        choices=[0, 1],
        default=0,
        help="1: Schedule(staleness=1) as shipped (its prediction; implies --optimizer)",
    )
    r.add_argument(
        "--mesh",
        action="store_true",
        help="the fake group of 4 as 2 nodes x 2 (host_per_step.py --mesh)",
    )
    s = sub.add_parser("summarize", help="shares from py-spy's raw output")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=40)
    s.add_argument(
        "--loop",
        default="timed_loop (",
        help="a frame of the timed loop's stacks (default: host_sampled.py run's loop)",
    )
    a = p.parse_args()
    run(a) if a.what == "run" else summarize(a)


if __name__ == "__main__":
    main()
