"""Algorithm specs: what an algorithm declares so that every service can run it without naming it.

An algorithm is one file under ``services/learner/algorithms/`` (or any package that registers under the
``rlfabric.algorithms`` entry-point group) holding one ``Algorithm`` subclass. Its class-level declarations are
read by every service; an instance is the learner's update:

    Config        its config: a pydantic model whose ``name`` literal is the tag of ``algorithm`` in a run spec
    policy        the policy it trains and the rollout acts with (a name in rlfabric.services.core.policy_names.POLICIES)
    roles         which roles it needs: a rollout that collects (or none: offline), a frozen reference policy,
                  an expert policy
    trajectory()  the fields a collector must record per step, and how episode ends are treated
    data()        how the learner reads replay: the on-policy FIFO, uniform samples, sequence windows, or a
                  weighted mix of named sources (offline demos + online, interventions + online)
    update()      the math, CleanRL style

The coordinator reads ``roles``, ``data()`` and ``iterations()``; a rollout worker reads ``trajectory()``; the
learner builds the instance and feeds it the batches ``data()`` describes. Nothing else knows which algorithm runs.

Every process imports every spec (the config schema is their union), and most processes never train: a spec file
binds torch, and modules that import it, with ``rlfabric.services.core.lazy.lazy_import``, so only the update imports it.
"""

from __future__ import annotations

import importlib
import logging
import math
import pkgutil
import sys
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

    from rlfabric.services.core.batch import TensorBatch

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "rlfabric.algorithms"
DEFAULT_SOURCE = "online"
INTERVENTIONS = "interventions"  # what a human commanded while intervening: (obs, the human's action) rows


