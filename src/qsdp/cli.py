"""The ``qsdp`` command: ``qsdp demo``, ``qsdp plot`` (more subcommands arrive with the trainer)."""

from __future__ import annotations

import sys

_USAGE = """usage: qsdp <command> [options]

commands:
  demo    quantize a small trained transformer's weights and gradients; print error and bytes
  plot    plot loss and bytes on the wire of training runs into one PNG (qsdp plot -h)
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return
    cmd, rest = args[0], args[1:]
    if cmd == "demo":
        from .train.quant_demo import main as demo

        demo(rest)
        return
    if cmd == "plot":
        from .train.plot import main as plot

        plot(rest)
        return
    sys.exit(f"qsdp: unknown command {cmd!r}\n{_USAGE}")
