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
    """Fused Adam without AMSGrad or weight decay: all that the algorithms using it need. ``params`` is tensors (one group)
    or groups as torch takes them, ``{"params": [...], **options}``; a group's ``lr`` is set on it (a critic may
    step at its own rate)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.params: list[torch.Tensor] = []
        self.group_indices: list[list[int]] = []  # each group's parameters, as indices into self.params
        self.param_groups: list[dict] = []
        for group in groups:
            tensors = list(group["params"])
            self.group_indices.append(list(range(len(self.params), len(self.params) + len(tensors))))
            self.params += tensors
            self.param_groups.append({"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0,
                                      "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                                      "differentiable": False, "fused": True, "decoupled_weight_decay": False,
                                      **{k: v for k, v in group.items() if k != "params"}})
        self.state: dict[int, dict[str, torch.Tensor]] = {}  # by parameter index, created at its first step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients dropped (torch's default, ``set_to_none=True``: the only way this optimiser clears them)."""
        if not set_to_none:
            raise ValueError("learner.optim.Adam clears gradients by dropping them: call zero_grad() or "
                             "zero_grad(set_to_none=True)")
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for group, indices in zip(self.param_groups, self.group_indices, strict=True):
            live = [i for i in indices if self.params[i].grad is not None]
            for i in live:
                if i not in self.state:  # torch.optim.Adam's lazy state: a float32 step counter on the device
                    p = self.params[i]
                    self.state[i] = {"step": torch.tensor(0.0, dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if not live:
                continue
            states = [self.state[i] for i in live]
            beta1, beta2 = group["betas"]
            adam([self.params[i] for i in live], [self.params[i].grad for i in live], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True, amsgrad=False,
                 beta1=beta1, beta2=beta2, lr=float(group["lr"]), weight_decay=0.0, eps=group["eps"],
                 maximize=False)

    def state_dict(self) -> dict:
        return {"state": {i: dict(s) for i, s in self.state.items()},
                "param_groups": [{**group, "params": list(indices)}
                                 for group, indices in zip(self.param_groups, self.group_indices, strict=True)]}

    def load_state_dict(self, state: dict) -> None:
        groups = state["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(ix) for ix in self.group_indices]:
            raise ValueError(f"optimiser state for parameter groups of sizes {sizes} does not fit this policy's "
                             f"groups of {[len(ix) for ix in self.group_indices]}: was the checkpoint written for "
                             f"another policy architecture, or with another algorithm.value_learning_rate?")
        saved_index: dict[int, int] = {}
        for group, saved, indices in zip(self.param_groups, groups, self.group_indices, strict=True):
            for key in ("lr", "eps"):
                group[key] = saved[key]
            group["betas"] = tuple(saved["betas"])
            saved_index.update(zip((int(k) for k in saved["params"]), indices, strict=True))
        self.state = {}
        for key, s in state["state"].items():
            i = saved_index[int(key)]
            p = self.params[i]
            self.state[i] = {"step": torch.as_tensor(s["step"], dtype=torch.float32, device=p.device).clone(),
                             "exp_avg": s["exp_avg"].to(p).clone(), "exp_avg_sq": s["exp_avg_sq"].to(p).clone()}


__all__ = ["Adam"]
