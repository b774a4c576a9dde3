"""A run's metrics: ``RUN_DIR/metrics.csv`` (optionally mirrored to TensorBoard) and progress.

[Note: metrics.csv]
One row per logged step, columns fixed when the run starts, ``step`` first::

    step,tokens,loss,val_loss,lr,...,wire_bytes,bf16_bytes,compression_ratio
    1,65536,10.98,,0.0003,...,41943040,83886080,2.0
    2,131072,10.41,10.44,0.0003,...,41943040,83886080,2.0

An empty cell is a value not measured at that step (``val_loss`` only every N steps). Each row
is flushed when written, so a crashed run keeps every row it logged. Resuming from a checkpoint
taken at step S keeps the rows with ``step <= S`` byte for byte and drops the later ones, which
the resumed run logs again; TensorBoard events after S are purged the same way.

Only rank 0 should create a :class:`MetricsWriter`; the class knows nothing about ranks.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = ["METRICS_FILE", "CONFIG_FILE", "MetricsWriter", "Progress", "RunMetrics", "read_metrics"]

METRICS_FILE = "metrics.csv"
CONFIG_FILE = "config.json"
TENSORBOARD_DIR = "tb"

logger = logging.getLogger(__name__)


def _load_summary_writer() -> type:
    # torch.utils.tensorboard raises ImportError when the tensorboard package is missing.
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def _check_columns(columns: Sequence[str]) -> tuple[str, ...]:
    cols = tuple(columns)
    if not cols or cols[0] != "step":
        raise ValueError(f"columns={list(cols)} must start with 'step'; e.g. ['step', 'loss']")
    bad = [c for c in cols if not (isinstance(c, str) and c.isidentifier())]
    if bad:
        raise ValueError(
            f"column names {bad} are not Python identifiers; they are passed as log() keywords, "
            "so use names like 'wire_bytes_all_gather'"
        )
    dup = sorted({c for c in cols if cols.count(c) > 1})
    if dup:
        raise ValueError(f"columns {dup} appear more than once in {list(cols)}")
    return cols


def _format_cell(name: str, value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    raise TypeError(
        f"{name}={value!r} ({type(value).__name__}) is not a number; pass a Python int or float "
        "(for a tensor, call .item()) or None for 'not measured'"
    )


class MetricsWriter:
    """Appends one row per step to ``RUN_DIR/metrics.csv``; optionally mirrors to TensorBoard.

    Args:
        run_dir: the run's directory (created if missing).
        columns: the fixed column list, ``"step"`` first; each other name is a keyword of
            :meth:`log`.
        resume_from_step: ``None`` starts a new file (an existing one is an error, so a run
            never overwrites another). An int S resumes: the existing file must have the same
            header; rows with ``step <= S`` are kept byte for byte, later ones dropped.
        tensorboard: ``True`` also writes scalars to ``RUN_DIR/tb`` (raises if tensorboard is
            not installed); ``False`` does not; ``None`` turns it on when installed and says
            which through ``logging``.
    """

    def __init__(
        self,
        run_dir: Path,
        columns: Sequence[str],
        *,
        resume_from_step: int | None = None,
        tensorboard: bool | None = False,
    ) -> None:
        self.columns = _check_columns(columns)
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._last_step: int | None = None
        # Resolve TensorBoard first: a missing install must fail before any file is touched.
        summary_writer = self._tensorboard_class(tensorboard)
        if resume_from_step is None:
            self._start_new()
        else:
            self._resume(resume_from_step)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8", newline="")
        self._tb: Any = None
        if summary_writer is not None:
            purge = None if resume_from_step is None else resume_from_step + 1
            self._tb = summary_writer(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)

    def _start_new(self) -> None:
        if self.path.exists():
            raise FileExistsError(
                f"{self.path} already exists; use a new run directory, or pass "
                "resume_from_step=S to continue that run from its checkpoint at step S"
            )
        with open(self.path, "x", encoding="utf-8", newline="") as f:
            f.write(",".join(self.columns) + "\n")

    def _resume(self, step: int) -> None:
        if not self.path.exists():
            raise FileNotFoundError(
                f"cannot resume metrics from step {step}: {self.path} does not exist; pass "
                "resume_from_step=None to start a new metrics file"
            )
        lines = self.path.read_bytes().split(b"\n")
        header = lines[0].decode("utf-8").rstrip("\r").split(",")
        if tuple(header) != self.columns:
            raise ValueError(
                f"{self.path} has columns {header} but this run logs {list(self.columns)}; "
                "resume with the same columns or start a new run directory"
            )
        kept = [lines[0] + b"\n"]
        for lineno, raw in enumerate(lines[1:], start=2):
            if not raw.strip():
                continue
            first = raw.split(b",", 1)[0]
            try:
                row_step = int(first)
            except ValueError:
                raise ValueError(
                    f"{self.path}:{lineno}: step {first!r} is not an integer; "
                    "the file is corrupt, fix or remove that line"
                ) from None
            if row_step > step:
                continue
            if raw.count(b",") != len(self.columns) - 1:
                raise ValueError(
                    f"{self.path}:{lineno}: {raw.count(b',') + 1} cells, expected "
                    f"{len(self.columns)}; the file is corrupt, fix or remove that line"
                )
            kept.append(raw + b"\n")
            if self._last_step is None or row_step > self._last_step:
                self._last_step = row_step
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _tensorboard_class(self, mode: bool | None) -> type | None:
        if mode is False:
            return None
        try:
            summary_writer = _load_summary_writer()
        except ImportError as e:
            if mode is None:
                logger.info("TensorBoard logging off: `pip install tensorboard` to turn it on")
                return None
            raise ImportError(
                "tensorboard=True but TensorBoard is not installed: `pip install tensorboard`, "
                "or pass tensorboard=False"
            ) from e
        if mode is None:
            logger.info("TensorBoard logging on: %s", self.run_dir / TENSORBOARD_DIR)
        return summary_writer

    def log(self, step: int, **values: float | int | None) -> None:
        """Write the row of ``step``; columns not given (or ``None``) stay empty.

        Args:
            step: the optimizer step; must grow from call to call.
            **values: numbers keyed by column name.

        Raises:
            ValueError: on a key that is not a column, or a step not after the last one.
            TypeError: on a value that is not a real number or ``None``.
        """
        if self._file is None:
            raise ValueError(f"log(step={step}) after close() of {self.path}")
        unknown = sorted(set(values) - set(self.columns[1:]))
        if unknown:
            raise ValueError(
                f"unknown metric(s) {unknown}; the columns of {self.path} are "
                f"{list(self.columns)}: add them to the column list when the run starts"
            )
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            raise TypeError(f"step={step!r} must be an int")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step={step} is not after the last logged step {self._last_step}; "
                "log all values of a step in one call"
            )
        cells = [str(int(step))] + [_format_cell(c, values.get(c)) for c in self.columns[1:]]
        self._file.write(",".join(cells) + "\n")
        self._file.flush()
        self._last_step = int(step)
        if self._tb is not None:
            for name, value in values.items():
                if value is not None:
                    self._tb.add_scalar(name, float(value), global_step=int(step))

    @property
    def tensorboard_dir(self) -> Path | None:
        """Where TensorBoard events go, or ``None`` when TensorBoard logging is off."""
        return None if self._tb is None else self.run_dir / TENSORBOARD_DIR

    def close(self) -> None:
        """Flush and close the CSV (and TensorBoard) files; a second call does nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, kw_only=True)
