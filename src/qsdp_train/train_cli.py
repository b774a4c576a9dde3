"""``qsdp train`` (and ``python -m qsdp_train train``): arguments to a :class:`TrainConfig`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import traceback
from pathlib import Path

from qsdp import RECIPES

from .launch import _USER_ERRORS, Interrupted, TrainError, _describe, launch, under_torchrun
from .metrics import CONFIG_FILE
from .model import PRESETS
from .rundir import RESUME_MUST_MATCH
from .trainer import PREDICTIONS, TrainConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsdp train",
        description="Train a GPT with FSDP2 and qsdp's compressed communication. Under torchrun "
        "it joins torchrun's group (NCCL on GPUs); run plainly it starts --nproc gloo "
        "processes on this CPU machine.",
        epilog="An existing --out is only written by --resume, which continues its run with "
        "the settings saved in OUT/config.json (type only what changes) and refuses a typed "
        "flag that differs from a saved setting (recipe, seed, data, steps, ...; --stop-at, "
        "--ckpt-every, --keep-checkpoints, --eval-every, --pipeline, --progress and "
        "--tensorboard may change). "
        "An OUT that holds no finished checkpoint (a run killed before its first save) does "
        "not block a new run: it starts afresh there, saying so. Ctrl-C stops every rank after "
        "the same step, saves it, and ends with one line naming the checkpoint and the command "
        "to resume (exit code 130; a second Ctrl-C stops at once, saving nothing more); a "
        "SIGTERM (a scheduler's preemption, kill) does the same, exit code 143. "
        "Errors end the run with one line; QSDP_TRAIN_TRACEBACK=1 also prints every rank's "
        "traceback.",
    )
    p.add_argument("--out", required=True, help="run directory (metrics.csv, config.json, ckpt/)")
    p.add_argument("--recipe", default="sdp4bit", choices=[*sorted(RECIPES), "auto"])
    p.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    p.add_argument(
        "--data",
        help="a UTF-8 .txt, a uint16 .bin, or a nanoGPT directory (train.bin, val.bin); "
        "default: the built-in Shakespeare corpus",
    )
    p.add_argument("--tokenizer", choices=["byte", "gpt2"], help="default: byte for text")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--block-size", type=int, help="default: the preset's")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        help="0: a checkpoint at the end only (and of the last completed step on Ctrl-C)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="N",
        help="keep the newest N checkpoints, deleting older ones once a new one is complete "
        "(default: %(default)s; 0 keeps all); the one ckpt/latest names is never deleted",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in OUT from OUT/ckpt/latest, with the settings in "
        "OUT/config.json as the defaults (a typed flag that contradicts them is refused)",
    )
    p.add_argument("--stop-at", type=int, help="stop (with a checkpoint) after this step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data-order",
        choices=["random", "pass"],
        default="random",
        help="random: windows drawn anew every step; pass: one pass over the train split, no "
        "window twice (a run longer than the split is refused)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--ddp",
        action="store_true",
        help="DistributedDataParallel with qsdp's comm hook (gradient-only recipes: cgx, "
        "qsdp-g8, global-qsgd, bf16)",
    )
    mode.add_argument(
        "--hsdp",
        action="store_true",
        help="FSDP2 inside a node, the recipe's gradients compress the all-reduce across nodes",
    )
    p.add_argument(
        "--nodes",
        type=int,
        help="--hsdp: nodes (default: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, or 2 emulated "
        "on one machine); FSDP: the nodes of two-level recipes' and auto's mesh, emulated "
        "(default: torchrun's)",
    )
    p.add_argument(
        "--staleness",
        type=int,
        default=0,
        choices=[0, 1],
        help="1: apply each step's gradient one step late, its reduction overlapping the next step",
    )
    p.add_argument(
        "--stale-after",
        type=_stale_after,
        default="auto",
        help="--staleness 1 from this step on; the steps before are synchronous (the delay "
        "costs most early in training); auto (default): once the gradient norm has settled; "
        "0: from the first step",
    )
    p.add_argument(
        "--predict",
        default=None,
        choices=PREDICTIONS,
        help="--staleness 1: compute each gradient at AdamW's next step with each rank's own "
        "gradient (local, the default; the node's average with --hsdp or --nodes), at the "
        "parameters plus the last update (last), or as they are (none)",
    )
    p.add_argument(
        "--gather-ahead",
        action="store_true",
        help="--staleness 1 with sdp4bit under FSDP2: gather the next step's weights in this "
        "step's backward, beside the delayed reductions (the schedule's own prediction)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="at --staleness 0 on CUDA, FSDP2 or DDP (cgx, qsdp-g8): replay the hooks' codecs "
        "from CUDA graphs (the same bits, less host work a step: for fast links)",
    )
    p.add_argument(
        "--stale-bound",
        type=float,
        help="--staleness 1: force a synchronous step when lr * (clipped) gradient norm of the "
        "applied gradient exceeds this (default: never; the proxy is logged as stale_gap)",
    )
    p.add_argument(
        "--adaptive-every",
        type=int,
        help="adaptive gradient widths (2/3/4/6/8 bits per group, CGX): re-decide every this many "
        "steps (recipes with quantized gradients)",
    )
    p.add_argument(
        "--adaptive-per-parameter",
        action="store_true",
        help="with --adaptive-every: a width per parameter tensor, not per FSDP2 group (FSDP2, "
        "staleness 0)",
    )
    p.add_argument(
        "--adaptive-error",
        choices=("absolute", "relative"),
        default="absolute",
        help="with --adaptive-every: the width budget counts squared errors as they are (CGX) "
        "or over each group's mean squared gradient (relative: Adam's view)",
    )
    p.add_argument(
        "--redecide",
        action="store_true",
        help="with --resume of a --recipe auto run: measure the links and choose again (a "
        "different choice starts its collectives' state afresh)",
    )
    p.add_argument(
        "--error-feedback",
        action="store_true",
        help="--ddp with cgx or qsdp-g8: each rank adds what its quantizer lost to its next "
        "gradient (EF-SGD)",
    )
    p.add_argument(
        "--grad-rounding",
        choices=("stochastic", "nearest"),
        help="recipes with quantized gradients (cgx, qsdp-g8): their quantizer's rounding "
        "(nearest: lower error, biased; for --error-feedback)",
    )
    p.add_argument(
        "--grad-group-size",
        type=int,
        help="recipes with quantized gradients: their quantizer's group size (CGX's bucket)",
    )
    p.add_argument(
        "--ddp-bucket-mb",
        type=float,
        help="--ddp: DDP's bucket size in MiB (DDP's default 25; cgx over sockets: 100)",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="--ddp, or --hsdp at staleness 0, with compressed gradients: overlap one bucket's "
        "(module's) later exchange with the next one's on a second communicator (the same "
        "results)",
    )
    p.add_argument("--nproc", type=int, default=2, help="CPU processes when not under torchrun")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None)
    return p


def config_from(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        out=args.out,
        recipe=args.recipe,
        preset=args.preset,
        data=args.data,
        tokenizer=args.tokenizer,
        steps=args.steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        block_size=args.block_size,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        dropout=args.dropout,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        ckpt_every=args.ckpt_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        stop_at=args.stop_at,
        seed=args.seed,
        data_order=args.data_order,
        parallel="ddp" if args.ddp else "hsdp" if args.hsdp else "fsdp",
        nodes=args.nodes,
        staleness=args.staleness,
        stale_after=args.stale_after,
        stale_bound=args.stale_bound,
        gather_ahead=args.gather_ahead,
        graphs=args.graphs,
        predict=args.predict,
        adaptive_every=args.adaptive_every,
        adaptive_per_parameter=args.adaptive_per_parameter,
        adaptive_error=args.adaptive_error,
        error_feedback=args.error_feedback,
        grad_rounding=args.grad_rounding,
        grad_group_size=args.grad_group_size,
        ddp_bucket_mb=args.ddp_bucket_mb,
        pipeline=args.pipeline,
        redecide=args.redecide,
        tensorboard=args.tensorboard,
        progress=not args.no_progress,
    )


# Flags whose --resume default is the saved run's: the settings that must match, and those that
# may change but belong to the run (how often it saves and evaluates); where it stops, whether
# it shows progress and --redecide are asked anew. Special: data, tokenizer, parallel, nproc.
_INHERITED = (
    *(k for k in RESUME_MUST_MATCH if k not in ("data", "tokenizer", "parallel")),
    "ckpt_every",
    "keep_checkpoints",
    "eval_every",
    "pipeline",
    "tensorboard",
)


def _typed(argv: list[str] | None) -> set[str]:
    """The flags (argparse dests) typed on the command line, not left to their defaults."""
    p = parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def _resume_defaults(args: argparse.Namespace, typed: set[str]) -> None:
    """``--resume``: every flag not typed takes the saved run's value from ``OUT/config.json``.

    A typed flag is left as typed; if it contradicts the saved run, ``rundir.validate`` refuses
    it, naming the flag, the saved value and the typed one. Without a readable config.json
    nothing is filled in (validate says what is missing).
    """
    try:
        saved = json.loads((Path(args.out) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict):
        return
    for key in _INHERITED:
        if key in saved and key not in typed and hasattr(args, key):
            setattr(args, key, saved[key])
    if "data" in saved and "data" not in typed:
        # the file it was prepared from (absolute), where it still is: from any directory
        path = saved.get("data_path")
        args.data = (
            path if saved["data"] is not None and path and Path(path).exists() else (saved["data"])
        )
    text = args.data is None or str(args.data).endswith(".txt")  # else: the files' own meta
    if saved.get("tokenizer") in ("byte", "gpt2") and "tokenizer" not in typed and text:
        args.tokenizer = saved["tokenizer"]
    if "parallel" in saved and not typed & {"ddp", "hsdp"}:
        args.ddp, args.hsdp = saved["parallel"] == "ddp", saved["parallel"] == "hsdp"
    if "world_size" in saved and "nproc" not in typed and not under_torchrun():
        args.nproc = saved["world_size"]


def _interrupted(e: KeyboardInterrupt, out: str) -> str:
    """The line a Ctrl-C ends ``qsdp train`` with: what was saved, and the command to resume."""
    if not isinstance(e, Interrupted):  # before any worker started
        return f"qsdp train: interrupted before training started; {out} was not written"
    command = f"qsdp train --out {shlex.quote(out)} --resume"
    if under_torchrun():
        command = f"your torchrun command with --out {shlex.quote(out)} --resume"
    if (Path(out) / "ckpt" / "latest").is_file():
        return f"qsdp train: {e}; resume with: {command}"
    return f"qsdp train: {e}; rerun the same command to start afresh in {out}"


def main(argv: list[str] | None = None) -> dict:
    """Run ``qsdp train``; a refused setting or a failed worker ends it with one line on stderr,
    ``qsdp train: ...``, and exit code 1 (``QSDP_TRAIN_TRACEBACK=1`` prints the tracebacks too).
    Ctrl-C saves the last completed step where every rank can agree on it, and ends with one
    line saying what was saved and how to resume, exit code 130; a SIGTERM (preemption) the
    same, exit code 143.
    """
    args = parser().parse_args(argv)
    if args.resume:
        _resume_defaults(args, _typed(argv))
    verbose = os.environ.get("QSDP_TRAIN_TRACEBACK", "") not in ("", "0")
    try:
        cfg = config_from(args)
        return launch(cfg, nproc=args.nproc)
    except KeyboardInterrupt as e:
        if not under_torchrun() or os.environ["RANK"] == "0":
            print(_interrupted(e, args.out), file=sys.stderr, flush=True)
        raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None
    except TrainError as e:
        if verbose:
            for rank, tb in e.tracebacks.items():
                print(f"--- rank {rank} ---\n{tb}", file=sys.stderr)
        sys.exit(str(e))
    except Exception as e:
        # Refused before any worker started; or, under torchrun, this rank's own error.
        if not under_torchrun() and not isinstance(e, _USER_ERRORS):
            raise  # a bug of the launcher itself: its traceback is the report
        if verbose:
            traceback.print_exc()
        where = f" (rank {os.environ['RANK']})" if under_torchrun() else ""
        sys.exit(f"qsdp train: {_describe(e)}{where}")


def _stale_after(text: str) -> int | str:
    """``--stale-after``: ``auto`` or a step."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a step number") from None