class AlgorithmConfig(BaseModel):
    """Base of every algorithm's config section. Subclasses set ``name: Literal["<name>"] = "<name>"``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    name: str


@dataclass(frozen=True)
class Trajectory:
    """What a collector records for the algorithm.

    ``fields``: per-step fields, from what collectors offer: obs, actions, logp, values, rewards, dones,
    terminated, truncated, next_obs, weight_version (the weight version that acted at that step: with a staleness
    bound, shards of one batch may differ), and last_values (the value of the observation after the last step, per
    env).
    ``bootstrap_truncated``: gamma, to fold ``gamma * V(final obs)`` into the reward of a step whose episode was
    truncated (a time limit is not a failure), or None. ``random_until_env_steps``: act uniformly at random until
    the run has collected this many env steps (off-policy warm-up). ``episode_groups``: G > 0 makes every batch
    start fresh episodes, envs in consecutive groups of G from one initial state (one reset seed per group), for
    group-relative advantages over whole episodes; 0 keeps episodes running across batches. ``expert_acts``:
    beta_0 > 0 makes the env execute, at each step of iteration i and independently per env, the expert's action
    (the checkpoint the algorithm's ``expert_checkpoint`` names, loaded by the rollout) with probability
    beta_i = expert_acts * expert_decay ** i, and the policy's otherwise (an imitation mixture; the count of such steps
    is metric ``expert_steps``); what is recorded is what ``fields`` ask."""

    fields: tuple[str, ...]
    bootstrap_truncated: float | None = None
    random_until_env_steps: int = 0
    episode_groups: int = 0
    expert_acts: float = 0.0
    expert_decay: float = 1.0

    def expert_share(self, iteration: int) -> float:
        """beta_i: the probability that the expert acts at a step of iteration ``iteration``."""
        return self.expert_acts * self.expert_decay ** iteration if self.expert_acts > 0 else 0.0


@dataclass(frozen=True)
class DataAccess:
    """How the learner reads replay each iteration.

    onpolicy   take the iteration's batch from the FIFO once (shards of every rollout worker, joined)
    uniform    sample ``batch_size`` rows uniformly from the window of ``sources``' single source
    sequences  sample ``batch_size`` windows of ``length`` consecutive steps
    mix        sample ``batch_size`` rows from several named sources with fixed weights
    ``sources``: (name, weight) pairs; online collection writes to "online", a data set is loaded as "offline",
    and the steps a human commanded (envs under teleop) also go to "interventions" when a spec reads that source."""

    kind: Literal["onpolicy", "uniform", "sequences", "mix"]
    batch_size: int = 0
    length: int = 0
    sources: tuple[tuple[str, float], ...] = ((DEFAULT_SOURCE, 1.0),)

    @classmethod
    def on_policy(cls) -> DataAccess:
        return cls("onpolicy")

    @classmethod
    def uniform(cls, batch_size: int, source: str = DEFAULT_SOURCE) -> DataAccess:
        return cls("uniform", batch_size, sources=((source, 1.0),))

    @classmethod
    def sequence_windows(cls, batch_size: int, length: int, source: str = DEFAULT_SOURCE) -> DataAccess:
        return cls("sequences", batch_size, length, sources=((source, 1.0),))

    @classmethod
    def mix(cls, batch_size: int, weights: dict[str, float]) -> DataAccess:
        total = sum(weights.values())
        if not weights or total <= 0 or any(w < 0 for w in weights.values()):
            raise ValueError(f"a mix needs non-negative source weights with a positive sum, got {weights}")
        return cls("mix", batch_size, sources=tuple((k, w / total) for k, w in weights.items()))

    @property
    def on_policy_fifo(self) -> bool:
        return self.kind == "onpolicy"

    @property
    def keeps_window(self) -> bool:
        """Whether replay's window stays valid across a resume: sampled data does, on-policy batches do not (they
        belong to the policy lineage that produced them)."""
        return self.kind != "onpolicy"

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sources)


@dataclass(frozen=True)
class Roles:
    """``rollout``: "policy" when workers collect with the policy, "none" for offline algorithms (a rollout worker
    is then placed only to evaluate, when evaluation is asked for). ``reference``: the learner keeps a frozen copy
    of the initial policy. ``expert``: the learner loads a frozen expert policy from the config's
    ``expert_checkpoint``."""

    rollout: Literal["policy", "none"] = "policy"
    reference: bool = False
    expert: bool = False


class Algorithm:
    """Base class of an algorithm spec (see the module docstring)."""

    name: ClassVar[str]
    Config: ClassVar[type[AlgorithmConfig]]
    policy: ClassVar[str] = "actor_critic"
    roles: ClassVar[Roles] = Roles()
    default: ClassVar[bool] = False  # the algorithm a run spec without an algorithm section gets
    # runs on N learner ranks (runtime.learner_ranks): its update takes each rank's share of every minibatch with
    # ``shard`` and scales that share's loss by the whole minibatch's denominator, so the summed gradients are
    # exactly one rank's
    data_parallel: ClassVar[bool] = False

    # -- declarations (every service) -------------------------------------------------------------------------
    @classmethod
    def trajectory(cls, cfg: Any) -> Trajectory:
        raise NotImplementedError(f"{cls.__name__} collects data but declares no trajectory()")

    @classmethod
    def data(cls, cfg: Any) -> DataAccess:
        return DataAccess.on_policy()

    @classmethod
    def needs(cls, cfg: Any) -> Roles:
        """The roles a run with this config needs (default: the class's ``roles``; e.g. a reference policy only
        when a KL term is on)."""
        return cls.roles

    @classmethod
    def steps_per_env(cls, cfg: Any) -> int:
        """Env steps each env takes per iteration (0 when the algorithm collects nothing)."""
        return int(getattr(cfg, "n_steps", 0)) if cls.roles.rollout == "policy" else 0

    @classmethod
    def check(cls, run: Any) -> None:
        """Refuse (ValueError naming the field and the fix) a run spec this algorithm cannot run, beyond what its
        config model checks alone: the run config validates with it."""

    @classmethod
    def iterations(cls, run: Any) -> int:
        """Iterations (collect, train, publish) of a run: its env-step budget over the env steps of one."""
        per = cls.steps_per_env(run.algorithm) * run.env.num_envs
        if per <= 0:
            raise NotImplementedError(f"{cls.__name__} collects nothing: it must define iterations()")
        return math.ceil(run.train.total_env_steps / per)

    # -- the learner's instance -------------------------------------------------------------------------------
    def __init__(self, policy: torch.nn.Module, run: Any, generator: torch.Generator | None = None,
                 env_spec: dict | None = None, reference: torch.nn.Module | None = None,
                 expert: torch.nn.Module | None = None):
        self.policy, self.run, self.generator = policy, run, generator
        self.env_spec = env_spec or {}
        self.cfg = run.algorithm
        self.reference, self.expert = reference, expert
        self.env_steps = 0
        self.optimizer_steps = 0
        self.rank, self.world = 0, 1  # set by the learner's rank group
        # the learner's weight version this update starts from (the learner sets it before each update, on rank 0):
        # a sample's version lag is this minus its trajectory field weight_version
        self.weight_version = 0

    def step_minibatches(self, batch: dict) -> dict[str, float]:
        """``self.step(minibatch)`` on each minibatch of a sampled [U, B, ...] batch in turn (one gradient step
        each, the off-policy and offline algorithms' update); the last step's stats."""
        from rlfabric.services.core.batch import tree_map

        stats: dict[str, float] = {}
        for u in range(batch["rewards"].shape[0]):
            stats = self.step(tree_map(lambda x, u=u: x[u], batch))
        return stats

    def shard(self, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This rank's rows of a minibatch's indices (all of them on one rank), and the weight of its loss share:
        1, or 0 for a rank left without rows, which runs its passes on the first row (every rank runs the same
        forward and backward passes: they are collectives)."""
        if self.world == 1:
            return idx, 1.0
        mine = idx[self.rank::self.world]
        return (mine, 1.0) if len(mine) else (idx[:1], 0.0)

    def updates_for(self, env_steps: int) -> int:
        """Sampled data access: minibatches to draw this iteration after ``env_steps`` more were collected."""
        raise NotImplementedError(f"{type(self).__name__} samples replay but does not say how many minibatches")

    def update(self, batch: TensorBatch) -> dict[str, float]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the update: by default its ``optimizer`` and the step counters."""
        return {"optimizer": self.optimizer.state_dict(), "env_steps": self.env_steps,
                "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.env_steps = int(state.get("env_steps", 0))
        self.optimizer_steps = int(state["optimizer_steps"])


class OfflineConfig(AlgorithmConfig):
    """What every offline algorithm's config has: it learns from a named replay source (a data set loaded with
    ``replay.datasets``), ``updates_per_iteration`` minibatches of ``batch_size`` per iteration, ``total_updates``
    in all."""

    batch_size: int = Field(256, ge=1, le=1 << 16, description="minibatch size sampled from the data set")
    updates_per_iteration: int = Field(100, ge=1, le=100_000, description="gradient steps per iteration (one "
                                                                          "metrics row, one weight version)")
    total_updates: int = Field(10_000, ge=1, le=100_000_000, description="gradient steps of the whole run")
    source: str = Field("offline", min_length=1, max_length=64,
                        description="the replay source to learn from: a name in replay.datasets")


class OfflineAlgorithm(Algorithm):
    """Base of algorithms that learn from a stored data set with no rollout collecting: each iteration samples its
    minibatches uniformly from the config's source."""

    roles: ClassVar[Roles] = Roles(rollout="none")

    @classmethod
    def data(cls, cfg: Any) -> DataAccess:
        return DataAccess.uniform(cfg.batch_size, cfg.source)

    @classmethod
    def check(cls, run: Any) -> None:
        if run.algorithm.source not in run.replay.datasets:
            raise ValueError(f"algorithm.source={run.algorithm.source!r} names no data set. Fix: add replay.datasets: "
                             f"{{{run.algorithm.source}: PATH.npz}} (rlfabric collect writes one)")

    @classmethod
    def iterations(cls, run: Any) -> int:
        return math.ceil(run.algorithm.total_updates / run.algorithm.updates_per_iteration)

    def updates_for(self, env_steps: int) -> int:
        return min(self.cfg.updates_per_iteration, self.cfg.total_updates - self.optimizer_steps)


