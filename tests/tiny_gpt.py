"""The FSDP tests' GPT and its text, without the trainer (library tests never import it).

:class:`TinyGPT` is the trainer's GPT (``qsdp_train.model``) with the FSDP benchmark's options
(biased LayerNorms, untied head, PyTorch's default init, zero positions) at test size, over
bytes: the same module names, the same numbers drawn in the same order after the same seed.
:func:`corpus` is the quantization demo's text (``qsdp_train.quant_demo.corpus``).
``tests/train/test_tiny_gpt.py`` checks both against the trainer's, bit for bit.
"""

from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 256
"""Bytes; already a multiple of 64, so the trainer's GPT pads nothing."""


class Block(nn.Module):
    """A pre-norm transformer block: the trainer's ``Block`` without dropout."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """2 blocks of width 64 with 4 heads, context 32 (0.13 M parameters) by default. Called on
    token ids, it returns the logits; the blocks are the FSDP units (``model.blocks``)."""

    def __init__(
        self,
        d: int = 64,
        layers: int = 2,
        checkpointed: bool = False,
        heads: int = 4,
        block_size: int = 32,
    ) -> None:
        super().__init__()
        self.checkpointed = checkpointed  # activation checkpointing: blocks rerun in backward
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding.from_pretrained(torch.zeros(block_size, d), freeze=False)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(self.ln_f(h))


#: The modules whose docstrings make the corpus (all in every CPython 3.10+).
CORPUS_MODULES = (
    "argparse", "collections", "json", "logging", "pathlib", "subprocess", "typing", "pydoc",
    "inspect", "textwrap", "difflib", "tarfile", "zipfile", "unittest", "email.message",
    "http.client", "shutil", "tempfile", "threading", "functools", "itertools", "datetime",
    "decimal", "fractions", "statistics", "random", "string", "re",
)  # fmt: skip


def corpus() -> bytes:
    """English text from the standard library's docstrings (offline, always present): each
    module's, then its public classes' and functions' by name, then each class's own public
    methods' by name. Only the docstrings, so the bytes do not depend on what the process did
    before (pydoc's rendering lists ``__annotations__``, which exists once anything read it)."""

    def own(obj, owner: str) -> bool:
        is_code = inspect.isclass(obj) or inspect.isfunction(obj)
        return is_code and getattr(obj, "__module__", None) == owner

    text = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        if module.__doc__:
            text.append(inspect.cleandoc(module.__doc__))
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or inspect.ismodule(obj) or not own(obj, module.__name__):
                continue
            if isinstance(obj.__doc__, str):
                text.append(f"{attr}\n{inspect.cleandoc(obj.__doc__)}")
            if inspect.isclass(obj):
                for method, fn in sorted(vars(obj).items()):
                    if not method.startswith("_") and inspect.isfunction(fn) and fn.__doc__:
                        text.append(f"{attr}.{method}\n{inspect.cleandoc(fn.__doc__)}")
    return "\n\n".join(text).encode("ascii", "ignore")
