"""The shared GPT: parameter counts, options, and the benchmark's model reproduced bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qsdp_train.model import GPT, PRESETS, Init, ModelConfig

# benchmarks/bench_fsdp_step.py's --tiny model, with the options of its 1.42 B GPT
BENCH_TINY = ModelConfig(
    n_layer=2,
    n_head=4,
    d_model=128,
    block_size=64,
    vocab_size=512,
    norm_bias=True,
    tie_head=False,
    init="torch",
)


class _BenchBlock(nn.Module):
    """The benchmark's own block before the model moved to the package (verbatim)."""

    def __init__(self, heads: int, d: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class _BenchGPT(nn.Module):
    """The benchmark's own GPT before the model moved to the package (verbatim)."""

    def __init__(self, layers: int, d: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(_BenchBlock(heads, d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def _shared_name(bench_name: str) -> str:
    first, _, rest = bench_name.partition(".")
    return {"emb": "wte.weight", "pos": "wpe.weight", "ln": f"ln_f.{rest}"}.get(first, bench_name)


def _loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def test_benchmark_options_reproduce_the_benchmarks_own_model():
    c = BENCH_TINY
    torch.manual_seed(0)
    old = _BenchGPT(c.n_layer, c.d_model, c.n_head, c.block_size, c.vocab_size)
    torch.manual_seed(0)
    new = GPT(c)
    old_params = dict(old.named_parameters())
    new_params = dict(new.named_parameters())
    assert {_shared_name(n) for n in old_params} == set(new_params)
    for name, p in old_params.items():  # the same numbers drawn in the same order
        torch.testing.assert_close(new_params[_shared_name(name)], p, rtol=0, atol=0)
    assert c.n_params() == sum(p.numel() for p in old.parameters())

    batch = torch.randint(0, c.vocab_size, (3, 41), generator=torch.Generator().manual_seed(1))
    want = old(batch[:, :-1])
    logits, loss = new(batch[:, :-1], batch[:, 1:])
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    torch.testing.assert_close(loss, _loss(want, batch), rtol=0, atol=0)
    _loss(want, batch).backward()
    loss.backward()
    for name, p in old_params.items():
        torch.testing.assert_close(new_params[_shared_name(name)].grad, p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("norm_bias", [False, True])
@pytest.mark.parametrize("tie_head", [True, False])
@pytest.mark.parametrize("vocab", [256, 301])  # 301: padded to 320
def test_n_params_counts_the_built_model(norm_bias, tie_head, vocab):
    c = ModelConfig(
        n_layer=3, n_head=3, d_model=48, block_size=20, norm_bias=norm_bias, tie_head=tie_head
    ).with_vocab(vocab)
    model = GPT(c)
    assert c.n_params() == sum(p.numel() for p in model.parameters())
    assert (model.head.weight is model.wte.weight) == tie_head


def test_presets_are_nanogpt_shaped():
    c = PRESETS["cpu-tiny"].with_vocab(300)
    torch.manual_seed(0)
    model = GPT(c).requires_grad_(False)
    assert c.init is Init.GPT2 and c.tie_head and not c.norm_bias
    assert all(not n.endswith(".bias") for n, _ in model.named_parameters())
    assert model.head.weight is model.wte.weight
    assert float(model.blocks[0].qkv.weight.std()) == pytest.approx(0.02, rel=0.05)
    assert float(model.blocks[0].down.weight.std()) == pytest.approx(
        0.02 / (2 * c.n_layer) ** 0.5, rel=0.05
    )


@pytest.mark.parametrize("init", ["gpt2", "torch"])
def test_reset_parameters(init):
    c = ModelConfig(
        n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=100, norm_bias=True, init=init
    )
    model = GPT(c)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    model.reset_parameters()
    assert torch.equal(model.blocks[1].ln2.weight, torch.ones(32))
    assert torch.equal(model.blocks[1].ln2.bias, torch.zeros(32))
    assert not (model.wte.weight == 7.0).any() and not (model.blocks[0].up.weight == 7.0).any()
    assert model.head.weight is model.wte.weight
    if init == "torch":
        assert torch.equal(model.wpe.weight, torch.zeros(16, 32))
        std = float(model.wte.weight.detach().std())
        assert std == pytest.approx(1.0, rel=0.1)  # nn.Embedding's N(0, 1)


def test_checkpointed_blocks_compute_the_same_loss_and_gradients():
    c = ModelConfig(n_layer=2, n_head=4, d_model=32, block_size=24, vocab_size=256)
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT(replace(c, checkpoint_blocks=checkpointed))
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_configs_name_the_value():
    with pytest.raises(ValueError, match=r"init='xavier' must be one of 'gpt2', 'torch'"):
        ModelConfig(n_layer=1, n_head=1, d_model=8, block_size=8, init="xavier")
    with pytest.raises(ValueError, match=r"d_model=10 must be a multiple of n_head=4"):
        ModelConfig(n_layer=1, n_head=4, d_model=10, block_size=8)
    with pytest.raises(TypeError):
        ModelConfig(1, 1, 8, 8)  # keyword-only
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(PRESETS["cpu-tiny"])
    model = GPT(PRESETS["cpu-tiny"].with_vocab(64))
    with pytest.raises(ValueError, match="block_size 128"):
        model(torch.zeros(1, 129, dtype=torch.long))
