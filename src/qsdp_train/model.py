"""The one GPT of qsdp: the model of ``qsdp train``, of ``benchmarks/bench_fsdp_step.py`` and of
the FSDP tests. nanoGPT's shape (pre-norm blocks, learned positions, a 4x GELU MLP, no linear
biases), one file, with named presets.

    model = GPT(PRESETS["gpt-125m"].with_vocab(50257))
    logits, loss = model(x, y)

Blocks are the FSDP units (``model.blocks``); the embeddings, final norm and head belong to the
root group. The vocabulary is padded to a multiple of 64 (nanoGPT's trick for matmul
efficiency); padded logits never receive a target.

[Note: the benchmark's GPT]
The presets are nanoGPT's model: tied head, bias-free norms, GPT-2's initialisation. The FSDP
step benchmark's model (docs/gpu.md, 1.42 B parameters) is the same network with three
options, ``norm_bias=True, tie_head=False, init="torch"``: biased LayerNorms, an untied head and
PyTorch's module defaults with zero positions. Built after the same ``torch.manual_seed`` it
draws the same numbers in the same order as the benchmark's own copy of the model did before
it moved here, so results committed before and after the move compare (test_model.py checks
it against that copy).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["PRESETS", "GPT", "Init", "ModelConfig"]


class Init(str, enum.Enum):
    """How :class:`GPT` initialises its parameters."""

    GPT2 = "gpt2"
    """GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2 L), unit norms, zero biases."""
    TORCH = "torch"
    """PyTorch's module defaults (N(0, 1) embedding, Kaiming-uniform linears), zero positions."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The shape of a :class:`GPT` and the options that tell the benchmark's model apart (see
    the module's [Note: the benchmark's GPT])."""

    n_layer: int
    """Transformer blocks (the FSDP units)."""
    n_head: int
    """Attention heads; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""
    block_size: int
    """Longest sequence (the learned positions)."""
    vocab_size: int = 0
    """Padded up to a multiple of 64 by the model; 0 until :meth:`with_vocab`."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual branches while training."""
    norm_bias: bool = False
    """LayerNorms with a bias (the benchmark's model); nanoGPT's have none."""
    tie_head: bool = True
    """The output head shares the token embedding's weight (GPT-2)."""
    init: Init = Init.GPT2
    """Parameter initialisation; a string names an :class:`Init` value."""
    checkpoint_blocks: bool = False
    """Activation checkpointing: each block reruns its forward in backward (non-reentrant)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} must be a multiple of n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        try:
            object.__setattr__(self, "init", Init(self.init))
        except ValueError:
            choices = ", ".join(repr(i.value) for i in Init)
            raise ValueError(f"ModelConfig.init={self.init!r} must be one of {choices}") from None

    def with_vocab(self, vocab_size: int) -> ModelConfig:
        return replace(self, vocab_size=vocab_size)

    @property
    def padded_vocab(self) -> int:
        return (self.vocab_size + 63) // 64 * 64

    def n_params(self) -> int:
        """Parameters (a tied head counted once)."""
        d = self.d_model
        norm = 2 * d if self.norm_bias else d
        block = 2 * norm + 12 * d * d  # two LayerNorms, qkv, proj, up, down
        head = 0 if self.tie_head else self.padded_vocab * d
        return self.padded_vocab * d + head + self.block_size * d + self.n_layer * block + norm


#: Named model sizes (GPT-2 / GPT-3 shapes, nanoGPT's block size 1024).
PRESETS: dict[str, ModelConfig] = {
    "cpu-tiny": ModelConfig(n_layer=4, n_head=4, d_model=128, block_size=128),
    "gpt-125m": ModelConfig(n_layer=12, n_head=12, d_model=768, block_size=1024),
    "gpt-350m": ModelConfig(n_layer=24, n_head=16, d_model=1024, block_size=1024),
    "gpt-1.3b": ModelConfig(n_layer=24, n_head=32, d_model=2048, block_size=1024),
}


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.ln1 = nn.LayerNorm(c.d_model, bias=c.norm_bias)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.ln2 = nn.LayerNorm(c.d_model, bias=c.norm_bias)
        self.up = nn.Linear(c.d_model, 4 * c.d_model, bias=False)
        self.down = nn.Linear(4 * c.d_model, c.d_model, bias=False)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        if c.vocab_size <= 0:
            raise ValueError("GPT needs ModelConfig.vocab_size: use PRESETS[name].with_vocab(n)")
        self.config = c
        self.wte = nn.Embedding(c.padded_vocab, c.d_model)
        if c.init is Init.TORCH:  # zero positions that draw no random numbers
            self.wpe = nn.Embedding.from_pretrained(
                torch.zeros(c.block_size, c.d_model), freeze=False
            )
        else:
            self.wpe = nn.Embedding(c.block_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model, bias=c.norm_bias)
        self.head = nn.Linear(c.d_model, c.padded_vocab, bias=False)
        if c.tie_head:
            self.head.weight = self.wte.weight  # as in GPT-2
        # Init.TORCH: the constructors above have drawn the defaults, in the benchmark model's
        # order (see the module's [Note: the benchmark's GPT]); a reset would draw again.
        if c.init is Init.GPT2:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter as ``config.init`` says (see :class:`Init`)."""
        if self.config.init is Init.TORCH:
            for m in self.modules():
                if m is not self and hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            if self.config.tie_head:  # the head's reset overwrote the shared weight
                self.wte.reset_parameters()
            nn.init.zeros_(self.wpe.weight)
            return
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy against ``targets`` if given.

        Args:
            idx: ``[batch, t]`` token ids, ``t <= block_size``.
            targets: ``[batch, t]`` next-token ids, or None.

        Returns:
            ``(logits [batch, t, padded_vocab], loss or None)``; the loss is computed in fp32.
        """
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens > block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        h = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.config.checkpoint_blocks:
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        logits = self.head(self.ln_f(h))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss
