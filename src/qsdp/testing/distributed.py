"""Run a function on real ``torch.distributed`` processes and count the bytes they send.

[Note: why forkserver]
Each test worker is a real process with its own gloo process group, rendezvoused through a
``FileStore`` in a fresh temporary directory (no ports, nothing outside 127.0.0.1). ``spawn`` costs
a full ``import torch`` per worker (seconds on a 2-core CI machine); ``fork`` from a pytest process
that already ran torch ops risks copying held locks. ``forkserver`` with torch preloaded gives
both: a clean single-threaded server imports torch once, every worker forks from it. Workers run
with one intra-op thread (``OMP_NUM_THREADS=1``), which is what makes multi-rank tests fast on a
small machine.

The server preloads ``torch._dynamo`` too. torch imports it lazily, at the first call of a
function it keeps out of compilation (``torch._disable_dynamo``: FSDP2's hooks, the optimizers'
``step``, DDP), so without it every rank that trains imported it anew: ~0.6 s of CPU a rank, a
third of the CPU of the whole suite on a 2-core machine (``py-spy record --subprocesses`` over
the suite, 2026-11-28: 890 of 2,710 sampled seconds in that one import).

Whatever else a rank imports it imports anew in every rank: the module that defines ``fn`` (a
rank unpickles ``fn`` by reference) and everything that module imports. A test module imports
``pytest`` (~75 ms of CPU a rank, a few hundred dataclasses), a trainer test the trainer and
``torch.distributed.checkpoint`` (~50 ms): over the suite that was a sixth of the ranks'
sampled time (py-spy over the suite, 2026-11-29: 296 of the ranks' 1,770 sampled seconds in
imports, 190 of them ``pytest``'s). :func:`preload` names such modules once (the
suite's ``conftest.py`` does), and the server imports them with the rest.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..comm import dist_all_gather
from ..runtime import replica_mismatches

__all__ = [
    "DistByteCounter",
    "assert_same_on_all_ranks",
    "count_dist_bytes",
    "preload",
    "rank_tensor",
    "run_distributed",
]

#: What the ranks' server imports ([Note: why forkserver]), and what :func:`preload` added.
_preloaded = ["torch", "torch.distributed", "torch._dynamo", "qsdp"]
#: Marks a worker's report of a failure to join the group, before ``fn`` ran.
_JOIN_FAILED = "joining the process group failed (fn did not run):\n"


class _JoinFailed(RuntimeError):
    """A rank could not join the process group; ``fn`` ran nowhere."""


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        options = {}
        if backend == "nccl":  # one GPU per rank, bound before the group is made
            options["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(options["device_id"])
        store = dist.FileStore(store_path, world_size)
        try:
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
                **options,
            )
        except Exception:  # before fn ran: the parent may start the group again
            results.put((rank, False, _JOIN_FAILED + traceback.format_exc()))
            return
        value = fn(rank, world_size, *args, **kwargs)
        if dist.is_initialized():
            # every rank done before any leaves: a rank that tears its groups down while a slower
            # peer still connects to a group ``fn`` made (``new_group``) breaks that peer's
            # connection (CI, 2026-11-27: "Gloo connectFullMesh failed ... Connection closed by
            # peer" on the one rank still inside ``new_group``, its peers already gone)
            try:
                dist.barrier()
            except RuntimeError:  # a peer failed, died or hangs: its own report (or its exit
                pass  # code) names the cause; this rank's result stands
        # by value: a tensor put as it is travels as a shared-memory handle that the parent
        # fetches from this process, which may have exited by then ("connection reset by peer")
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: B036 - every failure, KeyboardInterrupt included, must reach the parent
        # Report before leaving the group: leaving makes the peers fail too, and the parent
        # names the first report as the cause.
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def preload(*modules: str) -> None:
    """Have the server the ranks fork from import ``modules`` too ([Note: why forkserver]), so
    that no rank imports them again: the modules the ranks' functions live in and import.

    Heeded when this process starts that server, at its first :func:`run_distributed` call;
    a name that does not import is skipped there (the rank then imports what it needs itself).
    A process has one such server: if another user of it starts it first (``qsdp train``'s
    local launcher, with a list of its own), its list is the one heeded.

    Raises:
        ValueError: a name that is not a dotted module name.
    """
    for name in modules:
        if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
            raise ValueError(f"preload: {name!r} is not a module name such as 'numpy'")
        if name not in _preloaded:
            _preloaded.append(name)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 60.0,
    backend: str = "gloo",
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` real processes.

    Each process joins a fresh process group (``backend``, rendezvous through a ``FileStore``)
    before ``fn`` runs and leaves it afterwards. ``fn`` must be picklable by reference (a
    module-level function) and its return value picklable.

    Args:
        fn: the per-rank function; it may use the default process group freely.
        world_size: number of processes (>= 1).
        *args, **kwargs: passed on to ``fn``.
        timeout_s: wall-clock limit for the whole run; past it the workers are killed.
        pg_timeout_s: the process group's collective timeout, so a rank stuck waiting for a
            failed peer gives up quickly.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank ``r`` on GPU ``r % device_count``).
        start_method: ``"forkserver"`` (fast, the default), ``"spawn"`` or ``"fork"``.

    Returns:
        The per-rank return values of ``fn``, indexed by rank.

    Raises:
        RuntimeError: a worker raised (the message holds its rank and full traceback), died
            without reporting (the message names its rank and exit code, as soon as the exit is
            seen), or the run exceeded ``timeout_s``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_preloaded)
    # [Note: joining again]
    # Gloo's connection of a fresh group over 127.0.0.1 failed once in the six clean-clone CI
    # runs of 2026-11-27 ("connectFullMesh failed ... Connection closed by peer", in
    # init_process_group on rank 0 of 4, its peers silent): before fn ran, so nothing was
    # tested yet. Such a run starts afresh once (new processes, a new store); a failure inside
    # fn never does.
    for attempt in (1, 2):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout_s, pg_timeout_s, backend, ctx)
        except _JoinFailed:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_once(fn, world_size, args, kwargs, timeout_s, pg_timeout_s, backend, ctx) -> list:
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="qsdp-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store_path, backend, pg_timeout_s, fn, args, kwargs, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout_s, fn)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


def _collect(procs, results, world_size: int, timeout_s: float, fn) -> list[Any]:
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deaths: dict[int, int] = {}  # ranks that exited without a report, and their exit codes
    deadline = time.monotonic() + timeout_s
    grace_end = None
    name = getattr(fn, "__qualname__", repr(fn))
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        # After one rank fails or dies, its peers are stuck in collectives: give them a moment to
        # report their own errors, then stop waiting.
        if now > deadline or (grace_end is not None and now > grace_end):
            break
        if results.empty():
            # A worker's report is in the queue before it exits, so one that has exited with
            # the queue empty never reported: it died (killed, crashed, os._exit).
            for r, p in enumerate(procs):
                if p.exitcode is not None and r not in values and r not in failures:
                    if results.empty():
                        deaths.setdefault(r, p.exitcode)
            if deaths:
                grace_end = grace_end or time.monotonic() + 2.0
            if len(values) + len(failures) + len(deaths) == world_size:
                break
            time.sleep(0.01)
            continue
        rank, ok, value = results.get()
        deaths.pop(rank, None)
        if ok:
            values[rank] = pickle.loads(value)
        else:
            failures[rank] = value
            grace_end = grace_end or time.monotonic() + 2.0
    if deaths:
        # A rank that died without a word is the cause: a rank that raises reports first, and
        # the errors of its peers ("connection closed") follow from the death.
        first, code = next(iter(deaths.items()))
        tail = "".join(
            f"\nrank {r} failed after it: {failures[r].strip().splitlines()[-1]}" for r in failures
        )
        tail += "".join(
            f"\nrank {r} died too, with {_exit_text(c)}" for r, c in deaths.items() if r != first
        )
        raise RuntimeError(
            f"{name}: rank {first} of {world_size} died with {_exit_text(code)} without "
            f"reporting a result or an error (killed, out of memory, os._exit, or a crash in "
            f"native code){tail}"
        )
    if failures:
        # The first failure to arrive is the cause; peers then fail in their collectives.
        first, *others = failures
        tail = "".join(
            f"\nrank {r} failed after it: {failures[r].strip().splitlines()[-1]}" for r in others
        )
        kind = _JoinFailed if failures[first].startswith(_JOIN_FAILED) else RuntimeError
        raise kind(f"{name} failed on rank {first} of {world_size}:\n{failures[first]}{tail}")
    missing = sorted(set(range(world_size)) - set(values))
    if missing:
        raise RuntimeError(
            f"{name}: ranks {missing} of {world_size} did not finish within {timeout_s} s "
            "(still running: a hang in a collective, or a timeout_s too short for the work)"
        )
    return [values[r] for r in range(world_size)]


# --- byte counting ----------------------------------------------------------------------------
_COUNTED = {
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "all_to_all_single": "input",
    "all_reduce": "tensor",
}
_POSITION = {
    "all_gather_into_tensor": 1,
    "all_gather_single": 1,
    "reduce_scatter_tensor": 1,
    "reduce_scatter_single": 1,
    "all_to_all_single": 1,
    "all_reduce": 0,
}


@dataclass
class DistByteCounter:
    """Bytes of the send tensors handed to each ``torch.distributed`` collective."""

    bytes: dict[str, int] = field(default_factory=dict)
    """Function name -> bytes handed over by qsdp's convention (``qsdp.comm._stats``): the send
    tensor's ``nbytes`` (for ``all_to_all_single`` the input tensor, whatever its split sizes),
    for a reduce-scatter the input less the own chunk."""
    calls: dict[str, int] = field(default_factory=dict)
    """Function name -> number of calls."""

    @property
    def total_bytes(self) -> int:
        """Bytes over all counted functions."""
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        """Calls over all counted functions."""
        return sum(self.calls.values())


@contextlib.contextmanager
def count_dist_bytes() -> Iterator[DistByteCounter]:
    """Patch the ``torch.distributed`` collectives to count the bytes handed to them.

    Wraps ``all_gather_into_tensor``, ``all_gather_single``, ``reduce_scatter_tensor``,
    ``reduce_scatter_single``, ``all_to_all_single`` and ``all_reduce`` (those that exist) on the
    ``torch.distributed`` module for the duration of the block. Callers that look the functions up
    on the module at call time are counted; the real function still runs.

    Yields:
        The :class:`DistByteCounter` that fills up while the block runs.
    """
    counter = DistByteCounter()
    saved: dict[str, Callable[..., Any]] = {}
    # torch 2.13's deprecated names call the new ones: count only the outermost call.
    depth = [0]

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        key, pos = _COUNTED[name], _POSITION[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                t = kwargs[key] if key in kwargs else args[pos]
                nbytes = t.numel() * t.element_size()
                if name.startswith("reduce_scatter"):  # the own chunk never leaves the rank
                    out = kwargs["output"] if "output" in kwargs else args[0]
                    nbytes -= out.numel() * out.element_size()
                counter.bytes[name] = counter.bytes.get(name, 0) + nbytes
                counter.calls[name] = counter.calls.get(name, 0) + 1
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name in _COUNTED:
        real = getattr(dist, name, None)
        if real is not None:
            saved[name] = real
            setattr(dist, name, wrap(name, real))
    try:
        yield counter
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


# --- data and cross-rank checks ------------------------------------------------------------------
def rank_tensor(
    rank: int, numel: int, *, dtype: torch.dtype = torch.float32, seed: int = 0, outliers: int = 3
) -> torch.Tensor:
    """A deterministic test tensor of ``rank``: normal values plus a few large outliers.

    Any process can rebuild any rank's input from ``(rank, numel, dtype, seed)``, so a test can
    compute the exact collective and the expected bytes locally, without communication.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + numel)
    x = torch.randn(numel, generator=gen, dtype=torch.float64) * (1.0 + rank)
    if numel and outliers:
        idx = torch.randint(0, numel, (outliers,), generator=gen)
        x[idx] *= 25.0
    return x.to(dtype)


def assert_same_on_all_ranks(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Assert ``t`` holds the same bytes on every rank of ``group`` (bit for bit)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = dist.get_world_size(group)
    rows = torch.empty(n * raw.numel(), dtype=torch.uint8, device=raw.device)
    dist_all_gather()(rows, raw, group=group)
    rows = rows.view(n, -1)
    for j in range(n):
        if not torch.equal(rows[j], raw):
            diff = int((rows[j] != raw).sum())
            raise AssertionError(f"tensor differs between this rank and rank {j} in {diff} bytes")


def assert_replicas_agree(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Assert every parameter of ``module`` holds the same bits on every rank of ``group``: the
    ranks that replicate it (DDP's world, HSDP's replicate group; under FSDP2 each rank's local
    shard), by one checksum per parameter (``qsdp.runtime.replica_mismatches``); the error names
    the parameters that differ and the ranks, on every rank of ``group``."""
    bad = replica_mismatches(module, group)
    if bad:
        raise AssertionError(
            f"replicas differ in {len(bad)} of {len(list(module.parameters()))} parameters: "
            f"{', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else "")
        )
