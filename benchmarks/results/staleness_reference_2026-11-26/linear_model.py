"""Why a one-step delay hurts momentum methods so much: heavy ball on a quadratic direction of
curvature lambda, learning rate eta, momentum beta. Prints, per beta, the largest
a = eta * lambda * (1 - beta) for which the iteration is stable (spectral radius <= 1):

- sync: the gradient at x_t;
- delay: the gradient of x_{t-1} applied at step t (staleness 1);
- oracle: the delayed gradient taken at the exact x_{t+1} (must equal sync);
- pred{c}: the delayed gradient taken at x_t + c * (x_t - x_{t-1}) (weight prediction, c = 1).

    python linear_model.py
"""

import numpy as np


def iteration(a: float, beta: float, mode: str, c: float = 1.0) -> np.ndarray:
    """The linear map of the state (x_t, v_t, gradient in flight)."""

    def step(s: np.ndarray) -> np.ndarray:
        x, v, inflight = s
        if mode == "sync":
            v2 = beta * v + x
            return np.array([x - a * v2, v2, 0.0])
        if mode == "delay":
            at = x
        elif mode == "pred":
            at = x - c * a * v  # x_t plus the last update, scaled by c
        elif mode == "oracle":
            at = x - a * (beta * v + inflight)
        v2 = beta * v + inflight
        return np.array([x - a * v2, v2, at])

    return np.stack([step(e) for e in np.eye(3)], 1)


def first_unstable(beta: float, mode: str, c: float = 1.0) -> float:
    for a in np.linspace(1e-4, 5, 20000):
        if max(abs(np.linalg.eigvals(iteration(a, beta, mode, c)))) > 1 + 1e-9:
            return a * (1 - beta)
    return float("nan")


if __name__ == "__main__":
    for beta in (0.0, 0.5, 0.9):
        row = {m: first_unstable(beta, m) for m in ("sync", "delay", "oracle")}
        for c in (0.5, 1.0, 2.0):
            row[f"pred{c}"] = first_unstable(beta, "pred", c)
        print(f"beta {beta}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
