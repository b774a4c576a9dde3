"""The ``qsdp`` command (also ``python -m qsdp_train``): ``train``, ``demo``, ``plot``,
``quant-demo``, ``prepare-data`` and ``carry-data``."""

from __future__ import annotations

import sys

_USAGE = """usage: qsdp <command> [options]

commands:
  train       train a GPT with FSDP2 and compressed communication (qsdp train -h)
  demo        on this CPU: train a tiny GPT with "bf16" and "sdp4bit" side by side, print a
              table, write summary.json and a plot (qsdp demo -h)
  plot        plot loss and bytes on the wire of training runs into one PNG (qsdp plot -h)
  quant-demo  quantize a small trained transformer's weights and gradients; print error, bytes
  prepare-data
              fetch, tokenize and split a built-in corpus ("shakespeare", "debian-docs",
              "debian-large") once into the data cache; print its directory
              (qsdp prepare-data -h)
  carry-data  cut a prepared corpus into checked parts that fit a device call, and put it back
              together on the machine (qsdp carry-data -h)
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return
    cmd, rest = args[0], args[1:]
    if cmd == "train":
        from .train_cli import main as train

        train(rest)
        return
    if cmd == "demo":
        from .demo import main as demo

        demo(rest)
        return
    if cmd == "quant-demo":
        from .quant_demo import main as quant_demo

        quant_demo(rest)
        return
    if cmd == "plot":
        from .plot import main as plot

        plot(rest)
        return
    if cmd == "prepare-data":
        from .prepare_cli import main as prepare

        prepare(rest)
        return
    if cmd == "carry-data":
        from .carry import main as carry

        carry(rest)
        return
    sys.exit(f"qsdp: unknown command {cmd!r}\n{_USAGE}")
