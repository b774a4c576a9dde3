"""A run directory of ``qsdp train`` (``OUT/``): what it records, and the checks made before a
run touches it.

[Note: the run directory is written only by the run that owns it]
``OUT/`` holds ``config.json`` (the settings), ``metrics.csv`` (one row per step), ``ckpt/``
(checkpoints; ``ckpt/latest`` names the last finished one) and optionally ``tb/``. A run owns
``OUT/`` when ``OUT/`` is new (or holds none of these), when it holds a run that never finished
a checkpoint (nothing to resume: a new run removes its files, saying so, and starts afresh), or
when it resumes the run in it. So
:func:`validate` runs before anything is written, in ``launch`` before any worker starts and
again at the start of ``train_rank`` on every rank (torchrun, or the Python API), and refuses:

    OUT is a file                          -> NotADirectoryError
    OUT holds a checkpoint, no --resume    -> FileExistsError  "pass --resume ... or another --out"
    --resume, but no finished checkpoint   -> FileNotFoundError
    --resume with other settings           -> ValueError naming each differing setting
    a data split shorter than block+1      -> ValueError
    --tensorboard, TensorBoard missing     -> ImportError

[Note: what --resume may change]
A resumed run must be the run it continues, so every setting that changes what is trained, on
what data, in which order, or what a logged number means must equal the saved one
(:data:`RESUME_MUST_MATCH`); ``--steps`` is one of them, because the learning-rate schedule spans
it (to train longer, start a new run). The settings that only say when to stop, save, evaluate
or how to report may change (:data:`RESUME_MAY_CHANGE`). The recorded environment (torch
version, device) may change too. Every :class:`TrainConfig` field is in exactly one of the two
sets (a test checks it), so a new field needs a decision. Besides the fields, ``config.json``
records what they resolve to, and these are compared too: the world size, the data's source
file and token counts, its tokenizer and vocabulary, the block size. A key that an older
``config.json`` lacks is not compared.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .batches import Batches
from .data import TokenData
from .metrics import CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR, _load_summary_writer

if TYPE_CHECKING:
    from .trainer import TrainConfig

__all__ = [
    "RESUME_MAY_CHANGE",
    "RESUME_MUST_MATCH",
    "run_info",
    "saved_choice",
    "validate",
    "write_config",
]

CKPT_DIR = "ckpt"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, CKPT_DIR, TENSORBOARD_DIR)

RESUME_MUST_MATCH = (
    "recipe",
    "preset",
    "data",
    "data_path",
    "train_tokens",
    "val_tokens",
    "tokenizer",
    "vocab_size",
    "block_size",
    "micro_batch",
    "grad_accum",
    "world_size",
    "steps",
    "lr",
    "min_lr_ratio",
    "warmup",
    "weight_decay",
    "grad_clip",
    "dropout",
    "eval_batches",
    "seed",
    "data_order",
    "two_level",
    "parallel",
    "nodes",
    "staleness",
    "stale_after",
    "stale_bound",
    "gather_ahead",
    "predict",
    "adaptive_every",
    "adaptive_per_parameter",
    "adaptive_error",
    "error_feedback",
    "grad_rounding",
    "grad_group_size",
    "ddp_bucket_mb",
)
"""Keys of ``config.json`` that ``--resume`` requires to equal the saved run's."""

RESUME_MAY_CHANGE = (
    "out",
    "resume",
    "redecide",
    "pipeline",
    "graphs",
    "stop_at",
    "eval_every",
    "ckpt_every",
    "keep_checkpoints",
    "tensorboard",
    "progress",
)
"""Settings that ``--resume`` may change: where the run lives and when it stops, saves,
evaluates and how it reports, and how the same bits are computed (``pipeline``, ``graphs``)."""

# config.json keys that are not command-line flags, and the flag that sets them.
_LABELS = {
    "data_path": "--data (the file it names)",
    "train_tokens": "--data (tokens in the train split)",
    "val_tokens": "--data (tokens in the val split)",
    "vocab_size": "--data/--tokenizer (vocabulary size)",
    "world_size": "the number of processes (--nproc, or torchrun's)",
    "parallel": "--ddp/--hsdp (parallel)",
}


