"""Global-QSGD's integer carriers versus world size, simulated exactly in one CPU process.

    python benchmarks/global_qsgd_scaling.py            # the headline run (~10 min on 2 cores)
    python benchmarks/global_qsgd_scaling.py --quick    # a few seconds, smaller and fewer

For 1, 2, 4, ..., 128 simulated ranks and every carrier in :data:`qsdp.quant.CARRIERS`, the
mean of the ranks' gradients is computed the way :func:`qsdp.comm.integer_all_reduce` computes
it (op "avg"), and compared with the exact float64 mean. Rows: levels per rank, relative L2
error (mean +- std over the rounding seeds, beside its prediction), an unbiasedness check, the
largest carrier sum seen, bits per element handed to torch.distributed, and "effective ranks"
(how many ranks averaged exactly give the same error against the shared signal). The
uncompressed float32 all-reduce is the baseline in the same run.

[Note: the simulation]
Per seed, for ``n`` ranks holding ``g_r = signal + 0.5 * noise_r`` (fixed data; only the
stochastic-rounding seed changes between seeds, so the mean error over seeds measures the
quantizer's bias on that data)::

    M      = max_r group_absmax(g_r)                      the MAX all-reduce of the scales
    s      = global_int_levels(carrier, n)                floor(L / n), capped at 2^24
    q_r    = global_int_encode(g_r, M, s, stream=noise_stream(r, 0))      on the carrier
    sum    = q_0 + q_1 + ... + q_{n-1}                    in the carrier dtype, like the SUM
    mean   = global_int_decode(sum, M, s, world_size=n, op="avg")

The sum is also taken in int64; the two must agree (no wrap), which is what the level rule
promises. ``tests/comm/test_global_qsgd_scaling.py`` checks the simulation bit for bit against
the real collective on gloo.

[Note: the statistics]
With ``e_jk`` the error of element ``k`` at seed ``j`` (``S`` seeds), ``m_k`` its mean and
``v_k`` its sample variance over seeds: if the quantizer is unbiased, ``E[m_k^2] = E[v_k] / S``
for every element, so ``R = sum m_k^2 / sum (v_k / S)`` is 1 up to noise. ``bias z`` is
``(R - 1) / se(R)`` (delta method over independent elements), about N(0, 1) when unbiased.
``rms bias <=`` is a 3-standard-error upper bound on the RMS bias over elements, as a fraction of
the RMS per-element noise std. The prediction of the error is exact for stochastic rounding:
each code has variance ``f (1 - f)`` levels, ``f`` the fractional part of ``g * s / M``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qsdp.comm import integer_all_reduce_wire_bytes
from qsdp.comm._common import noise_stream  # the streams integer_all_reduce uses
from qsdp.config import recipe
from qsdp.quant import (
    CARRIERS,
    global_int_decode,
    global_int_encode,
    global_int_levels,
    group_absmax,
)

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "fp32"


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of the benchmark."""

    world_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    """Simulated ranks; ranks are nested (rank r holds the same data at every world size)."""
    carriers: tuple[str, ...] = tuple(CARRIERS)
    """Integer carriers to reduce on."""
    dists: tuple[str, ...] = ("normal", "student-t3")
    """Distribution of the signal and of every rank's noise."""
    numel: int = 1 << 20
    """Elements of the gradient."""
    seeds: tuple[int, ...] = tuple(range(8))
    """Stochastic-rounding seeds (the ``seed`` of the collective)."""
    noise: float = 0.5
    """Weight of the rank-specific noise: ``g_r = signal + noise * noise_r``."""
    data_seed: int = 0
    """Seed of the data (the same for every rounding seed)."""
    group_size: int = field(default_factory=lambda: recipe("global-qsgd").grads.group_size)
    """Elements sharing one scale; the ``global-qsgd`` recipe's."""


QUICK = Config(world_sizes=(1, 4, 16, 64), numel=(1 << 15) + 3, seeds=tuple(range(4)))


def _draw(dist: str, numel: int, gen: torch.Generator) -> torch.Tensor:
    z = torch.randn(numel, generator=gen, dtype=torch.float64)
    if dist == "normal":
        return z
    if dist == "student-t3":
        chi2 = torch.randn(3, numel, generator=gen, dtype=torch.float64).square().sum(0)
        return z / (chi2 / 3).sqrt()
    raise ValueError(f"dist={dist!r} must be 'normal' or 'student-t3'")


