"""Flow-SDE: the denoising chain of a flow-matching action expert as a Markov chain of Gaussians, so that RL can
score it (the piRL method). Shared by every flow policy (policy.name vla with head flow, pi0).

With x_tau = (1 - tau) x0 + tau x1 (x0 ~ N(0, I) noise, x1 the chunk) and v = E[x1 - x0 | x_tau], the score is
-(x - tau v) / (1 - tau), and the SDE with the flow's marginals and noise level sigma is

    dx = [v - sigma^2 / (2 (1 - tau)) * (x - tau v)] dtau + sigma dW

Euler-Maruyama with d = 1/K: x_{k+1} ~ N(mu_k, sigma^2 d), mu_k = x_k + d * drift(x_k, tau_k). The chain x_0..x_K
is what an update re-scores: log pi(chain) = sum_k log N(x_{k+1}; mu_k, sigma^2 d) (x_0's density does not depend on
the policy). With sigma = 0 the step is the ODE's Euler step (deterministic acting).

Noise on the last step only (``sde_steps: last``): x_1..x_{K-1} follow the ODE from the recorded x_0, and x_K ~
N(mu_{K-1}, sigma^2) around the last Euler step. The pair (x_0, x_K) is the action: x_0's density does not depend on
the policy, so log pi = log N(x_K; mu_{K-1}(theta, x_0), sigma^2), and the update re-runs the K - 1 ODE steps from
x_0 under the new weights. Every noise dimension then moves the executed chunk; with noise on all K steps most of
the scored noise (the early steps') is undone by the flow and only adds variance to the gradient.
"""

from __future__ import annotations

import math

import torch


def step_mean(x: torch.Tensor, v: torch.Tensor, tau: torch.Tensor, sigma: float, steps: int) -> torch.Tensor:
    """mu_k for points x [N, ...] at times tau [N] with velocities v (x's shape)."""
    tau = tau.reshape(-1, *([1] * (x.dim() - 1)))
    drift = v - sigma ** 2 / (2 * (1 - tau)) * (x - tau * v)
    return x + drift / steps


def step_std(sigma: float, steps: int) -> float:
    return sigma * math.sqrt(1.0 / steps)


def chain_logp(chain: torch.Tensor, means: torch.Tensor, sigma: float, steps: int) -> torch.Tensor:
    """Per-element log-prob of a chain [B, K+1, ...] given each step's mean [B, K, ...], summed over the K steps."""
    std = step_std(sigma, steps)
    z = (chain[:, 1:] - means) / std
    return (-0.5 * z.pow(2) - math.log(std) - 0.5 * math.log(2 * math.pi)).sum(1)


def chain_entropy(sigma: float, steps: int) -> float:
    """Entropy per element of a chain: its noise is fixed, so it is a constant."""
    return steps * 0.5 * math.log(2 * math.pi * math.e * step_std(sigma, steps) ** 2)


def last_step_logp(x_last: torch.Tensor, mean: torch.Tensor, sigma: float) -> torch.Tensor:
    """Per-element log-prob of the chain's last point around the last Euler step's mean (noise on the last step)."""
    z = (x_last - mean) / sigma
    return -0.5 * z.pow(2) - math.log(sigma) - 0.5 * math.log(2 * math.pi)


def last_step_entropy(sigma: float) -> float:
    return 0.5 * math.log(2 * math.pi * math.e * sigma ** 2)