# -- the registry ----------------------------------------------------------------------------------------------
ALGORITHMS: dict[str, type[Algorithm]] = {}
_loaded = False
_lock = threading.RLock()


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator of an algorithm file: the spec joins the registry under its config's ``name``."""
    name = cls.Config.model_fields["name"].default
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__}.Config needs name: Literal['<name>'] = '<name>'")
    if name in ALGORITHMS and ALGORITHMS[name] is not cls:
        raise ValueError(f"algorithm {name!r} is registered twice ({ALGORITHMS[name].__module__} and {cls.__module__})")
    cls.name = name
    ALGORITHMS[name] = cls
    return cls


def load_algorithms() -> dict[str, type[Algorithm]]:
    """Import every module the ``rlfabric.algorithms`` entry points name (a package: each of its modules), once.
    That is how the config schema learns the algorithms without naming any."""
    global _loaded
    with _lock:
        if _loaded:
            return ALGORITHMS
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            module = _import_spec_module(ep.value)
            for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
                _import_spec_module(f"{module.__name__}.{info.name}")
        _loaded = True
        if not ALGORITHMS:
            raise RuntimeError(f"no algorithm is registered: nothing declares the {ENTRY_POINT_GROUP!r} entry point. "
                               f"Fix: install rlfabric (pip install -e .) so its entry points exist")
        return ALGORITHMS


def _import_spec_module(name: str) -> Any:
    """Import a module of specs, and say so when it imports torch: every process reads the specs, so one eager
    ``import torch`` in a plug-in costs each coordinator, replay, env and robot gateway about 0.9 s and 180 MB."""
    had_torch = "torch" in sys.modules
    module = importlib.import_module(name)
    if not had_torch and "torch" in sys.modules:
        log.warning("algorithm module %s imports torch when imported, so every service that reads run specs loads "
                    "it. Fix: bind it on first use, torch = rlfabric.services.core.lazy.lazy_import('torch') (the same for "
                    "modules that import torch)", name)
    return module


def algorithm(name: str) -> type[Algorithm]:
    specs = load_algorithms()
    if name not in specs:
        raise ValueError(f"algorithm.name {name!r} is not registered; available: {sorted(specs)}")
    return specs[name]


__all__ = ["ALGORITHMS", "INTERVENTIONS", "Algorithm", "AlgorithmConfig", "DataAccess", "OfflineAlgorithm", "OfflineConfig", "Roles",
           "Trajectory", "algorithm", "load_algorithms", "register"]
