"""qsdp in Hugging Face's own training stacks, with the real packages on gloo: an
``accelerate.Accelerator`` and a ``transformers.Trainer``, each with FSDP2 and with DDP, tiny
random-initialised models built from a config (no hub), against the same run without qsdp.

One spawn of two processes runs everything (importing transformers costs seconds per process);
the tests below read its results.

[Note: FSDP2 on CPU through Accelerate]
Accelerate 1.15 applies an FSDP plugin only under an accelerator's launch type (MULTI_GPU, ...)
and silently runs DDP on a CPU launch (MULTI_CPU). The CPU tier therefore labels its gloo launch
MULTI_GPU in Accelerate's ``PartialState`` before the Accelerator (or the Trainer) reads it;
Accelerate's own code then turns it into FSDP with the plugin, as on GPUs, and everything
after that (``fully_shard`` per layer, the optimizer's parameters, the Trainer's loop) runs as
it would there, on CPU tensors. ``test_hf_gpu.py`` runs the Trainer without this on NCCL.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import qsdp
from qsdp.testing import assert_same_on_all_ranks, count_dist_bytes, run_distributed

from .checks import assert_bytes_counted_and_fewer

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 5
FSDP_RECIPE, DDP_RECIPE = "qsdp-w8g8", "cgx"


# --- model and data (shared with test_hf_gpu.py) ----------------------------------------------
def tiny_llama(hidden: int = 32) -> torch.nn.Module:
    """A 2-layer Llama (grouped-query attention), the same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2() -> torch.nn.Module:
    """A 2-layer GPT-2 (hidden 32) with tied embeddings, the same weights on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def sequences(n: int, seed: int, noise: float = 0.0) -> torch.Tensor:
    """``n`` learnable sequences: each token is the previous one plus 3 (mod the vocabulary);
    with ``noise`` that share of the tokens is drawn at random instead, so the loss has a floor
    well above zero (a long run then ends where a relative bound still means something)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    out = (start + 3 * torch.arange(SEQ)) % VOCAB
    if noise:
        random = torch.randint(0, VOCAB, out.shape, generator=g)
        out = torch.where(torch.rand(out.shape, generator=g) < noise, random, out)
    return out


def dataset(n: int, noise: float = 0.0) -> list[dict[str, torch.Tensor]]:
    """The Trainer's dataset: the same ``n`` examples on every rank (its sampler splits them)."""
    return [{"input_ids": s, "labels": s} for s in sequences(n, seed=7, noise=noise)]


def _launch_env(rank: int, world: int) -> None:
    """What ``torchrun`` sets, so Accelerate finds the process group ``run_distributed`` made."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )


def _fresh_state(fsdp: bool) -> None:
    """A new launch for the next Accelerator (as ``TrainingArguments`` resets it), labelled for
    FSDP on CPU where asked ([Note: FSDP2 on CPU through Accelerate])."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.pop("ACCELERATE_USE_FSDP", None)  # a plugin's Accelerator leaves it set
    if fsdp:
        PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU


def _same_outcome(model: torch.nn.Module) -> float:
    """Assert every rank computes the same logits on the same batch (under DDP: holds the same
    parameters too); returns the logits' sum, a checksum the parent compares across ranks."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=sequences(2, seed=99).to(device)).logits
    assert_same_on_all_ranks(logits)
    inner = getattr(model, "module", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        for p in inner.parameters():
            assert_same_on_all_ranks(p.detach())
    return float(logits.double().sum())


# --- Accelerate --------------------------------------------------------------------------------
def _accelerate(rank: int, world: int, fsdp: bool, recipe: str | None) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qsdp.integrations import hf

    _fresh_state(fsdp)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp else None
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    compressed = hf.compress(accelerator, model, recipe) if recipe else None  # the added line
    losses = []
    with count_dist_bytes() as sent:
        for step in range(STEPS):
            x = sequences(BATCH, seed=1000 * step + rank)
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
    if compressed is not None:
        compressed.state.check_nonfinite()
    return {
        "type": f"{accelerator.distributed_type.value} {type(model).__name__}",
        "losses": losses,
        "qsdp_bytes": compressed.stats.total_bytes if compressed else None,
        "dist_bytes": sent.total_bytes,
        "numel": sum(p.numel() for p in model.parameters()),
        "checksum": _same_outcome(model),
    }


def _accelerate_misuse(rank: int, world: int) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qsdp.integrations import hf

    out = {}
    _fresh_state(fsdp=True)
    # (sync_module_states=False: FSDP1's plugin looks for an accelerator device otherwise)
    fsdp1 = FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=False)
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp1)
    with pytest.raises(ValueError) as e:
        hf.compress(accelerator, tiny_gpt2(), FSDP_RECIPE)
    out["fsdp1"] = str(e.value)
    _fresh_state(fsdp=False)
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError) as e:  # the model before prepare: not DDP's wrapper
        hf.compress(accelerator, tiny_gpt2(), DDP_RECIPE)
    out["unprepared"] = str(e.value)
    _fresh_state(fsdp=False)
    accelerator = Accelerator()  # no cpu=True on a CPU machine: Accelerate sees one process
    out["type_without_cpu"] = accelerator.distributed_type.value
    if accelerator.distributed_type.value == "NO":
        with pytest.raises(ValueError) as e:
            hf.compress(accelerator, accelerator.prepare(tiny_gpt2()), DDP_RECIPE)
        out["without_cpu"] = str(e.value)
    return out


# --- Trainer -----------------------------------------------------------------------------------
def trainer_options(out_dir: str, steps: int) -> dict:
    """The ``TrainingArguments`` every Trainer test shares: a constant learning rate, a loss
    logged each step, nothing saved or reported."""
    return dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def _arguments(out_dir: str, fsdp: bool, **overrides):
    from transformers import TrainingArguments

    _fresh_state(False)
    options = trainer_options(out_dir, STEPS)
    options.update(use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0)
    if fsdp:
        options.update(fsdp=True, fsdp_config={"version": 2})
    options.update(overrides)
    args = TrainingArguments(**options)
    args.device  # noqa: B018 - sets up the launch (resets Accelerate's state) now
    if fsdp:  # [Note: FSDP2 on CPU through Accelerate]
        _fresh_state(True)
    return args


def _trainer(rank: int, world: int, fsdp: bool, recipe: str | None, out_dir: str) -> dict:
    from transformers import Trainer

    from qsdp.integrations import hf

    args = _arguments(out_dir, fsdp)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset(world * BATCH * STEPS))
    callback = hf.compress_trainer(trainer, recipe) if recipe else None  # the added line
    with count_dist_bytes() as sent:
        trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    compressed = callback.compressed if callback else None
    return {
        "type": f"{trainer.accelerator.distributed_type.value} "
        f"{type(trainer.model_wrapped).__name__}",
        "compressed": type(compressed.model).__name__ if compressed else None,
        "losses": losses,
        "qsdp_bytes": compressed.stats.total_bytes if compressed else None,
        "dist_bytes": sent.total_bytes,
        "numel": sum(p.numel() for p in trainer.model.parameters()),
        "checksum": _same_outcome(trainer.model_wrapped),
    }


class _CompressMidway:
    """A callback that calls compress_trainer from inside train(): the misuse."""

    def __init__(self, trainer) -> None:
        self.trainer, self.message = trainer, None

    def __getattr__(self, event: str):
        return lambda *a, **k: None

    def on_step_end(self, args, state, control, **kwargs) -> None:
        from qsdp.integrations import hf

        if self.message is None:
            try:
                hf.compress_trainer(self.trainer, DDP_RECIPE)
            except ValueError as e:
                self.message = str(e)


def _trainer_misuse(rank: int, world: int, out_dir: str) -> dict:
    from transformers import Trainer

    from qsdp.integrations import hf

    out = {}
    args = _arguments(out_dir, fsdp=True, fsdp_config={"version": 1, "sync_module_states": False})
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset(8))
    with pytest.raises(ValueError) as e:
        hf.compress_trainer(trainer, FSDP_RECIPE)
    out["fsdp1"] = str(e.value)
    args = _arguments(out_dir, fsdp=False, max_steps=2)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset(world * BATCH * 2))
    with pytest.raises(ValueError) as e:
        hf.compress_trainer(
            trainer, DDP_RECIPE, schedule=qsdp.Schedule(staleness=1, start=0, predict="none")
        )
    out["stale"] = str(e.value)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset(world * BATCH * 2))
    midway = _CompressMidway(trainer)
    trainer.add_callback(midway)
    trainer.train()
    out["midway"] = midway.message
    return out


# --- one spawn, the tests read it --------------------------------------------------------------
def _everything(rank: int, world: int, out_dir: str) -> dict:
    _launch_env(rank, world)
    out = {}
    for fsdp, recipe in ((True, FSDP_RECIPE), (False, DDP_RECIPE)):
        kind = "fsdp2" if fsdp else "ddp"
        for name in (None, recipe):
            out["accelerate", kind, name] = _accelerate(rank, world, fsdp, name)
            out["trainer", kind, name] = _trainer(rank, world, fsdp, name, out_dir)
    out["accelerate", "misuse"] = _accelerate_misuse(rank, world)
    out["trainer", "misuse"] = _trainer_misuse(rank, world, out_dir)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="qsdp-hf-") as out_dir:
        return run_distributed(_everything, 2, out_dir, timeout_s=300)


CASES = [
    ("accelerate", "fsdp2", FSDP_RECIPE, "FSDP FSDPGPT2LMHeadModel"),
    ("accelerate", "ddp", DDP_RECIPE, "MULTI_CPU DistributedDataParallel"),
    ("trainer", "fsdp2", FSDP_RECIPE, "FSDP FSDPLlamaForCausalLM"),
    ("trainer", "ddp", DDP_RECIPE, "MULTI_CPU DistributedDataParallel"),
]


@pytest.mark.parametrize("stack, kind, recipe, prepared", CASES)
def test_trains_like_the_uncompressed_run(runs, stack, kind, recipe, prepared):
    plain, qsdp = runs[0][stack, kind, None], runs[0][stack, kind, recipe]
    assert plain["type"] == qsdp["type"] == prepared  # the framework built what was asked
    assert len(qsdp["losses"]) == len(plain["losses"]) == STEPS
    assert qsdp["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-3)
    assert qsdp["losses"][-1] < 0.97 * qsdp["losses"][0], qsdp["losses"]  # it learns
    # the compressed run ends where the uncompressed one does (the recipes' 2% bound)
    assert qsdp["losses"][-1] == pytest.approx(plain["losses"][-1], rel=0.02), (plain, qsdp)
    assert qsdp["losses"] != plain["losses"]  # and what crossed the wire was compressed


@pytest.mark.parametrize("stack, kind, recipe, prepared", CASES)
def test_bytes_are_counted_and_fewer(runs, stack, kind, recipe, prepared):
    plain, qsdp = runs[0][stack, kind, None], runs[0][stack, kind, recipe]
    assert_bytes_counted_and_fewer(plain, qsdp, kind, STEPS)


@pytest.mark.parametrize("stack, kind, recipe, prepared", CASES)
def test_every_rank_ends_the_same(runs, stack, kind, recipe, prepared):
    for name in (None, recipe):
        first = runs[0][stack, kind, name]
        for other in runs[1:]:
            assert other[stack, kind, name]["losses"] == first["losses"]
            assert other[stack, kind, name]["checksum"] == first["checksum"]
            assert other[stack, kind, name]["qsdp_bytes"] == first["qsdp_bytes"]


def test_trainer_compresses_the_model_it_prepared(runs):
    assert runs[0]["trainer", "fsdp2", FSDP_RECIPE]["compressed"] == "FSDPLlamaForCausalLM"
    assert runs[0]["trainer", "ddp", DDP_RECIPE]["compressed"] == "DistributedDataParallel"


def test_accelerate_misuse_raises_naming_the_fix_on_every_rank(runs):
    for r in runs:
        message = r["accelerate", "misuse"]["fsdp1"]
        assert "fsdp_version=1" in message and "fsdp_version=2" in message, message
        message = r["accelerate", "misuse"]["unprepared"]
        assert "GPT2LMHeadModel, not a DistributedDataParallel" in message, message
        assert "accelerator.prepare(model, optimizer)" in message, message
        # two processes launched without GPUs, Accelerator() without cpu=True: one process to
        # Accelerate; the message says why and what to pass
        assert r["accelerate", "misuse"]["type_without_cpu"] == "NO"
        message = r["accelerate", "misuse"]["without_cpu"]
        assert "WORLD_SIZE=2" in message and "Accelerator(cpu=True)" in message, message


def test_trainer_misuse_raises_naming_the_fix_on_every_rank(runs):
    for r in runs:
        message = r["trainer", "misuse"]["fsdp1"]
        assert "fsdp_version=1" in message and "fsdp_config={'version': 2}" in message, message
        message = r["trainer", "misuse"]["stale"]
        assert "Schedule(staleness=1)" in message and "hf.compress" in message, message
        message = r["trainer", "misuse"]["midway"]
        assert message is not None and "before trainer.train()" in message, message
