"""Acting without services, in this process: ``rlfabric eval`` (a checkpoint's policy, on the run's own evaluation
seeds, so it reproduces the run's evaluation) and ``rlfabric collect`` (a data set of transitions from a checkpoint's
policy or from uniform random actions). Both go through the collector's episode loop and an in-process env channel:
the same code a rollout worker evaluates with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.config import RunConfig
from rlfabric.services.env.local import LocalEnvChannel
from rlfabric.services.rollout.backends import build_backend
from rlfabric.services.rollout.collectors import collector_class
from rlfabric.services.rollout.collectors.gym import Evaluation, play


def _from_checkpoint(path: str | Path, overrides: list[str] | None = None):
    """The run config and an acting backend of a checkpoint; ``overrides`` (KEY=VALUE, as train's --set) change
    the run config, e.g. the env's kwargs for a held-out variant of the task."""
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.learner.checkpoint import unpack

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint (runs leave one at runs/<id>/checkpoints/final.pt)")
    ckpt = unpack(path.read_bytes(), str(path))
    config = (parse_config(ckpt["config_json"], str(path), overrides) if overrides
              else RunConfig.from_json(ckpt["config_json"]))
    spec = json.loads(ckpt["env_spec_json"])
    backend = build_backend(config.rollout.backend, config, spec, "cpu")
    backend.load(int(ckpt.get("weight_version", 0)), ckpt["policy"])
    return config, backend


def _env_spec(config: RunConfig) -> dict:
    channel = LocalEnvChannel(config)
    try:
        pool = channel.pools["eval"]
        return {"env_id": pool.env_id, "observation_space": pool.obs_spec, "action_space": pool.act_spec}
    finally:
        channel.close()


def evaluate_checkpoint(path: str | Path, episodes: int, seed: int | None = None,
                        deterministic: bool | None = None, overrides: list[str] | None = None) -> Evaluation:
    """Returns (and successes, where the env says) of ``episodes`` episodes; by default on the run's own eval
    seeds and with its own ``train.eval_deterministic``, so it reproduces the run's eval. ``overrides`` change the
    run config first (e.g. a held-out variant of the env's kwargs)."""
    config, backend = _from_checkpoint(path, overrides)
    if deterministic is None:
        deterministic = config.train.eval_deterministic
    env = LocalEnvChannel(config)
    try:  # the run's own collector plays them: gym stepping, LLM turns, ...
        collector = collector_class(config)(config, backend, env, config.env.eval_envs, 1, "eval")
        evaluation = collector.evaluate(episodes, deterministic, config.eval_seed() if seed is None else seed)
        return dataclasses.replace(evaluation, deterministic=deterministic)
    finally:
        env.close()


class ScriptedExpert:
    """Acts as the env's own scripted expert: each eval sub-env's ``expert_action(horizon)`` (ArmReach has one),
    read from the simulator's privileged state, so it works only beside an in-process env channel. Its raw actions
    are the env actions: demonstrations to imitate, mapped by the imitation loss onto the policy's own action space."""

    def __init__(self, channel: LocalEnvChannel, config: RunConfig):
        pool = channel.pools["eval"]
        self.vector_env, self.shape = pool.envs[0], tuple(pool.act_spec["shape"])
        self.horizon = config.env.action_chunk
        try:
            self.vector_env.get_attr("expert_action")
        except AttributeError:
            raise ValueError(f"env {pool.env_id!r} has no scripted expert (an expert_action(horizon) method on the "
                             f"env). Fix: collect from a checkpoint's policy, or give the env one") from None

    def act(self, obs, deterministic: bool = True):
        moves = np.stack(self.vector_env.call("expert_action", self.horizon)).astype(np.float32)
        actions = moves.reshape(len(moves), *self.shape)
        return actions, actions, None, None


def collect_dataset(source: str | Path | RunConfig, episodes: int, seed: int = 0, random: bool = False,
                    deterministic: bool = False, expert: bool = False,
                    overrides: list[str] | None = None) -> tuple[TensorBatch, list[float]]:
    """Transitions of ``episodes`` episodes: with the policy of checkpoint ``source`` (stochastic unless
    ``deterministic``), or, with ``random``, uniform actions, or, with ``expert``, the env's scripted expert, in
    the env of run spec (or checkpoint, or validated RunConfig) ``source``, with ``overrides`` (KEY=VALUE) applied
    to a file's config."""
    if isinstance(source, RunConfig):  # already validated (a learner's warm_start.demos)
        if not (random or expert):
            raise ValueError("a run config has no policy to act with: pass random or expert")
        config = source
        backend = None if expert else build_backend(config.rollout.backend, config, _env_spec(config), "cpu")
    elif Path(source).suffix in (".yaml", ".yml"):
        source = Path(source)
        if not (random or expert):
            raise ValueError(f"{source} is a run spec: it has no policy to act with. Fix: pass a checkpoint, or "
                             f"--random for uniform actions, or --expert for the env's scripted expert")
        from rlfabric.services.core.config import load_config

        config = load_config(source, overrides)
        backend = None if expert else build_backend(config.rollout.backend, config, _env_spec(config), "cpu")
    else:
        config, backend = _from_checkpoint(Path(source), overrides)
    env = LocalEnvChannel(config)
    try:
        if expert:
            backend = ScriptedExpert(env, config)
        evaluation, batch = play(env, backend, config.env.eval_envs, episodes, seed, deterministic, record=True,
                                 random=random)
    finally:
        env.close()
    assert batch is not None
    return batch, evaluation.returns


def merge_datasets(parts: list[TensorBatch]) -> TensorBatch:
    """Data sets appended row-wise, each one's episode numbers after the previous ones'."""
    offset, shifted = 0, []
    for part in parts:
        part = TensorBatch(dict(part.tensors), version=0, dims=("sample",))
        if "episode" in part.tensors:
            part.tensors["episode"] = np.asarray(part.tensors["episode"]) + offset
            offset = int(part.tensors["episode"].max()) + 1 if part.rows else offset
        shifted.append(part)
    return TensorBatch.cat(shifted, "sample")
