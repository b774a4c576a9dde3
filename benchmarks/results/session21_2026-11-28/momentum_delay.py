"""Does less momentum let a one-step-delayed step run at a higher learning rate? (issue 34)

Momentum in AdamW's form on one quadratic direction (curvature 1): ``m_t = beta m_{t-1} +
(1 - beta) g``, ``x_{t+1} = x_t - a m_t``, with ``g = x_t`` (synchronous) or ``g = x_{t-1}``
(staleness 1). Prints, per beta, the largest stable ``a`` (spectral radius of the iteration
below 1, by bisection over [0, 100]). Output: momentum_delay.txt.

    python benchmarks/results/session21_2026-11-28/momentum_delay.py
"""

import numpy as np


def radius(a: float, beta: float, delay: int) -> float:
    # state [x_t, x_{t-1}, ..., x_{t-delay}, m_{t-1}]
    n = delay + 2
    new_m = np.zeros(n)
    new_m[-1], new_m[delay] = beta, 1 - beta
    new_x = -a * new_m
    new_x[0] += 1
    step = np.zeros((n, n))
    step[0], step[-1] = new_x, new_m
    for i in range(1, delay + 1):
        step[i, i - 1] = 1
    return max(abs(np.linalg.eigvals(step)))


def largest_stable(beta: float, delay: int) -> float:
    lo, hi = 0.0, 100.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if radius(mid, beta, delay) < 1 else (lo, mid)
    return lo


if __name__ == "__main__":
    print("beta   synchronous  delay 1   ratio")
    for beta in (0.0, 0.5, 0.8, 0.9, 0.95):
        s, d = largest_stable(beta, 0), largest_stable(beta, 1)
        print(f"{beta:<5}  {s:11.3f}  {d:7.3f}  {s / d:6.1f}")
