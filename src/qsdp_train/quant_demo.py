"""``qsdp demo``: quantize the weights and gradients of a small trained transformer.

The tensors are real: a byte-level transformer is trained for a few steps on English text that
ships with Python itself (the docstrings of the standard library), so weights and gradients have
the structure (outliers, per-layer scales) quantizers meet in training. Each quantizer of the
recipes is applied to every tensor; the table reports the error against the exact tensor and the
bytes on the wire against bf16.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qsdp.quant import QuantSpec, decode, encode, encode_diff

from .model import GPT, ModelConfig

#: The quantizers of the recipes, by role.
SPECS: dict[str, QuantSpec] = {
    "W8 absmax (QSDP weights)": QuantSpec(8, 128, "absmax", "nearest"),
    "W8 shift-lattice (QSDP theory)": QuantSpec(8, 128, "shift-lattice", "nearest"),
    "G8 minmax (QSDP/CGX grads)": QuantSpec(8, 128, "minmax", "stochastic"),
    "G8 absmax+H32 (SDP4Bit intra)": QuantSpec(8, 128, "absmax", "stochastic", hadamard_block=32),
    "G4 absmax (no Hadamard)": QuantSpec(4, 128, "absmax", "stochastic"),
    "G4 absmax+H32 (SDP4Bit inter)": QuantSpec(4, 128, "absmax", "stochastic", hadamard_block=32),
    "G2 absmax+H32": QuantSpec(2, 128, "absmax", "stochastic", hadamard_block=32),
}
QWD = QuantSpec(4, 2048, "absmax", "stochastic")
W4_DIRECT = QuantSpec(4, 2048, "absmax", "stochastic")


@dataclass
class Row:
    tensors: str
    spec: str
    numel: int
    wire_bytes: int
    ratio_vs_bf16: float
    rel_l2_error: float


#: The modules whose docstrings make the corpus (all in every CPython 3.10+).
CORPUS_MODULES = (
    "argparse", "collections", "json", "logging", "pathlib", "subprocess", "typing", "pydoc",
    "inspect", "textwrap", "difflib", "tarfile", "zipfile", "unittest", "email.message",
    "http.client", "shutil", "tempfile", "threading", "functools", "itertools", "datetime",
    "decimal", "fractions", "statistics", "random", "string", "re",
)  # fmt: skip


def corpus(min_bytes: int = 200_000) -> bytes:
    """English text from the standard library's docstrings (offline, always present).

    Only the docstrings themselves, in a fixed order (module, then its public classes and
    functions by name, then each class's own public methods by name), so the bytes are the same
    whatever the process did before. ``pydoc``'s rendering is not: it lists attributes such as
    a class's ``__annotations__``, which exists once anything has read it (``typing``'s
    classes gained one after a CUDA FSDP2 run, and a test's second training run then saw other
    batches than its first).
    """
    import importlib
    import inspect

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
    data = "\n\n".join(text).encode("ascii", "ignore")
    if len(data) < min_bytes:
        raise RuntimeError(f"only {len(data)} bytes of stdlib docstrings found")
    return data


#: The demo's model: qsdp's GPT with 2 blocks of width 128 over bytes (0.4 M parameters).
TINY_LM = ModelConfig(n_layer=2, n_head=4, d_model=128, block_size=64, vocab_size=256)


def train_tiny(steps: int, seed: int = 0) -> tuple[GPT, list[torch.Tensor], list[float]]:
    """Train a few steps; return the model, its last gradients and the loss curve."""
    torch.manual_seed(seed)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    model = GPT(TINY_LM)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        ix = torch.randint(0, data.numel() - 65, (32,))
        batch = torch.stack([data[i : i + 65] for i in ix.tolist()])
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, [p.grad.detach().clone() for p in model.parameters()], losses


def _measure(
    name: str,
    tensors: list[torch.Tensor],
    spec: QuantSpec,
    label: str,
    base: list[torch.Tensor] | None = None,
) -> Row:
    err2 = ref2 = 0.0
    wire = numel = 0
    for i, t in enumerate(tensors):
        if base is None:
            enc = encode(t, spec, seed=1, stream=i)
            exact = t.float()
            got = decode(enc).float()
        else:  # weight differences against the previous weights
            enc = encode_diff(t, base[i], spec, seed=1, stream=i)
            exact = t.float()
            got = base[i].float() + decode(enc).float()
        err2 += float(((got - exact) ** 2).sum())
        ref2 += float((exact**2).sum())
        wire += enc.wire_bytes
        numel += t.numel()
    return Row(name, label, numel, wire, 2 * numel / wire, (err2 / max(ref2, 1e-30)) ** 0.5)


def run(steps: int = 30, out: Path | None = None) -> list[Row]:
    t0 = time.perf_counter()
    model, grads, losses = train_tiny(steps)
    weights = [p.detach().to(torch.bfloat16) for p in model.parameters()]
    print(
        f"trained a {sum(w.numel() for w in weights) / 1e6:.2f} M-parameter byte-level "
        f"transformer for {steps} steps on stdlib docs: loss {losses[0]:.2f} -> "
        f"{losses[-1]:.2f} ({time.perf_counter() - t0:.1f} s)"
    )
    rows = []
    for label, spec in SPECS.items():
        target = weights if label.startswith("W") else grads
        rows.append(
            _measure(
                "weights" if label.startswith("W") else "gradients",
                target,
                spec,
                f"{label}: {spec}",
            )
        )
    # SDP4Bit's qWD: 4-bit differences of one optimizer step versus 4-bit weights directly.
    new = [
        (w.float() - 1e-3 * g.sign()).to(torch.bfloat16)
        for w, g in zip(weights, grads, strict=True)
    ]
    rows.append(_measure("weights", new, W4_DIRECT, f"W4 direct: {W4_DIRECT}"))
    rows.append(_measure("weights", new, QWD, f"W4 differences (qWD): {QWD}", base=weights))
    header = (
        f"{'tensors':<10} {'quantizer':<70} {'wire bytes':>11} {'vs bf16':>8} {'rel L2 err':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.tensors:<10} {r.spec:<70} {r.wire_bytes:>11,} {r.ratio_vs_bf16:>7.2f}x "
            f"{r.rel_l2_error:>11.2e}"
        )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "quant_demo.json").write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "steps": steps,
                    "losses": losses,
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
        print(f"wrote {out / 'quant_demo.json'}")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="qsdp demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="training steps before quantizing")
    p.add_argument("--out", type=Path, default=None, help="write quant_demo.json here")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps={a.steps} must be >= 1")
    run(a.steps, a.out)
