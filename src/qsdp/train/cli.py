"""``qsdp train`` (and ``python -m qsdp.train``): arguments to a :class:`TrainConfig`."""

from __future__ import annotations

import argparse
import sys

from ..config import RECIPES
from .launch import launch
from .model import PRESETS
from .trainer import TrainConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsdp train",
        description="Train a GPT with FSDP2 and qsdp's compressed communication. Under torchrun "
        "it joins torchrun's group (NCCL on GPUs); run plainly it starts --nproc gloo "
        "processes on this CPU machine.",
    )
    p.add_argument("--out", required=True, help="run directory (metrics.csv, config.json, ckpt/)")
    p.add_argument("--recipe", default="sdp4bit", choices=sorted(RECIPES))
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
    p.add_argument("--ckpt-every", type=int, default=0, help="0: a checkpoint at the end only")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt/latest")
    p.add_argument("--stop-at", type=int, help="stop (with a checkpoint) after this step")
    p.add_argument("--seed", type=int, default=0)
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
        resume=args.resume,
        stop_at=args.stop_at,
        seed=args.seed,
        tensorboard=args.tensorboard,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    try:
        cfg = config_from(args)
    except ValueError as e:
        sys.exit(f"qsdp train: {e}")
    return launch(cfg, nproc=args.nproc)
