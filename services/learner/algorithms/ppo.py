"""PPO (Schulman et al. 2017), the clipped-surrogate variant, as CleanRL and SB3 write it.

    GAE:      delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)
              A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}
    policy:   L_pi = -E[min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)],  ratio = pi(a|s) / pi_old(a|s)
    value:    L_v  = E[(V - R)^2]  (or the max of clipped and unclipped errors when clip_range_vf is set)
    total:    L = L_pi + vf_coef * L_v - ent_coef * entropy

Batches are time-major [T, N] as the rollout records them (``trajectory``); a truncated episode arrives with its
bootstrap value gamma * V(final obs) already folded into its last reward.

Action chunks (env.action_chunk = H): a step is one decision that executed n <= H primitive actions.
    reward_level chunk:   r_t = sum_h r_{t,h}, discounted by gamma per decision
    reward_level action:  r_t = sum_h gamma^h r_{t,h}, discounted by gamma^n (exact per primitive step)
Log-probs may come per decision, per action or per token (the policy's level): the ratio is taken per element and
each element gets its decision's advantage.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import Algorithm, AlgorithmConfig, DataAccess, Trajectory, register
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.core.policy import OwnCritic

torch = lazy_import("torch")
nn = lazy_import("torch.nn")
optim = lazy_import("rlfabric.services.learner.optim")


class PPOConfig(AlgorithmConfig):
    name: Literal["ppo"] = "ppo"
    n_steps: int = Field(32, ge=1, le=1_000_000, description="steps per env per batch")
    batch_size: int = Field(256, ge=1, description="minibatch size")
    n_epochs: int = Field(20, ge=1, le=10_000, description="passes over each batch")
    gamma: float = Field(0.98, gt=0, le=1, description="discount per decision (reward_level: action, per step)")
    gae_lambda: float = Field(0.8, ge=0, le=1, description="GAE's lambda: bias (0) against variance (1)")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False, description="Adam's step size")
    value_learning_rate: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Adam's step size for the critic's own weights (the policy's value_modules); None: learning_rate. "
                    "A fresh critic beside a warm-started actor needs a larger step than the actor tolerates. "
                    "lr_schedule scales both")
    lr_schedule: Literal["constant", "linear"] = Field("linear", description="linear: decays to 0 over the run")
    clip_range: float = Field(0.2, gt=0, allow_inf_nan=False, description="eps of the ratio clip [1 - eps, 1 + eps]")
    clip_schedule: Literal["constant", "linear"] = Field("linear", description="linear: decays to 0 over the run")
    clip_range_vf: float | None = Field(None, gt=0, allow_inf_nan=False, description="None disables value clipping")
    ent_coef: float = Field(0.0, allow_inf_nan=False, description="weight of the entropy bonus")
    vf_coef: float = Field(0.5, ge=0, allow_inf_nan=False, description="weight of the value loss")
    max_grad_norm: float = Field(0.5, gt=0, allow_inf_nan=False, description="clip of the gradient's global norm")
    normalize_advantage: bool = Field(True, description="whiten the advantages of each minibatch")
    target_kl: float | None = Field(None, gt=0, allow_inf_nan=False, description="stop the update's epochs once the "
                                                                                "approximate KL passes this; None: never")
    reward_level: Literal["chunk", "action"] = Field(
        "chunk", description="with action chunks: sum a chunk's rewards (chunk) or discount them per step (action)")
    critic_warmup: int = Field(0, ge=0, le=1_000_000, description="the first N updates train the value function "
                                                                  "alone (no policy loss): a warm-started actor (an "
                                                                  "SFT checkpoint) keeps its behaviour while its new "
                                                                  "critic learns, instead of following noise")


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_values: torch.Tensor,
                gamma: float | torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns for [T, N] rewards/values/dones, bootstrapping from the values after step T.
    ``gamma`` may be a [T, N] tensor: the discount from each step to the next (gamma^n for a chunk of n steps)."""
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(last_values)
    for t in reversed(range(T)):
        next_values = last_values if t == T - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        g = gamma[t] if isinstance(gamma, torch.Tensor) else gamma
        delta = rewards[t] + g * next_values * not_done - values[t]
        last_gae = delta + g * lam * not_done * last_gae
        advantages[t] = last_gae
    return advantages, advantages + values


def ppo_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, new_values: torch.Tensor,
             old_values: torch.Tensor, returns: torch.Tensor, entropy: torch.Tensor, clip: float,
             clip_vf: float | None, vf_coef: float, ent_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    policy_loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
    if clip_vf is None:
        value_loss = (new_values - returns).pow(2).mean()
    else:
        clipped = old_values + (new_values - old_values).clamp(-clip_vf, clip_vf)
        value_loss = torch.max((new_values - returns).pow(2), (clipped - returns).pow(2)).mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + vf_coef * value_loss
    if ent_coef:  # with no bonus, backward need not differentiate the entropy (a tenth of its work here)
        loss = loss - ent_coef * entropy_mean
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(), "entropy": entropy_mean.detach(),
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_fraction": ((ratio - 1).abs() > clip).float().mean(),
        }
    return loss, stats