def _source(data: TokenData) -> str | None:
    # The file the tokens came from (absolute; prepare_data records it), None for the corpus.
    source = data.meta.get("source")
    return source.get("path") if isinstance(source, dict) else None


def _settings(cfg: TrainConfig, data: TokenData, world_size: int) -> dict[str, Any]:
    # The settings as config.json records them: tokenizer and block_size resolved, not as given.
    mc = cfg.model_config(data.vocab_size)
    return asdict(cfg) | {
        "data_path": _source(data),
        "train_tokens": int(data.train.size),
        "val_tokens": int(data.val.size),
        "world_size": world_size,
        "tokenizer": data.tokenizer or "ids",
        "vocab_size": data.vocab_size,
        "block_size": mc.block_size,
        "n_params": mc.n_params(),
    }


def run_info(
    cfg: TrainConfig, data: TokenData, *, world_size: int, device: torch.device
) -> dict[str, Any]:
    """What ``OUT/config.json`` records: the settings (resolved), the data and the environment.

    Args:
        cfg: the run's settings.
        data: its opened token data.
        world_size: the number of ranks.
        device: this rank's device.

    Returns:
        A JSON-serialisable dict.
    """
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return _settings(cfg, data, world_size) | {"torch": torch.__version__, "device": name}


def _label(key: str) -> str:
    return _LABELS.get(key, "--" + key.replace("_", "-"))


def _check_out(out: Path, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"--out {out} is a file, not a run directory; choose another --out (a new "
            "directory, or a run directory with --resume)"
        )
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if not out.exists() and parent is not None and not parent.is_dir():
        raise NotADirectoryError(f"--out {out}: {parent} is a file; choose another --out")
    found = [name for name in RUN_FILES if (out / name).exists()]
    # a run that never finished a checkpoint has nothing to resume: a new run starts over it
    if found and not resume and (out / CKPT_DIR / "latest").is_file():
        raise FileExistsError(
            f"{out} holds a run ({', '.join(found)}): pass --resume to continue it, or choose "
            "another --out"
        )


def _check_resume(out: Path, info: dict[str, Any], columns: tuple) -> None:
    marker = out / CKPT_DIR / "latest"
    if not marker.is_file():
        raise FileNotFoundError(
            f"--resume: no finished checkpoint in {out / CKPT_DIR} (the file 'latest' is written "
            f"after a save completes), so there is nothing to resume; run without --resume to "
            f"start afresh in {out}"
        )
    ckpt = out / CKPT_DIR / marker.read_text().strip()
    if not ckpt.is_dir():
        raise FileNotFoundError(
            f"--resume: {marker} names {ckpt.name}, which is not in {out / CKPT_DIR}; restore "
            "it or start afresh in a new --out"
        )
    config_path = out / CONFIG_FILE
    try:
        saved = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"--resume: {config_path} is missing, so the settings of the run in {out} are not "
            "known; restore it or start afresh in a new --out"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--resume: {config_path} is not valid JSON ({e}); restore it or start afresh in a "
            "new --out"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(f"--resume: {config_path} holds no JSON object; restore it")
    # Keys an older config.json lacks cannot be compared; every key it has must match.
    # data_path, when saved, says whether --data names the same file (from another directory).
    skip = {"data"} if "data_path" in saved else set()
    diff = [k for k in RESUME_MUST_MATCH if k in saved and k not in skip and saved[k] != info[k]]
    if diff:
        changes = "; ".join(f"{_label(k)}: saved {saved[k]!r}, now {info[k]!r}" for k in diff)
        raise ValueError(
            f"--resume would continue the run in {out} under other settings ({changes}); "
            f"resume with the settings in {config_path} (`qsdp train --out {out} --resume` "
            "takes them all), or choose another --out for a new run"
        )
    if saved.get("staleness") and "predict" not in saved and info.get("predict") != "none":
        # its checkpoints hold no weight prediction to continue from
        raise ValueError(
            f"--resume: the run in {out} is from before weight prediction (staleness 1 with the "
            "delayed gradient as is); resume it with --predict none"
        )
    metrics = out / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(
            f"--resume: {metrics} is missing; restore it or start afresh in a new --out"
        )
    with open(metrics, encoding="utf-8") as f:
        header = tuple(f.readline().rstrip("\r\n").split(","))
    if header != tuple(columns):
        raise ValueError(
            f"--resume: {metrics} has columns {list(header)}, this qsdp logs {list(columns)}; "
            "start afresh in a new --out"
        )


def validate(
    cfg: TrainConfig, data: TokenData, *, world_size: int, columns: tuple[str, ...]
) -> None:
    """Refuse a run that would fail, or that would change a run directory it does not own.

    Reads only (see the module's notes); every rank that calls it sees the same files and
    settings, so all raise the same error.

    Args:
        cfg: the run's settings.
        data: its opened token data.
        world_size: the number of ranks the run will have.
        columns: the columns the run logs to ``metrics.csv``.

    Raises:
        NotADirectoryError: ``--out`` is a file.
        FileExistsError: ``--out`` holds a run and ``--resume`` is not set.
        FileNotFoundError: ``--resume`` without a finished checkpoint (or its config, metrics).
        ValueError: ``--resume`` with settings that differ from the saved run's (see
            :data:`RESUME_MUST_MATCH`), or data too short for the block size.
        ImportError: ``tensorboard=True`` without TensorBoard installed.
    """
    block = cfg.model_config(data.vocab_size).block_size
    source = _source(data) or "the built-in corpus"
    for split in ("train", "val"):
        n = int(getattr(data, split).size)
        if n < block + 1:
            raise ValueError(
                f"the {split} split of {source} has {n} tokens, too short for block_size="
                f"{block}, which needs at least {block + 1}; pass a smaller --block-size or more "
                "data"
            )
    if cfg.data_order == "pass":  # one pass: the run must fit in the train split
        windows = Batches(data, order="pass").pass_windows(block)
        per_step = cfg.grad_accum * world_size * cfg.micro_batch
        if cfg.steps * per_step > windows:
            raise ValueError(
                f"--data-order pass: {cfg.steps} steps of {per_step} windows need "
                f"{cfg.steps * per_step}, but one pass over the train split of {source} holds "
                f"{windows} windows of {block} tokens; pass --steps {windows // per_step} or "
                "less, or --data-order random"
            )
    if cfg.tensorboard:
        try:
            _load_summary_writer()
        except ImportError as e:
            raise ImportError(
                "--tensorboard but TensorBoard is not installed: `pip install tensorboard`, or "
                "pass --no-tensorboard"
            ) from e
    out = Path(cfg.out)
    _check_out(out, cfg.resume)
    if cfg.resume:
        _check_resume(out, _settings(cfg, data, world_size), columns)


def write_config(
    cfg: TrainConfig, out: Path, data: TokenData, device: torch.device, auto: dict | None = None
) -> None:
    """Write ``OUT/config.json`` (rank 0): :func:`run_info`, and ``auto``'s choice."""
    info = run_info(cfg, data, world_size=dist.get_world_size(), device=device)
    if auto is not None:  # --recipe auto: what it measured, predicted and chose
        info["auto"] = auto
    (out / CONFIG_FILE).write_text(json.dumps(info, indent=2, default=str))


def saved_choice(out: Path) -> dict:
    """The recipe a resumed ``--recipe auto`` run chose when it started."""
    saved = json.loads((out / CONFIG_FILE).read_text()).get("auto")
    if not saved:
        raise ValueError(
            f"--resume with --recipe auto: {out / CONFIG_FILE} records no choice (the run was "
            "started by an older qsdp); resume with the recipe it ran, --recipe NAME"
        )
    return saved