def rank_gradients(
    dist: str, world_size: int, numel: int, *, noise: float = 0.5, data_seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 gradients ``[world_size, numel]`` of ranks sharing a signal, and the signal.

    Returns:
        ``(g, signal)`` with ``g[r] = signal + noise * noise_r``; rank ``r``'s noise depends on
        ``(data_seed, r)`` only, so a smaller world holds the first ranks of a larger one.
    """
    signal = _draw(dist, numel, torch.Generator().manual_seed(data_seed))
    g = torch.empty(world_size, numel)
    for r in range(world_size):
        gen = torch.Generator().manual_seed(data_seed * 1_000_003 + r + 1)
        g[r] = signal + noise * _draw(dist, numel, gen)
    return g, signal


def global_scales(xs: torch.Tensor, group_size: int) -> torch.Tensor:
    """The shared scale ``M`` per group: the MAX over ranks of each rank's group max-abs."""
    return torch.stack([group_absmax(x, group_size) for x in xs]).amax(dim=0)


def simulate_all_reduce(
    xs: torch.Tensor,
    carrier: str,
    *,
    group_size: int,
    seed: int,
    step: int = 0,
    rounding: str = "stochastic",
) -> tuple[torch.Tensor, int]:
    """What :func:`qsdp.comm.integer_all_reduce` (op "avg") leaves on ``len(xs)`` ranks.

    Args:
        xs: ``[n, numel]`` float32, row ``r`` the input of rank ``r``.
        carrier, group_size, seed, step, rounding: as in ``integer_all_reduce`` (bucket 0).

    Returns:
        ``(mean, max_abs_sum)``: the decoded float32 mean and the largest ``|sum of codes|``.

    Raises:
        ValueError: too many ranks for the carrier (no level left).
        AssertionError: the carrier sum wrapped (the level rule failed).
    """
    n = xs.shape[0]
    levels = global_int_levels(carrier, n)
    scales = global_scales(xs, group_size)
    acc, exact = None, torch.zeros(xs.shape[1], dtype=torch.int64)
    for r, x in enumerate(xs):
        q = global_int_encode(
            x,
            scales,
            levels,
            carrier=carrier,
            group_size=group_size,
            rounding=rounding,
            seed=seed,
            step=step,
            stream=noise_stream(r, 0),
        )
        acc = q if acc is None else acc.add_(q)
        exact += q.long()
    assert torch.equal(acc.long(), exact), f"{carrier} sum wrapped on {n} ranks"
    mean = global_int_decode(acc, scales, levels, world_size=n, group_size=group_size, op="avg")
    return mean, int(exact.abs().max())


def predicted_sq_err(xs: torch.Tensor, scales: torch.Tensor, levels: int, group_size: int):
    """Expected squared L2 error of the stochastic-rounding mean (float64, per element summed)."""
    n, numel = xs.shape
    m = scales.double().repeat_interleave(group_size)[:numel]
    inv = torch.where(m > 0, levels / m, 0.0)
    var = torch.zeros(numel, dtype=torch.float64)
    for x in xs:
        v = x.double() * inv
        f = v - v.floor()
        var += f * (1 - f)
    return float((var * (m / levels) ** 2).sum()) / n**2


def bias_stats(errs: torch.Tensor) -> tuple[float, float]:
    """``(z, bound)`` of the errors ``[seeds, numel]`` (see [Note: the statistics])."""
    s = errs.shape[0]
    a = errs.mean(0).square()
    c = errs.var(0) / s
    if float(c.sum()) == 0.0:  # deterministic errors: any nonzero mean is pure bias
        return (math.inf if float(a.sum()) > 0 else 0.0), math.inf
    r = float(a.sum() / c.sum())
    se = float((a - r * c).square().sum().sqrt() / c.sum())
    z = (r - 1) / se if se > 0 else math.inf
    k = errs.shape[1]
    d = a - c  # unbiased estimate of the squared bias per element
    bias_sq = float(d.mean()) + 3 * float(d.std()) / math.sqrt(k)
    noise_var = float(errs.var(0).mean())
    return z, math.sqrt(max(bias_sq, 0.0) / noise_var)


def _row(dist, carrier, n, **kw) -> dict:
    return {"dist": dist, "carrier": carrier, "world_size": n, **kw}


def measure(cfg: Config, log=print) -> list[dict]:
    """All rows of the benchmark for ``cfg`` (see the module docstring)."""
    rows = []
    g_size = cfg.group_size
    for dist in cfg.dists:
        data, signal = rank_gradients(
            dist, max(cfg.world_sizes), cfg.numel, noise=cfg.noise, data_seed=cfg.data_seed
        )
        # One rank's error against the signal: effective ranks = this / the mean's error.
        single = float(sum((x.double() - signal).square().sum() for x in data)) / len(data)
        for n in cfg.world_sizes:
            xs = data[:n]
            exact = xs.double().mean(0)
            norm = float(exact.norm())
            acc = xs[0].clone()
            for x in xs[1:]:
                acc += x
            base = (acc / n).double()
            rows.append(
                _row(
                    dist,
                    BASELINE,
                    n,
                    supported=True,
                    wire_bits=32.0,
                    rel_err_mean=float((base - exact).norm()) / norm,
                    rel_err_std=0.0,
                    eff_ranks=single / float((base - signal).square().sum()),
                )
            )
            scales = global_scales(xs, g_size)
            for carrier in cfg.carriers:
                limit = CARRIERS[carrier][1]
                try:
                    levels = global_int_levels(carrier, n)
                except ValueError as e:
                    rows.append(_row(dist, carrier, n, supported=False, limit=limit, note=str(e)))
                    continue
                errs, max_sum, sig_err = [], 0, []
                for seed in cfg.seeds:
                    mean, top = simulate_all_reduce(xs, carrier, group_size=g_size, seed=seed)
                    errs.append(mean.double() - exact)
                    sig_err.append(float((mean.double() - signal).square().sum()))
                    max_sum = max(max_sum, top)
                errs = torch.stack(errs)
                rel = errs.norm(dim=1) / norm
                z, bound = bias_stats(errs)
                wire = integer_all_reduce_wire_bytes(cfg.numel, carrier=carrier, group_size=g_size)
                rows.append(
                    _row(
                        dist,
                        carrier,
                        n,
                        supported=True,
                        levels=levels,
                        levels_x_n=levels * n,
                        limit=limit,
                        code_bits=math.log2(2 * levels + 1),
                        wire_bits=8 * wire / cfg.numel,
                        rel_err_mean=float(rel.mean()),
                        rel_err_std=float(rel.std()) if len(rel) > 1 else 0.0,
                        rel_err_pred=math.sqrt(predicted_sq_err(xs, scales, levels, g_size)) / norm,
                        bias_z=z,
                        rms_bias_bound=bound,
                        max_abs_sum=max_sum,
                        eff_ranks=single / (sum(sig_err) / len(sig_err)),
                    )
                )
            log(f"  {dist} n={n} done", flush=True)
    return rows


def _fmt(x: float | None, spec: str) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return format(x, spec)


def markdown(rows: list[dict], cfg: Config) -> str:
    """One markdown table per distribution."""
    out = []
    for dist in cfg.dists:
        out += [
            f"\n**{dist}**: g_r = s + {cfg.noise} n_r, {cfg.numel} elements, group "
            f"{cfg.group_size}, {len(cfg.seeds)} rounding seeds\n",
            "| carrier | ranks | levels/rank | code bits | wire bits/elem | rel L2 err "
            "(mean ± std) | predicted | bias z | rms bias ≤ (×σ) | max abs Σq / L | eff. ranks |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for carrier in (*cfg.carriers, BASELINE):
            for r in (r for r in rows if r["dist"] == dist and r["carrier"] == carrier):
                n = r["world_size"]
                if not r["supported"]:
                    out.append(f"| {carrier} | {n} | 0 (unsupported: raises) |" + " - |" * 8)
                    continue
                err = f"{r['rel_err_mean']:.3e} ± {r['rel_err_std']:.1e}"
                if carrier == BASELINE:
                    cells = ["-", "-", f"{r['wire_bits']:.2f}", err, "-", "-", "-", "-"]
                else:
                    cells = [
                        str(r["levels"]),
                        f"{r['code_bits']:.2f}",
                        f"{r['wire_bits']:.2f}",
                        err,
                        f"{r['rel_err_pred']:.3e}",
                        _fmt(r["bias_z"], "+.1f"),
                        _fmt(r["rms_bias_bound"], ".3f"),
                        f"{r['max_abs_sum']} / {r['limit']}",
                    ]
                cells.append(f"{r['eff_ranks']:.1f}")
                out.append(f"| {carrier} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _json_float(v):
    # strict JSON has no Infinity: a deterministic (biased) error reads "inf"
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer ranks, seeds and elements")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file (default: results/<study>_<date>/...)"
    )
    a = p.parse_args()
    cfg = QUICK if a.quick else Config()
    date = datetime.date.today().isoformat()
    name = f"global_qsgd_scaling_cpu_{date}{'_quick' if a.quick else ''}.json"
    out = a.out or RESULTS / f"global_qsgd_scaling_{date}" / name  # a folder per study
    t0 = time.perf_counter()
    rows = measure(cfg)
    elapsed = time.perf_counter() - t0
    print(markdown(rows, cfg))
    meta = {
        "benchmark": "global_qsgd_scaling",
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": date,
        "elapsed_s": round(elapsed, 1),
        "params": {**asdict(cfg), "rounding": "stochastic", "step": 0, "op": "avg"},
        "rows": [{k: _json_float(v) for k, v in r.items()} for r in rows],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"\nwrote {out} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
