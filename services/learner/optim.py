"""Adam for the learner: ``torch.optim.Adam(params, lr, betas, eps, fused=True)``, the same update and the same
``state_dict`` (a checkpoint written by either loads into the other), called through torch's functional API.

Why not torch.optim.Adam itself: constructing any torch.optim optimizer imports torch._dynamo (~0.6 s of CPU
and 800 modules, sympy among them) for its ``_disable_dynamo`` wrappers. In a fresh learner process that import
sat on the critical path of a run's first update; on CartPole it was a sixth of the time to solve. The
functional ``torch.optim.adam.adam`` runs the same fused kernel without it, and skips the per-step hook and
profiler bookkeeping of ``Optimizer.step`` too.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam


class Adam:
    """One parameter group, fused kernel, no AMSGrad/weight decay: all the on-policy learner uses."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params: list[torch.Tensor] = list(params)
        self.param_groups = [{"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0, "amsgrad": False,
                              "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                              "fused": True, "decoupled_weight_decay": False}]
        self.state: dict[int, dict[str, torch.Tensor]] = {}  # by parameter index, created at its first step

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in live:
            if i not in self.state:  # torch.optim.Adam's lazy state: a float32 step counter on the device
                p = self.params[i]
                self.state[i] = {"step": torch.tensor(0.0, dtype=torch.float32, device=p.device),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        if not live:
            return
        states = [self.state[i] for i in live]
        beta1, beta2 = group["betas"]
        adam([self.params[i] for i in live], [self.params[i].grad for i in live], [s["exp_avg"] for s in states],
             [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True, amsgrad=False,
             beta1=beta1, beta2=beta2, lr=float(group["lr"]), weight_decay=0.0, eps=group["eps"], maximize=False)

    def state_dict(self) -> dict:
        return {"state": {i: dict(s) for i, s in self.state.items()},
                "param_groups": [{**self.param_groups[0], "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state: dict) -> None:
        groups = state["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"optimiser state for parameter groups of sizes {[len(g['params']) for g in groups]} "
                             f"does not fit this policy's one group of {len(self.params)}: was the checkpoint "
                             f"written for another policy architecture?")
        saved = groups[0]
        for key in ("lr", "eps"):
            self.param_groups[0][key] = saved[key]
        self.param_groups[0]["betas"] = tuple(saved["betas"])
        self.state = {}
        for key, s in state["state"].items():
            i = saved["params"].index(int(key))
            p = self.params[i]
            self.state[i] = {"step": torch.as_tensor(s["step"], dtype=torch.float32, device=p.device).clone(),
                             "exp_avg": s["exp_avg"].to(p).clone(), "exp_avg_sq": s["exp_avg_sq"].to(p).clone()}


__all__ = ["Adam"]
