"""A torchtitan 0.3 job for the tests: its llama3 ``debugmodel`` on learnable synthetic tokens,
written as torchtitan asks for a custom job (a config-registry function, and components as
``Configurable`` subclasses), so ``--module tests.integrations.torchtitan_job --config
qsdp_debugmodel`` selects it like ``--module llama3 --config llama3_debugmodel``.

torchtitan's own debug job reads ``tests/assets/`` of its source tree (a tokenizer and a C4
sample), which its wheel does not ship; here the tokens are made up, and a tokenizer of the
debug model's vocabulary stands in for the files (torchtitan builds one whatever the data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config.override import override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

VOCAB = 2048  # the debug model's
SEQ, BATCH = 64, 4
CAUSAL_SDPA = f"{__name__}.causal_sdpa"
"""The override a CPU job adds (``override.imports``): FlexAttention has no CPU backward."""


def sequences(n: int, seed: int, noise: float = 0.3) -> torch.Tensor:
    """``n`` sequences of ``SEQ + 1`` tokens, each the previous one plus 3 (mod the
    vocabulary), ``noise`` of them drawn at random instead: a loss floor well above zero."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    out = (start + 3 * torch.arange(SEQ + 1)) % VOCAB
    random = torch.randint(0, VOCAB, out.shape, generator=g)
    return torch.where(torch.rand(out.shape, generator=g) < noise, random, out)


def batch(n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What torchtitan's text dataloader yields: inputs with per-document positions, labels."""
    tokens = sequences(n, seed)
    positions = torch.arange(SEQ).expand(n, SEQ).clone()
    return {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]


class _Tokens(IterableDataset):
    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank

    def __iter__(self):
        for i in range(10**6):  # each data-parallel rank its own sequences
            inputs, labels = batch(1, seed=1000 * i + self.dp_rank)
            yield {k: v[0] for k, v in inputs.items()}, labels[0]


class SyntheticTokens(ParallelAwareDataloader):
    """torchtitan's parallel-aware dataloader over :func:`sequences`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        local_batch_size: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            _Tokens(dp_rank),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
        )


class Ids(BaseTokenizer):
    """A tokenizer of the debug model's vocabulary (token ids are the text)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__()

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return " ".join(map(str, ids))

    def get_vocab_size(self) -> int:
        return VOCAB


class RecordedLosses(MetricsProcessor):
    """torchtitan's metrics, keeping each logged step's global average loss."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.losses: list[float] = []

    def log(self, step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> None:
        self.losses.append(global_avg_loss)
        super().log(step, global_avg_loss, *args, **kwargs)


def qsdp_debugmodel() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` job on :class:`SyntheticTokens`, short, without
    checkpoints or validation."""
    config = llama3_debugmodel()
    config.tokenizer = Ids.Config()
    config.dataloader = SyntheticTokens.Config()
    config.metrics = RecordedLosses.Config(log_freq=1)
    config.optimizer = default_adamw(lr=3e-3, weight_decay=0.0)
    config.lr_scheduler.warmup_steps = 0
    config.lr_scheduler.decay_ratio = None
    config.training.seq_len = SEQ
    config.training.local_batch_size = BATCH
    config.training.steps = 20
    config.checkpoint.enable = False
    config.validator.enable = False
    return config


@override(target=FlexAttention.Config, description="CPU: causal SDPA for FlexAttention")
def causal_sdpa(config: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    """FlexAttention (torch 2.13 has no backward of it on CPU) as causal SDPA: the same
    attention on these one-document sequences."""
    return ScaledDotProductAttention.Config()