class RunMetrics:
    """The metrics of one run, as read back by :func:`read_metrics`."""

    run_dir: Path
    """The run's directory."""
    config: dict[str, Any]
    """``RUN_DIR/config.json`` as written by the trainer (``recipe``, ``preset``, ...)."""
    columns: tuple[str, ...]
    """The CSV header, ``step`` first."""
    data: dict[str, list[float | None]]
    """One list per column, one entry per row; ``None`` for an empty cell."""

    def __getitem__(self, column: str) -> list[float | None]:
        if column not in self.data:
            path = self.run_dir / METRICS_FILE
            raise KeyError(f"{path} has no column {column!r}; it has {list(self.columns)}")
        return self.data[column]

    def __len__(self) -> int:
        return len(self.data["step"])

    def has_values(self, column: str) -> bool:
        """Whether ``column`` exists and has at least one non-empty cell."""
        return any(v is not None for v in self.data.get(column, ()))


def _parse_cell(path: Path, lineno: int, column: str, text: str) -> float | None:
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"{path}:{lineno}: {column}={text!r} is not a number; fix or remove that line"
        ) from None


def read_metrics(run_dir: Path) -> RunMetrics:
    """Read ``RUN_DIR/metrics.csv`` and ``RUN_DIR/config.json`` back.

    Args:
        run_dir: a directory written by ``qsdp train``.

    Returns:
        The run's :class:`RunMetrics`; every cell a float, or ``None`` where empty.

    Raises:
        FileNotFoundError: when either file is missing (NotADirectoryError: ``run_dir`` is a file).
        ValueError: when a file is empty or malformed (the message names the line).
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(
            f"{run_dir} is a file, not a run directory (one holding {METRICS_FILE} and "
            f"{CONFIG_FILE}); pass only run directories"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is {run_dir} a run directory of `qsdp train`?")
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].strip():
        raise ValueError(f"{path} is empty (no header); the run wrote nothing, delete or rerun it")
    columns = tuple(lines[0].split(","))
    if columns[0] != "step" or len(set(columns)) != len(columns):
        raise ValueError(f"{path}: header {list(columns)} must start with 'step', without repeats")
    data: dict[str, list[float | None]] = {c: [] for c in columns}
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cells = line.split(",")
        if len(cells) != len(columns):
            raise ValueError(
                f"{path}:{lineno}: {len(cells)} cells, expected {len(columns)}; "
                "fix or remove that line"
            )
        for column, text in zip(columns, cells, strict=True):
            data[column].append(_parse_cell(path, lineno, column, text))
        if data["step"][-1] is None:
            raise ValueError(f"{path}:{lineno}: empty step; fix or remove that line")
    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; `qsdp train` writes it at start")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON ({e}); fix or rewrite it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds a {type(config).__name__}, expected an object")
    return RunMetrics(run_dir=run_dir, config=config, columns=columns, data=data)


class Progress:
    """A progress display: step/total, loss, tokens/s, compression ratio, last val loss.

    On a terminal it is a ``tqdm`` bar. Elsewhere (a log file, a pipe) it prints one plain line
    every ``line_every`` steps and at the last step, so logs show progress without ``\\r``.

    Args:
        total: the last step of the run.
        initial: the step already done (the checkpoint step when resuming).
        disable: show nothing (pass ``rank != 0``).
        line_every: steps between lines when not on a terminal.
        file: where to write; ``sys.stderr`` by default.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        disable: bool = False,
        line_every: int = 10,
        file: IO[str] | None = None,
    ) -> None:
        if line_every < 1:
            raise ValueError(f"line_every={line_every} must be >= 1")
        try:
            from tqdm import tqdm
        except ImportError as e:
            raise ImportError("the progress bar needs tqdm: pip install 'qsdp[train]'") from e
        self._tqdm = tqdm
        self.total, self.initial, self.line_every = total, initial, line_every
        self.file = sys.stderr if file is None else file
        self.disable = disable
        self.tty = not disable and bool(getattr(self.file, "isatty", lambda: False)())
        self._val_loss: float | None = None
        self._start = time.monotonic()
        self._bar = None
        if self.tty:
            self._bar = tqdm(
                total=total, initial=initial, file=self.file, unit="step", dynamic_ncols=True
            )

    def update(
        self,
        step: int,
        *,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        compression_ratio: float | None = None,
        val_loss: float | None = None,
    ) -> None:
        """Show that ``step`` is done, with the values measured at it (``None``: not known)."""
        if self.disable:
            return
        if val_loss is not None:
            self._val_loss = val_loss
        postfix = self._postfix(loss, tokens_per_s, compression_ratio)
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self.line_every == 0 or step >= self.total:
            meter = self._tqdm.format_meter(
                step,
                self.total,
                time.monotonic() - self._start,
                ncols=0,
                unit="step",
                initial=self.initial,
                postfix=postfix,
            )
            print(meter, file=self.file, flush=True)

    def _postfix(self, loss: float | None, tps: float | None, ratio: float | None) -> str:
        parts = []
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if self._val_loss is not None:
            parts.append(f"val {self._val_loss:.4f}")
        if tps is not None:
            parts.append(f"{self._tqdm.format_sizeof(tps)} tok/s")
        if ratio is not None and math.isfinite(ratio):
            parts.append(f"x{ratio:.1f}")
        return " | ".join(parts)

    def close(self) -> None:
        """End the bar (a terminal's cursor moves to the next line)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
