"""EnvPool: the simulators of one run, split into chunks that are stepped one at a time.

Chunks let the rollout pipeline: while the policy acts on chunk A, the env service steps chunk B. Every step
validates the actions it receives, tracks episode return/length, and reports finished episodes.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import numpy as np

from rlfabric.services.core.batch import Ragged, cat_ragged
from rlfabric.services.core.dataplane import meta_int
from rlfabric.services.env.adapters import adapter
from rlfabric.services.env.adapters.gymnasium import describe_space, final_observations
from rlfabric.services.env.chunking import info_rows, step_fields

log = logging.getLogger(__name__)
MAX_SHARDS = 1024  # (scheduling.rollout_workers' bound): pools are named by worker index, so they are bounded too


def concat_obs(parts: list[Any]) -> Any:
    """Observations of several chunks as one batch (per key for Dict observations)."""
    if isinstance(parts[0], dict):
        return {k: concat_obs([p[k] for p in parts]) for k in parts[0]}
    if isinstance(parts[0], Ragged):
        return cat_ragged(parts, 0)
    return np.concatenate(parts)


FILE_KWARG = re.compile(r"(^|_)(file|path|dir|xml|urdf|mjcf)$")  # xml_file, model_path, asset_dir, ...
FILE_SUFFIXES = (".xml", ".urdf", ".mjcf", ".obj", ".stl", ".png", ".json", ".yaml", ".npz")


def check_kwarg_files(env_cfg: Any) -> None:
    """Every ``env.kwargs`` value that names a file (by its key, e.g. MuJoCo's ``xml_file``, or its suffix) must
    resolve under this process's data roots: the simulator reads it, so a spec may not point it outside them
    (PathRefused names the field, the roots and the flag)."""
    from rlfabric.services.env.tasks.dataset import data_roots

    for key, value in dict(getattr(env_cfg, "kwargs", {}) or {}).items():
        if isinstance(value, str) and (FILE_KWARG.search(key.lower()) or value.lower().endswith(FILE_SUFFIXES)):
            data_roots().confine(value, f"env.kwargs.{key}")


class EnvPool:
    def __init__(self, env_cfg: Any, num_envs: int, chunks: int = 1, vectorization: str = "sync"):
        if num_envs % chunks:
            raise ValueError(f"num_envs={num_envs} is not divisible into {chunks} chunks")
        self.env_id = env_cfg.id
        self.num_envs = num_envs
        self.chunk_size = num_envs // chunks
        make = adapter(env_cfg.adapter).make_vector_env
        check_kwarg_files(env_cfg)
        self.envs = [make(env_cfg, self.chunk_size, vectorization) for _ in range(chunks)]
        self.single_observation_space = self.envs[0].single_observation_space
        self.single_action_space = self.envs[0].single_action_space
        self.obs_spec = describe_space(self.single_observation_space)
        self.act_spec = describe_space(self.single_action_space)
        self.action_chunk = env_cfg.action_chunk
        if self.action_chunk > 1 and tuple(self.single_action_space.shape[:1]) != (self.action_chunk,):
            raise ValueError(f"env.adapter {env_cfg.adapter!r} does not step action chunks (its action space is "
                             f"{self.single_action_space}). Fix: env.action_chunk: 1, or use the gymnasium adapter")
        self.text_obs = self.obs_spec["kind"] == "text"
        self._returns = [np.zeros(self.chunk_size) for _ in self.envs]
        self._lengths = [np.zeros(self.chunk_size, dtype=np.int64) for _ in self.envs]
        self.env_steps = 0
        self.step_seconds = 0.0
        self.finished_returns: list[float] = []
        self.finished_lengths: list[int] = []

    @property
    def num_chunks(self) -> int:
        return len(self.envs)

    def reset(self, seed: int, group: int = 1) -> list[Any]:
        """Env j of the pool starts from seed + j // group: with group G, consecutive groups of G envs share an
        initial state (group-relative algorithms compare episodes from the same start)."""
        out = []
        for c, env in enumerate(self.envs):
            first = c * self.chunk_size
            seeds = seed + first if group == 1 else [seed + (first + i) // group for i in range(self.chunk_size)]
            obs, _ = env.reset(seed=seeds)
            self._returns[c][:] = 0
            self._lengths[c][:] = 0
            out.append(Ragged.from_texts(obs) if self.text_obs else obs)
        return out

    def check_actions(self, chunk: int, actions: Any) -> Any:
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk {chunk} out of range: the pool has {self.num_chunks} chunk(s)")
        space = self.single_action_space
        if self.act_spec["kind"] == "text":
            return self._text_actions(chunk, actions)
        if not isinstance(actions, np.ndarray):
            raise ValueError(f"{self.env_id} takes dense 'actions' (an array), got {type(actions).__name__}")
        expected = (self.chunk_size, *space.shape)
        if tuple(actions.shape) != expected:
            raise ValueError(
                f"actions for chunk {chunk} have shape {tuple(actions.shape)} but {self.env_id}'s action space "
                f"{space} over {self.chunk_size} envs expects {expected}; fix the policy's action head")
        if self.act_spec["kind"] == "discrete":
            if actions.dtype.kind not in "iu":
                raise ValueError(f"discrete actions must be integers, got dtype {actions.dtype}")
            lo, n = self.act_spec["start"], self.act_spec["n"]
            if actions.min() < lo or actions.max() >= lo + n:
                raise ValueError(f"discrete actions must lie in [{lo}, {lo + n}), got {actions.min()}..{actions.max()}")
            return actions.astype(np.int64, copy=False)
        if not np.isfinite(actions).all():
            raise ValueError("continuous actions contain NaN or inf; the policy diverged")
        return actions.astype(space.dtype, copy=False)

    def _text_actions(self, chunk: int, actions: Any) -> tuple[str, ...]:
        if not isinstance(actions, Ragged) or actions.shape != (self.chunk_size,):
            raise ValueError(f"{self.env_id} takes text actions: a Ragged uint8 'actions' field of {self.chunk_size} "
                             f"cells (one UTF-8 string per env of chunk {chunk})")
        limit = self.act_spec["max_length"]
        longest = int(actions.flat_lengths().max()) if self.chunk_size else 0
        if longest > limit:
            raise ValueError(f"a text action of {longest} bytes exceeds env.options.max_chars={limit}")
        return tuple(actions.texts("actions"))

    def step(self, chunk: int, actions: Any) -> dict[str, Any]:
        actions = self.check_actions(chunk, actions)
        t0 = time.perf_counter()
        obs, reward, terminated, truncated, info = self.envs[chunk].step(actions)
        self.step_seconds += time.perf_counter() - t0
        done = np.logical_or(terminated, truncated)
        steps = step_fields(info, done, self.action_chunk) if self.action_chunk > 1 else None
        ret, length = self._returns[chunk], self._lengths[chunk]
        ret += reward
        length += 1 if steps is None else steps["executed"]
        ep_return = np.where(done, ret, 0.0)
        ep_length = np.where(done, length, 0)
        for i in np.flatnonzero(done) if done.any() else ():
            self.finished_returns.append(float(ret[i]))
            self.finished_lengths.append(int(length[i]))
        ret[done] = 0.0
        length[done] = 0
        self.env_steps += self.chunk_size if steps is None else int(steps["executed"].sum())
        out = {"obs": Ragged.from_texts(obs) if self.text_obs else obs, "reward": np.asarray(reward, dtype=np.float32),
               "terminated": terminated, "truncated": truncated}
        if steps is not None:  # per primitive step of each action chunk: rewards, episode ends, what ran
            out.update(steps)
        # a robot under teleop: which envs a human commanded this step, and the action that was executed
        intervened, have = info_rows(info, done, "intervened")
        if have.any():
            out["intervened"] = intervened
            out["executed_actions"] = info_rows(info, done, "executed_action", self.single_action_space.shape)[0]
        # a text env whose reward raised, timed out or killed its worker this step (only sent when one did)
        failed, _ = info_rows(info, done, "reward_failed")
        if failed.any():
            out["reward_failed"] = failed
        if done.any():  # most steps end no episode: keep those messages small
            if not self.text_obs:  # a text episode's last observation is what the model already read
                out["final_obs"] = final_observations(obs, info, done)
            out["episode_return"] = ep_return.astype(np.float32)
            success, have = info_rows(info, done, "is_success")
            if have.any():  # 1/0 where a finished episode said whether it succeeded, -1 where it did not say
                out["episode_success"] = np.where(have & done, success, -1.0).astype(np.float32)
            out["episode_length"] = ep_length.astype(np.int64)
        return out

    def close(self) -> None:
        for env in self.envs:
            env.close()


class EnvPools:
    """The pools of one run and the request protocol both the env service's data plane and an in-process
    channel speak. "eval" plays one episode per env; training pools are shards named "train/<worker>", one per
    rollout worker, created by the first reset that names their size (a run re-sharded when it scales gets new
    ones); "train" is the whole env batch of a single-worker run."""

    def __init__(self, config, build_train: bool = True) -> None:
        self.config = config
        env = config.env
        eval_env = env.model_copy(update={"options": env.options | env.eval_options}) if env.eval_options else env
        self.pools: dict[str, EnvPool] = {"eval": EnvPool(eval_env, env.eval_envs, 1, "sync")}
        if build_train:
            self.pools["train"] = self._train_pool(env.num_envs)

    def _train_pool(self, num_envs: int, chunks: int | None = None) -> EnvPool:
        env = self.config.env
        return EnvPool(env, num_envs, chunks or self.config.scheduling.chunks(), env.vectorization)

    def __getitem__(self, name: str) -> EnvPool:
        return self.pools[name]

    def get(self, name: str) -> EnvPool | None:
        return self.pools.get(name)

    def values(self):
        return self.pools.values()

    def train_pools(self) -> list[EnvPool]:
        return [p for name, p in self.pools.items() if name.split("/")[0] == "train"]

    def _shard(self, name: str, meta: dict) -> EnvPool | None:
        """A training shard sized by the reset that names it (``num_envs``, ``chunks``; default the whole env
        batch); rebuilt if they changed."""
        limit = self.config.env.num_envs
        n = meta_int(meta, "num_envs", limit, 1, limit)
        chunks = meta_int(meta, "chunks", self.config.scheduling.chunks(), 1, n)
        pool = self.pools.get(name)
        if pool is None or pool.num_envs != n or pool.num_chunks != chunks:
            if pool is not None:
                pool.close()
                del self.pools[name]
            # the shards partition env.num_envs: shards left by an earlier plan (rollout workers that left) give
            # way, oldest first, so the envs held never exceed the run's env batch whatever resets name
            held = sum(p.num_envs for k, p in self.pools.items() if k.startswith("train"))
            for old in [k for k in self.pools if k.startswith("train")]:
                if held + n <= limit:
                    break
                held -= self.pools[old].num_envs
                self.pools.pop(old).close()
                log.info("closed env shard %s: it left the plan (the shards hold at most %d envs)", old, limit)
            self.pools[name] = pool = self._train_pool(n, chunks)
        return pool

    def handle(self, kind: str, meta: dict, tensors: dict) -> tuple[str, dict]:
        """reset {pool, seed, num_envs?, chunks?, group?} -> obs ; step {pool, chunk} actions -> obs, reward, terminated, ... ;
        echo tensors -> the same tensors"""
        if kind == "echo":  # the scheduler's IPC probe: the same bytes back, no simulation
            return "echo", dict(tensors)
        pool_name = meta.get("pool", "train")
        shards = min(MAX_SHARDS, self.config.env.num_envs)  # every rollout worker has at least one env
        if not isinstance(pool_name, str) or not (pool_name in ("eval", "train") or (
                pool_name.startswith("train/") and pool_name[6:].isdigit() and len(pool_name) <= 10
                and int(pool_name[6:]) < shards)):
            raise ValueError(f"meta.pool must be 'eval', 'train' or 'train/<worker index < {shards}>', got "
                             f"{str(pool_name)[:64]!r}")
        if kind == "reset" and pool_name.split("/")[0] == "train":
            pool = self._shard(pool_name, meta)
        else:
            pool = self.pools.get(pool_name)
        if pool is None:
            raise ValueError(f"no env pool {pool_name!r}: reset it first (pools: {sorted(self.pools)})")
        if kind == "reset":
            group = meta_int(meta, "group", 1, 1, pool.num_envs)
            return "obs", {"obs": concat_obs(pool.reset(meta_int(meta, "seed", 0, 0, 2**62), group))}
        if kind == "step":
            if "actions" not in tensors:
                raise ValueError("step needs an 'actions' tensor")
            return "stepped", pool.step(meta_int(meta, "chunk", 0, 0, 1 << 16), tensors["actions"])
        raise ValueError(f"unknown request kind {kind!r}; expected 'reset', 'step' or 'echo'")

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def add_host_arguments(parser) -> None:
    """The operator's flags of a worker that hosts env pools (the env service; a rollout worker in collocated
    plans): where a spec's files may be, which endpoints it may name, and the most its rewards may take."""
    from rlfabric.services.core.paths import add_arguments
    from rlfabric.services.env import reward_pool

    add_arguments(parser)
    reward_pool.add_arguments(parser)


def apply_host_arguments(args) -> None:
    """This process's env pools follow those flags: data-set files (and corpora) and env kwargs' files only under
    --data-root, connections (a robot gateway) only to --allow-endpoints, rewards within the operator's limits."""
    from rlfabric.services.core.paths import DataRoots, Endpoints, set_process_endpoints
    from rlfabric.services.env import reward_pool
    from rlfabric.services.env.tasks.dataset import set_data_roots

    set_data_roots(DataRoots.parse(args.data_root))
    set_process_endpoints(Endpoints.parse(args.allow_endpoints))  # (a robot env's gateway, for one)
    reward_pool.apply_arguments(args)
