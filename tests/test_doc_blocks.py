"""Every ```python block of README.md and docs/*.md runs as written on CPU, and every ``qsdp``
command a ```bash block names exists (its flags too, for ``qsdp train``).

[Note: how a doc block says how it runs]
An HTML comment on the line just before the fence, invisible on GitHub:

    <!-- run: 2 processes -->    launched as ``torchrun --nproc-per-node 2`` would: RANK,
                                 WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set; the block
                                 makes (and may destroy) its own process group
    <!-- fragment: why -->       an excerpt that cannot run alone (say why); only compiled

A block without a comment runs in one process. The multi-process blocks of all documents share
one spawn per process count (``qsdp.testing.run_distributed``, gloo), one block after another in
a fresh namespace each, in a shared scratch directory (a checkpoint a block writes lands there);
between two blocks the harness destroys what a block left (its process group, Accelerate's
launch state), as a new launch would. Each block is its own test: a failure names the block.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from qsdp.testing import run_distributed

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(run:\s*(\d+)\s+process(?:es)?|fragment:\s*\S.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    where: str  # "README.md:123", the fence's line
    lang: str
    code: str
    processes: int  # 0: a fragment, compiled only
    marker: str | None


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = lines[start - 1].strip() if start and lines[start - 1].startswith("<!--") else None
        processes = 1
        if marker:
            mark = _MARK.match(marker)
            assert mark, f"{path.name}:{start + 1}: unknown block marker {marker!r}"
            processes = int(mark.group(2)) if mark.group(2) else 0
        where = f"{path.relative_to(ROOT)}:{start + 1}"
        out.append(Block(where, lang, "\n".join(lines[start + 1 : end]) + "\n", processes, marker))
        i = end + 1
    return out


BLOCKS = [b for doc in DOCS for b in _blocks(doc)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell")]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


# --- the blocks' runner -----------------------------------------------------------------------
def _reset_launch() -> None:
    """What a fresh ``torchrun`` process would not carry over from the previous block."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.pop("ACCELERATE_USE_FSDP", None)


def _run_blocks(rank: int, world: int, blocks: list[Block], ports: list[int], workdir: str):
    """Run ``blocks`` in order on this rank, each as a torchrun-launched script; returns each
    block's seconds."""
    os.chdir(workdir)
    seconds = {}
    for block, port in zip(blocks, ports, strict=True):
        _reset_launch()  # run_distributed's group first: each block makes its own
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
        )  # fmt: skip
        start = time.perf_counter()
        try:
            exec(compile(block.code, block.where, "exec"), {"__name__": "__main__"})
        except BaseException as e:  # noqa: B036 - the block's name must reach the parent
            raise RuntimeError(f"doc block {block.where} failed on rank {rank}") from e
        seconds[block.where] = time.perf_counter() - start
    _reset_launch()
    return seconds


def _free_ports(n: int) -> list[int]:
    """``n`` ports free now, each block's rendezvous port. Chosen up front and listened on
    only when the block runs, seconds later: a port the OS numbers itself (from its ephemeral
    range, as it numbers gloo's connections) could be taken by then, and the block failed with
    EADDRINUSE (once in 15 stressed runs, 2026-11-28). So they come from below that range,
    which the OS never hands out on its own (the OS's choice where the range leaves no room)."""
    low = 10_000
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = low
    candidates = list(range(low, first))
    random.shuffle(candidates)
    socks, ports = [], []
    try:
        for port in candidates:
            if len(ports) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        while len(ports) < n:  # (no room below the ephemeral range)
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One spawn per process count, running every block of that count; ``{where: outcome}``
    where outcome is seconds (passed) or the failure's text."""
    outcomes: dict[str, float | str] = {}
    for n in sorted({b.processes for b in PYTHON if b.processes > 1}):
        blocks = [b for b in PYTHON if b.processes == n]
        workdir = str(tmp_path_factory.mktemp(f"doc_blocks_{n}"))
        while blocks:  # after a failing block, a new spawn runs the blocks after it
            try:
                per_rank = run_distributed(
                    _run_blocks, n, blocks, _free_ports(len(blocks)), workdir, timeout_s=300
                )
                outcomes.update(per_rank[0])
                break
            except RuntimeError as e:
                # the block named by the error the worker raised (not the `raise` it quotes)
                failed = re.search(r"RuntimeError: doc block (\S+) failed on rank", str(e))
                where = [b.where for b in blocks]
                if not failed or failed.group(1) not in where:  # a death or a timeout
                    outcomes.update(dict.fromkeys(where, str(e)))
                    break
                first = where.index(failed.group(1))
                outcomes.update(dict.fromkeys(where[:first], 0.0))  # passed, time not kept
                outcomes[where[first]] = str(e)
                blocks = blocks[first + 1 :]
    return outcomes


@pytest.mark.parametrize("block", PYTHON, ids=_ids(PYTHON))
def test_python_block_runs(block: Block, spawned, tmp_path, monkeypatch):
    if block.processes == 0:
        assert len(block.marker) > len("<!-- fragment: -->") + 10, (
            f"{block.where}: say why the fragment cannot run ({block.marker!r})"
        )
        # compiled as a function's body: an excerpt of one may `return`
        compile("def _fragment():\n" + textwrap.indent(block.code, "    "), block.where, "exec")
        return
    code = compile(block.code, block.where, "exec")
    if block.processes > 1:
        if isinstance(spawned[block.where], str):
            pytest.fail(spawned[block.where], pytrace=False)
        return
    monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": "__main__"})


def test_blocks_are_found():
    # the README's adoption snippets run on several processes, none is a fragment
    readme = [b for b in PYTHON if b.where.startswith("README.md:")]
    assert readme and all(b.processes >= 1 for b in readme), [b.where for b in readme]
    assert sum(b.processes > 1 for b in readme) >= 4


# --- the shell blocks' qsdp commands ----------------------------------------------------------
def _commands(block: Block) -> list[list[str]]:
    """Each shell command of the block (continuations joined, comments dropped) that runs
    ``qsdp`` (first word, any path) or ``python -m qsdp_train`` (``torchrun ... -m
    qsdp_train``): its arguments from the subcommand on."""
    out = []
    for line in block.code.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part, comments=True)
            while words and "=" in words[0]:  # VAR=value before the command
                words = words[1:]
            if len(words) > 1 and words[0].rsplit("/", 1)[-1] == "qsdp":
                out.append(words[1:])
            elif "qsdp_train" in words[1:] and words[words.index("qsdp_train") - 1] == "-m":
                out.append(words[words.index("qsdp_train") + 1 :])
    return out


SHELL_COMMANDS = [(b.where, c) for b in BASH for c in _commands(b)]


@pytest.mark.parametrize(
    "where,argv", SHELL_COMMANDS, ids=[f"{w}:{a[0]}" for w, a in SHELL_COMMANDS]
)
def test_shell_block_commands_exist(where, argv, capsys):
    from qsdp_train import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main([argv[0], "--help"])
    assert exit_.value.code in (0, None), f"{where}: `qsdp {argv[0]}` is not a qsdp command"
    if argv[0] == "train":  # its flags too: a renamed flag fails here, not in a user's shell
        from qsdp_train.train_cli import parser

        try:
            parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{where}: `qsdp {shlex.join(argv)}` does not parse")


def test_shell_blocks_name_commands():
    assert {a[0] for _, a in SHELL_COMMANDS} >= {"demo", "train"}
