"""GRPO for embodied tasks (episode-level groups, as RLinf runs it for VLA policies): no value function, each
episode is scored against the other episodes that started from the same initial state.

    a batch: N envs in groups of G (``group_size``); each group is reset to one initial state and every env plays
             one episode of at most T decisions (steps after an env's first episode ended are masked out)
    return      R_i = sum_t r_{i,t} over env i's first episode
    advantage   A_i = (R_i - mean of its group) / (std of its group + eps)   (scale_rewards: none keeps R_i - mean)
    ratio       rho = pi(a_t | s_t) / pi_old(a_t | s_t)   per decision, action or token (the policy's log-prob level)
    loss        -mean over the episodes' decisions of min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i)

Every decision of an episode gets the episode's advantage (a chunk's actions and tokens too). A group whose
episodes all scored the same teaches nothing and is left out of the loss (``zero_std_fraction`` reports how
many); ``n_steps`` should cover the task's episode length so that every episode finishes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import Algorithm, AlgorithmConfig, DataAccess, Trajectory, register
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")
optim = lazy_import("rlfabric.services.learner.optim")


class EmbodiedGRPOConfig(AlgorithmConfig):
    name: Literal["grpo_embodied"] = "grpo_embodied"
    group_size: int = Field(8, ge=2, le=1024, description="episodes per group, all from one initial state")
    n_steps: int = Field(32, ge=1, le=100_000, description="decisions per env per batch: at least the task's "
                                                           "episode length")
    epochs: int = Field(4, ge=1, le=100, description="passes over each batch")
    minibatch_size: int = Field(256, ge=1, le=1 << 20, description="decisions per gradient step")
    learning_rate: float = Field(3e-4, gt=0, allow_inf_nan=False, description="Adam's step size")
    clip_low: float = Field(0.2, gt=0, lt=1, allow_inf_nan=False, description="eps_low of the ratio clip")
    clip_high: float = Field(0.28, gt=0, allow_inf_nan=False, description="eps_high (clip-higher: > eps_low)")
    scale_rewards: Literal["group", "none"] = Field(
        "group", description="divide each advantage by its group's return std (none: only subtract the mean)")
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False, description="clip of the gradient's global norm")


def first_episode_mask(dones: torch.Tensor) -> torch.Tensor:
    """[T, N] 1 for the decisions of each env's first episode in the batch (its ending step included)."""
    ended_before = torch.cumsum(dones, 0) - dones
    return (ended_before == 0).to(dones.dtype)


def episode_advantages(returns: torch.Tensor, group_size: int, scale: bool,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-env advantages [N] of episode returns [N] in consecutive groups of ``group_size``, and a [N] mask of
    the envs whose group had any spread."""
    groups = returns.reshape(-1, group_size)
    centred = groups - groups.mean(1, keepdim=True)
    std = groups.std(1, keepdim=True)
    adv = centred / (std + eps) if scale else centred
    return adv.reshape(-1), (std > eps).expand_as(groups).reshape(-1)


@register
class EmbodiedGRPO(Algorithm):
    Config = EmbodiedGRPOConfig
    policy = "actor_critic"

    @classmethod
    def trajectory(cls, cfg: EmbodiedGRPOConfig) -> Trajectory:
        return Trajectory(fields=("obs", "actions", "logp", "rewards", "dones"), episode_groups=cfg.group_size)

    @classmethod
    def data(cls, cfg: EmbodiedGRPOConfig) -> DataAccess:
        return DataAccess.on_policy()

    @classmethod
    def check(cls, run: Any) -> None:
        if run.env.num_envs % run.algorithm.group_size:
            raise ValueError(f"env.num_envs={run.env.num_envs} is not a multiple of algorithm.group_size="
                             f"{run.algorithm.group_size}. Fix: make every group whole")

    def __init__(self, policy: nn.Module, run: Any, generator: torch.Generator | None = None, **kw: Any):
        super().__init__(policy, run, generator, **kw)
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = optim.Adam(self.params, lr=self.cfg.learning_rate, eps=1e-5)

    def update(self, batch: dict) -> dict[str, float]:
        cfg = self.cfg
        rewards, dones = batch["rewards"], batch["dones"].float()
        T, N = rewards.shape
        self.env_steps += T * N
        mask = first_episode_mask(dones)
        returns = (rewards * mask).sum(0)
        advantages, spread = episode_advantages(returns, cfg.group_size, cfg.scale_rewards == "group")
        mask = mask * spread.to(mask.dtype)[None]
        rows = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]  # the decisions that teach something
        flat = {
            "obs": tree_map(lambda x: x.reshape(T * N, *x.shape[2:]), batch["obs"]),
            "actions": batch["actions"].reshape(T * N, *batch["actions"].shape[2:]),
            "logp": batch["logp"].reshape(T * N, *batch["logp"].shape[2:]),
            "advantages": advantages[None].expand(T, N).reshape(-1),
        }
        sums: dict[str, float] = {}
        count = 0
        mb = min(cfg.minibatch_size, max(len(rows), 1))
        for _ in range(cfg.epochs if len(rows) else 0):
            order = rows[torch.randperm(len(rows), generator=self.generator,
                                        device=self.generator.device if self.generator is not None else "cpu")]
            for start in range(0, len(order), mb):
                idx = order[start:start + mb]
                new_logp, entropy, _ = self.policy.evaluate(tree_map(lambda x, i=idx: x[i], flat["obs"]),
                                                            flat["actions"][idx])
                adv = flat["advantages"][idx].reshape(-1, *(1,) * (new_logp.dim() - 1))
                log_ratio = new_logp - flat["logp"][idx]
                ratio = log_ratio.exp()
                clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
                loss = -torch.min(ratio * adv, clipped * adv).mean()
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm, foreach=True)
                self.optimizer.step()
                self.optimizer_steps += 1
                with torch.no_grad():
                    stats = {"policy_loss": float(loss), "entropy": float(entropy.mean()),
                             "approx_kl": float(((ratio - 1) - log_ratio).mean()),
                             "clip_fraction": float(((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high))
                                                    .float().mean())}
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out.update(episode_return_mean=float(returns.mean()),
                   zero_std_fraction=float(1.0 - spread.float().mean()),
                   unfinished_fraction=float((dones.sum(0) == 0).float().mean()))
        return out


__all__ = ["EmbodiedGRPO", "EmbodiedGRPOConfig", "episode_advantages", "first_episode_mask"]
