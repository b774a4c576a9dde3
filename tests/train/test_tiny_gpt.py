"""The library tests' GPT and text (tests/tiny_gpt.py) are the trainer's, bit for bit: the FSDP
tests train the network ``qsdp train`` trains, without importing the trainer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qsdp_train.model import GPT, ModelConfig
from qsdp_train.quant_demo import corpus as demo_corpus

from ..tiny_gpt import VOCAB, TinyGPT, corpus


def _trainers(d: int, layers: int, heads: int, block_size: int, checkpointed: bool) -> GPT:
    return GPT(
        ModelConfig(
            n_layer=layers,
            n_head=heads,
            d_model=d,
            block_size=block_size,
            vocab_size=VOCAB,
            norm_bias=True,
            tie_head=False,
            init="torch",
            checkpoint_blocks=checkpointed,
        )
    )


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("shape", [(64, 2, 4, 32), (48, 3, 3, 17)])  # the tests' and an odd one
def test_tiny_gpt_is_the_trainers_gpt(shape, checkpointed):
    d, layers, heads, block_size = shape
    torch.manual_seed(0)
    tiny = TinyGPT(d, layers, checkpointed, heads=heads, block_size=block_size)
    torch.manual_seed(0)
    gpt = _trainers(d, layers, heads, block_size, checkpointed)
    mine, theirs = dict(tiny.named_parameters()), dict(gpt.named_parameters())
    assert list(mine) == list(theirs)
    for name, p in mine.items():  # the same numbers drawn in the same order
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=0, msg=name)

    batch = torch.randint(0, VOCAB, (3, block_size + 1), generator=torch.Generator().manual_seed(1))
    logits = tiny(batch[:, :-1])
    want, loss = gpt(batch[:, :-1], batch[:, 1:])
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
    loss.backward()
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=0, msg=name)


def test_corpus_is_the_demos():
    assert corpus() == demo_corpus()
