"""Start ``qsdp train``'s processes: under ``torchrun`` join its group (NCCL on GPUs, gloo on
CPUs); run plainly, start ``nproc`` local gloo processes on this CPU machine. The transport is
``torch.distributed``'s own; nothing else is launched.

[Note: one error, not one traceback per rank]
What can be checked before the workers start is checked then (``rundir.validate``: the run
directory, the data) and raises here, a plain ``ValueError``, ``OSError`` or ``ImportError``. A
worker that fails later sends ``(rank, message, traceback)`` to the parent and exits with code
1 without printing; a peer whose collectives then fail (gloo's "connection closed") does the
same, so the parent names the first report as the cause (a worker that died without reporting,
killed or crashed, comes first: it is the cause of its peers' errors) and raises one
:class:`TrainError`, ``qsdp train: <message> (rank r)``. Every rank's traceback stays on the error
(``TrainError.tracebacks``); the CLI prints them when ``QSDP_TRAIN_TRACEBACK=1``.

[Note: the workers fork from a server]
The local workers start from ``multiprocessing``'s ``forkserver``: a single-threaded server,
started at the first launch of a process, imports torch, ``torch._dynamo`` (which torch imports
lazily at a training step's first optimizer step or FSDP2 hook) and the trainer once, and every
worker forks from it. With ``spawn`` each worker imported them anew: ~3 s of CPU a worker (on a
2-core machine, the bulk of a short run), paid again at every launch of a process that launches
several times (the demo's runs, notebooks, tests). What ``spawn`` gave for free is kept by hand:
each worker takes the launching process's environment as it is at the launch (the server's is
the one at its start) and its own signal handlers (the server ignores SIGINT; its children do
not: a terminal's Ctrl-C reaches them as before). A worker writes to the server's stdout and
stderr, those of the process at the server's start.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .data import open_data, prepare_data
from .rundir import validate
from .trainer import COLUMNS, Interrupted, TrainConfig, _StopRequest, raise_together, train_rank

__all__ = ["Interrupted", "TrainError", "launch", "under_torchrun"]

#: What the workers' server imports once ([Note: the workers fork from a server]).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "qsdp_train.trainer"]
_GRACE_S = 10.0  # after the first failure, how long the peers get to report and exit
_USER_ERRORS = (ValueError, OSError, FloatingPointError, ImportError)


class TrainError(RuntimeError):
    """A worker of ``qsdp train`` failed; the message is one line naming it.

    Attributes:
        rank: the rank whose failure is the cause.
        tracebacks: the traceback of each rank that reported an error, in order of arrival.
    """

    def __init__(self, message: str, *, rank: int, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def launch(cfg: TrainConfig, *, nproc: int = 2) -> dict:
    """Train ``cfg``; returns rank 0's last metrics (``{}`` on other torchrun ranks).

    Args:
        cfg: the run's settings.
        nproc: local gloo processes to start (ignored under torchrun).

    Returns:
        Rank 0's metrics of the last step.

    Raises:
        Interrupted: Ctrl-C (SIGINT to this process, or to the workers) stopped the run; its
            ``checkpoint`` says what was saved ([Note: Ctrl-C between steps] in ``trainer``).
        ValueError, OSError, ImportError: a setting, the data or ``cfg.out`` is refused before
            any worker starts (see ``rundir.validate``); nothing was written.
        TrainError: a worker failed (see the module's note).
    """
    if under_torchrun():
        return _torchrun(cfg)
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    path = prepare_data(cfg.data, cfg.tokenizer)
    validate(cfg, open_data(path), world_size=nproc, columns=COLUMNS)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # heeded when this process starts its server
    results = ctx.SimpleQueue()
    # rendezvous through a file, not a TCP store owned by rank 0: no rank's exit can pull the
    # store from under a peer that is still shutting down
    with tempfile.TemporaryDirectory(prefix="qsdp-train-") as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        procs = [
            ctx.Process(
                target=_local_worker,
                args=(r, nproc, store, cfg, str(path), results, dict(os.environ)),
            )
            for r in range(nproc)
        ]
        try:
            with _StopRequest() as stop:
                for p in procs:
                    p.start()
                return _collect(procs, results, stop=stop, out=Path(cfg.out))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                if p.pid is not None:
                    p.join()


def _collect(
    procs: list, results, *, stop: _StopRequest | None = None, out: Path | None = None
) -> dict:
    """Wait for the workers; rank 0's metrics, or one :class:`TrainError` for the first failure
    (:class:`Interrupted` after a Ctrl-C: ``stop`` counts them; the first is forwarded to the
    workers, which save and stop between steps, a second kills them)."""
    last: dict | None = None
    errors: dict[int, tuple[str, str]] = {}  # in order of arrival
    deaths: dict[int, int] = {}  # ranks that exited non-zero without a report
    stopped: dict[int, tuple] = {}  # ranks that saved and stopped after a Ctrl-C: step, path, why
    forwarded = 0

    def drain() -> None:
        nonlocal last
        while not results.empty():
            rank, ok, *value = results.get()
            if ok == "interrupted":
                stopped[rank] = tuple(value)
            elif ok:
                last = value[0] if rank == 0 else last
            else:
                errors.setdefault(rank, (value[0], value[1]))

    def judge() -> None:
        # A report is in the queue before its sender exits: drain first, then judge the exits.
        drain()
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in errors and results.empty():
                deaths.setdefault(r, p.exitcode)

    grace_end = None
    while not all(p.exitcode is not None for p in procs):
        presses = stop.presses if stop is not None else 0
        if presses > 1:
            break  # the finally of launch() kills the workers
        if presses and not forwarded:
            # a Ctrl-C in a terminal reaches the workers too; a SIGINT to this process alone
            # does not: forward it (a second request is the same request to a worker)
            forwarded = 1
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, stop.signum or signal.SIGINT)
        judge()
        if (errors or deaths) and grace_end is None:
            grace_end = time.monotonic() + _GRACE_S
        if grace_end is not None and time.monotonic() > grace_end:
            break  # a peer stuck in a collective: the finally of launch() kills it
        time.sleep(0.02)
    judge()
    if stop is not None and stop.presses:
        _raise_interrupted(
            stopped, stop.presses, out, finished=last is not None, signum=stop.signum
        )
    tracebacks = {r: tb for r, (_, tb) in errors.items()}
    if deaths:
        rank, code = next(iter(deaths.items()))
        why = " (its own output above says why)"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else "a signal"
            why = f" ({name}: out of memory, or killed from outside)"
        raise TrainError(
            f"qsdp train: rank {rank} died with exit code {code} before reporting an error{why}",
            rank=rank,
            tracebacks=tracebacks,
        )
    if errors:
        rank, (message, _) = next(iter(errors.items()))
        raise TrainError(f"qsdp train: {message} (rank {rank})", rank=rank, tracebacks=tracebacks)
    if last is None:
        raise TrainError("qsdp train: rank 0 finished without its metrics", rank=0, tracebacks={})
    return last


def _raise_interrupted(
    stopped: dict[int, tuple],
    presses: int,
    out: Path | None,
    *,
    finished: bool,
    signum: int | None = None,
) -> None:
    """After a Ctrl-C: raise :class:`Interrupted` saying what was saved (nothing returns if the
    run finished before the workers saw it)."""
    if finished:
        return
    where = Path(out) if out is not None else Path(".")
    steps = {step for step, *_ in stopped.values()}
    if stopped and len(steps) == 1:  # every rank that reported stopped after the same step
        step, path, message = next(iter(stopped.values()))
        marker = where / "ckpt" / "latest"
        if marker.is_file() and marker.read_text().strip() == Path(path).name:
            raise Interrupted(
                message,
                step=step,
                checkpoint=Path(path),
                out=where,
                signum=signum or signal.SIGINT,
            )
    marker = where / "ckpt" / "latest"
    kept = (
        f"the last checkpoint is {where / 'ckpt' / marker.read_text().strip()}"
        if (marker.is_file())
        else "no checkpoint was saved"
    )
    how = (
        "a second Ctrl-C stopped the workers mid-step"
        if presses > 1
        else ("the workers stopped before they could agree on a step to save")
    )
    raise Interrupted(
        f"interrupted: {how}; {kept}",
        step=None,
        checkpoint=None,
        out=where,
        signum=signum or signal.SIGINT,
    )


def _describe(e: BaseException) -> str:
    # A user error's message says it all; anything else is named by its type. One line.
    text = str(e) if isinstance(e, _USER_ERRORS) else f"{type(e).__name__}: {e}"
    lines = text.strip().splitlines() or [type(e).__name__]
    more = " [...]" if len(lines) > 1 else ""
    return lines[0] + more


def _local_worker(
    rank: int, world: int, store: str, cfg: TrainConfig, path: str, results, env: dict[str, str]
) -> None:
    os.environ.clear()  # the launching process's, as at the launch (not the server's start)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # a Ctrl-C before train_rank takes over only asks to stop ([Note: Ctrl-C between steps])
    _StopRequest().__enter__()  # train_rank's own takes its count over
    code = 0
    try:
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
        last = train_rank(cfg, open_data(Path(path)), torch.device("cpu"))
        dist.barrier()  # every rank is done before any leaves
        results.put((rank, True, last))
    except Interrupted as e:  # saved and stopped with its peers ([Note: Ctrl-C between steps])
        results.put((rank, "interrupted", e.step, str(e.checkpoint), str(e)))
    except BaseException as e:  # noqa: B036 - every failure, Ctrl-C included, goes to the parent
        # Report before leaving the group: leaving makes the peers fail too (see the note).
        results.put((rank, False, _describe(e), traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    raise SystemExit(code)


def _torchrun(cfg: TrainConfig) -> dict:
    local = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        # rank 0 prepares (downloads at most once); the others then find it in the cache. A
        # failure on any rank is raised on all (no rank waits for a peer that has left).
        first = dist.get_rank() == 0
        on_first = raise_together(lambda: prepare_data(cfg.data, cfg.tokenizer) if first else None)
        on_others = raise_together(lambda: None if first else prepare_data(cfg.data, cfg.tokenizer))
        path = on_first or on_others
        last = train_rank(cfg, open_data(path), device)
        return last if dist.get_rank() == 0 else {}
    finally:
        dist.destroy_process_group()