def per_step_discounting(rewards: torch.Tensor, step_rewards: torch.Tensor, step_valid: torch.Tensor,
                         gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Action-level rewards of [T, N] chunk decisions: sum_h gamma^h r_h, and gamma^n to the next decision. A
    truncation bootstrap the collector folded into ``rewards`` (as gamma * V) is moved to gamma^n * V."""
    H = step_rewards.shape[-1]
    powers = gamma ** torch.arange(H, dtype=rewards.dtype, device=rewards.device)
    executed = step_valid.sum(-1)
    bootstrap = rewards - (step_rewards * step_valid).sum(-1)
    discounted = (step_rewards * step_valid * powers).sum(-1) + bootstrap * gamma ** (executed - 1).clamp(min=0)
    return discounted, gamma ** executed


def linear(start: float, progress_remaining: float, schedule: str) -> float:
    return start * progress_remaining if schedule == "linear" else start


def flatten(batch: dict, advantages: torch.Tensor, returns: torch.Tensor, rows: torch.Tensor | None) -> dict:
    """The [T, N] batch's fields an update reads as [T * N] rows (only ``rows`` of them when given)."""
    size = advantages.numel()

    def flat(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(size, *x.shape[2:])
        return x if rows is None else x[rows]

    return {"obs": tree_map(flat, batch["obs"]), "actions": flat(batch["actions"]), "logp": flat(batch["logp"]),
            "values": flat(batch["values"]), "advantages": flat(advantages), "returns": flat(returns)}


def summary(sums: dict[str, torch.Tensor], count: int, mismatch: torch.Tensor | None) -> dict[str, float]:
    """Mean stats over the steps taken, and the rollout-vs-learner log-prob gap of the first minibatch."""
    out = {k: float(v) / max(count, 1) for k, v in sums.items()}
    if mismatch is not None:
        out["logprob_mismatch_abs"] = float(mismatch)
    return out


@register
class PPO(Algorithm):
    Config = PPOConfig
    policy = "actor_critic"
    default = True

    @classmethod
    def trajectory(cls, cfg: PPOConfig) -> Trajectory:
        steps = ("step_rewards", "step_valid") if cfg.reward_level == "action" else ()
        return Trajectory(fields=("obs", "actions", "logp", "values", "rewards", "dones", "last_values", *steps),
                          bootstrap_truncated=cfg.gamma)

    @classmethod
    def data(cls, cfg: PPOConfig) -> DataAccess:
        return DataAccess.on_policy()

    def __init__(self, policy: nn.Module, run, generator: torch.Generator | None = None, **kw):
        super().__init__(policy, run, generator, **kw)
        self.total_env_steps = run.train.total_env_steps
        # fused Adam: one kernel per step instead of a Python loop over tensors (~25% faster updates here);
        # torch.optim.Adam's, without the torch._dynamo import torch.optim costs a fresh process (see optim.py)
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = optim.Adam(self.param_groups(policy), lr=self.cfg.learning_rate, eps=1e-5)
        self.updates = 0

    def param_groups(self, policy: nn.Module) -> list[dict]:
        """One group at learning_rate, or the critic's own weights in a second at value_learning_rate."""
        if self.cfg.value_learning_rate is None:
            return [{"params": self.params, "scale": 1.0}]
        prefixes = tuple(f"{m}." for m in policy.value_modules) if isinstance(policy, OwnCritic) else ()
        named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        critic = [p for n, p in named if prefixes and n.startswith(prefixes)]
        if not critic:
            raise ValueError(f"algorithm.value_learning_rate: policy {type(policy).__name__} names no weights of its "
                             f"own critic (value_modules). Fix: drop value_learning_rate")
        scale = self.cfg.value_learning_rate / self.cfg.learning_rate
        return [{"params": [p for n, p in named if not n.startswith(prefixes)], "scale": 1.0},
                {"params": critic, "scale": scale}]

    def update(self, batch: dict) -> dict[str, float]:
        """The schedules, GAE over the whole [T, N] batch, then ``n_epochs`` passes of minibatches over its rows.
        Three hooks let a variant change the objective without copying the loop: ``rows`` (which samples enter the
        loss), ``score`` (per-row tensors computed once before the first step) and ``minibatch_loss``."""
        cfg = self.cfg
        T, N = batch["rewards"].shape
        self.env_steps += T * N
        progress_remaining = max(0.0, 1.0 - self.env_steps / self.total_env_steps)
        lr = linear(cfg.learning_rate, progress_remaining, cfg.lr_schedule)
        clip = linear(cfg.clip_range, progress_remaining, cfg.clip_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["scale"]
        advantages, returns = self.gae(batch)
        rows, info = self.rows(batch)
        warming = self.updates < cfg.critic_warmup
        self.updates += 1
        info.update(learning_rate=lr, clip_range=clip, critic_warmup=float(warming))
        flat = flatten(batch, advantages, returns, rows)
        n = flat["advantages"].shape[0]
        if n == 0:  # no sample enters the loss: no step
            return info
        mb = min(cfg.batch_size, n)
        info.update(self.score(flat, mb))
        out = self.epochs(flat, mb, clip, warming)
        y, y_hat = flat["returns"], flat["values"]
        var_y = float(y.var()) if n > 1 else 0.0
        out["explained_variance"] = float("nan") if var_y == 0 else 1 - float((y - y_hat).var()) / var_y
        return out | info

    def gae(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Advantages and returns [T, N] from the batch's own values (per-step discounting with reward_level
        action)."""
        cfg = self.cfg
        rewards, gamma = batch["rewards"], cfg.gamma
        if cfg.reward_level == "action" and "step_rewards" in batch:
            rewards, gamma = per_step_discounting(rewards, batch["step_rewards"], batch["step_valid"], cfg.gamma)
        return compute_gae(rewards, batch["values"], batch["dones"].float(), batch["last_values"], gamma,
                           cfg.gae_lambda)

    def rows(self, batch: dict) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Hook: the flat [T * N] rows that enter the loss (None: all of them) and metrics about the choice."""
        return None, {}

    def score(self, flat: dict, mb: int) -> dict[str, float]:
        """Hook: add per-row tensors to ``flat`` before the first step (in chunks of ``mb`` rows); its metrics."""
        return {}

    def minibatch_loss(self, flat: dict, idx: torch.Tensor, new_logp: torch.Tensor, entropy: torch.Tensor,
                       new_values: torch.Tensor, adv: torch.Tensor, clip: float
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Hook: one minibatch's loss and stats: PPO's clipped surrogate, value loss and entropy bonus."""
        cfg = self.cfg
        return ppo_loss(new_logp, flat["logp"][idx], adv, new_values, flat["values"][idx], flat["returns"][idx],
                        entropy, clip, cfg.clip_range_vf, cfg.vf_coef, cfg.ent_coef)

    def epochs(self, flat: dict, mb: int, clip: float, warming: bool) -> dict[str, float]:
        """``n_epochs`` shuffled passes of ``mb``-row minibatches (stopped early past target_kl): the mean stats."""
        cfg = self.cfg
        n = flat["advantages"].shape[0]
        sums: dict[str, torch.Tensor] = {}
        count = 0
        mismatch: torch.Tensor | None = None
        for _ in range(cfg.n_epochs):
            order = torch.randperm(n, generator=self.generator,
                                   device=self.generator.device if self.generator is not None else "cpu")
            for start in range(0, n, mb):
                idx = order[start:start + mb].to(flat["advantages"].device)
                adv = flat["advantages"][idx]
                if cfg.normalize_advantage and len(idx) > 1:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                if warming:  # no policy gradient: the clipped surrogate of a zero advantage is zero
                    adv = torch.zeros_like(adv)
                obs = tree_map(lambda x, i=idx: x[i], flat["obs"])
                new_logp, entropy, new_values = self.policy.evaluate(obs, flat["actions"][idx])
                if mismatch is None:  # before any step: the learner re-scores what the rollout scored (numerics,
                    # plus policy lag when the batch is older than the learner's weights: batch_version)
                    mismatch = (new_logp.detach() - flat["logp"][idx]).abs().mean()
                adv = adv.reshape(-1, *(1,) * (new_logp.dim() - 1))  # each action/token of a decision gets its
                loss, stats = self.minibatch_loss(flat, idx, new_logp, entropy, new_values, adv, clip)
                if cfg.target_kl is not None and stats["approx_kl"] > 1.5 * cfg.target_kl:
                    return summary(sums, count, mismatch)
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm, foreach=True)
                self.optimizer.step()
                self.optimizer_steps += 1
                for k, v in stats.items():  # tensors: one conversion per update, not per minibatch
                    sums[k] = sums[k] + v if k in sums else v
                count += 1
        return summary(sums, count, mismatch)

    def state_dict(self) -> dict:
        return super().state_dict() | {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.updates = int(state.get("updates", 0))  # (checkpoints from before critic_warmup existed: 0)


__all__ = ["PPO", "PPOConfig", "compute_gae", "per_step_discounting", "ppo_loss"]
