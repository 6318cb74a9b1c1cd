"""SAC-Flow (Zhang et al. 2025, "SAC Flow: sample-efficient reinforcement learning of flow-based policies via
velocity-reparameterized sequential modeling"): SAC whose actor is a flow-matching policy, its K Euler steps from
noise to action sampled as a noisy sequence (the ``flow_actor`` policy: services/policies/flow_actor.py).

    actor     x_0 ~ N(0, I),  x_{k+1} = x_k + v_theta(s, x_k, t_k) / K + sigma(s) / sqrt(K) * eps_k,  a = tanh(x_K)
              v_theta gated (Flow-G): v = sigmoid(G) * (C - x), a GRU-like update that keeps the gradient through
              the K steps bounded
    log pi    log pi(a|s) := sum_k log N(x_{k+1}; x_k + v_k / K, sigma^2 / K) - sum log(1 - tanh(x_K)^2)
              (the noise-augmented chain's likelihood given x_0, whose own density does not depend on theta)
    critic    y = r + gamma * (1 - terminated) * (min_j Q'_j(s', a') - alpha * log pi(a'|s')),  a' ~ pi(s')
    actor     L_pi = E[alpha * log pi(a|s) - min_j Q_j(s, a)],  a from the reparameterised chain: the gradient
              runs back through all K steps (backpropagation through the flow's rollout)
    alpha     L_alpha = E[-log alpha * (log pi(a|s) + target_entropy)]

Everything but the actor is SAC's (sac.py): twin critics and their Polyak targets, the temperature, the replay
access and the update-to-data ratio. The chain's log-likelihood has K Gaussian terms where a Gaussian actor has
one, so the entropy it implies for a given total noise differs from a Gaussian's: ``target_entropy`` (default
-action_dim, SAC's) is the knob.
"""

from __future__ import annotations

from typing import Literal

from rlfabric.services.core.algorithm import register
from rlfabric.services.learner.algorithms.sac import SAC, SACConfig


class SACFlowConfig(SACConfig):
    name: Literal["sac_flow"] = "sac_flow"  # type: ignore[assignment]


@register
class SACFlow(SAC):
    Config = SACFlowConfig
    policy = "flow_actor"


__all__ = ["SACFlow", "SACFlowConfig"]
