"""The GPT of ``qsdp train``: nanoGPT's shape (pre-norm blocks, learned positions, tied output
embedding, no biases), one file, with named presets.

    model = GPT(PRESETS["gpt-125m"].with_vocab(50257))
    logits, loss = model(x, y)

Blocks are the FSDP units (``model.blocks``); the embeddings, final norm and tied head belong to
the root group. The vocabulary is padded to a multiple of 64 (nanoGPT's trick for matmul
efficiency); padded logits never receive a target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PRESETS", "GPT", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_head: int
    d_model: int
    block_size: int
    vocab_size: int = 0
    """Padded up to a multiple of 64 by the model; 0 until :meth:`with_vocab`."""
    dropout: float = 0.0

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

    def with_vocab(self, vocab_size: int) -> ModelConfig:
        return replace(self, vocab_size=vocab_size)

    @property
    def padded_vocab(self) -> int:
        return (self.vocab_size + 63) // 64 * 64

    def n_params(self) -> int:
        """Parameters (the tied head counted once)."""
        d = self.d_model
        block = 2 * d + 12 * d * d  # two LayerNorm weights, qkv, proj, up, down
        return self.padded_vocab * d + self.block_size * d + self.n_layer * block + d


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
        self.ln1 = nn.LayerNorm(c.d_model, bias=False)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.ln2 = nn.LayerNorm(c.d_model, bias=False)
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
        self.wpe = nn.Embedding(c.block_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model, bias=False)
        self.head = nn.Linear(c.d_model, c.padded_vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 L)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens > block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        h = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss
