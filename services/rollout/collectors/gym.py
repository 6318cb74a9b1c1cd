"""GymCollector: acting in vector envs, over an env channel (the env service's data plane, or the same protocol
in-process), recording what the algorithm's spec asks for.

Collecting pipelines env chunks: actions for chunk c are sent to the env service, and while it simulates them the
policy acts on the next chunk's fresh observations. With one chunk this is the plain act/step loop. A shard is a
("time", "env") batch; observations keep their dtype (uint8 images stay uint8; floating ones are stored as
float32); Dict observations are recorded per key (obs/<key>).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfabric.services.core.algorithm import INTERVENTIONS, Trajectory
from rlfabric.services.core.batch import TensorBatch, tree_map

log = logging.getLogger(__name__)
OFFERS = ("obs", "actions", "logp", "values", "rewards", "dones", "terminated", "truncated", "next_obs",
          "last_values", "step_rewards", "step_dones", "step_valid", "intervened", "executed_actions", "weight_version")
STEP_FIELDS = ("step_rewards", "step_dones", "step_valid")  # per primitive step of an action chunk [T, N, H]
TELEOP_FIELDS = ("intervened", "executed_actions")  # envs with a human in the loop (a robot gateway under teleop)
NEEDS_VALUE = ("values", "last_values")


class Stopped(Exception):
    """A job was stopped before it finished; its partial data was discarded."""


@dataclass
class Collected:
    """One shard: the batch to store and what the coordinator hears about it."""

    batch: TensorBatch
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    env_seconds: float = 0.0
    policy_seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)  # counts summed over shards (see EpisodeTally)


@dataclass
class Evaluation:
    """Evaluation episodes: their returns and, where the env reports ``is_success``, whether each succeeded (1/0,
    in the same order; empty when the env does not say)."""

    returns: list[float]
    successes: list[float] = field(default_factory=list)
    deterministic: bool | None = None  # the policy's mode (True) or sampled actions (False); None: not said


class EpisodeTally:
    """Per-episode facts the env reports beside returns, counted as episodes finish: successes (where the env says
    ``is_success``), human interventions (envs under teleop), and successes no human helped with."""

    def __init__(self, num_envs: int):
        self.helped = np.zeros(num_envs, bool)  # a human intervened in the env's running episode

    def step(self, stats: dict[str, float], sl: slice, step: dict[str, Any], done: np.ndarray) -> None:
        if "intervened" in step:
            intervened = np.asarray(step["intervened"]) > 0
            self.helped[sl] |= intervened
            stats["intervened_steps"] = stats.get("intervened_steps", 0.0) + float(intervened.sum())
        if not done.any():
            return
        ended = np.flatnonzero(done)
        helped = self.helped[sl][ended]
        if "intervened" in step:
            stats["episodes_intervened"] = stats.get("episodes_intervened", 0.0) + float(helped.sum())
        if "episode_success" in step:
            success = np.asarray(step["episode_success"])[ended]
            said = success >= 0
            stats["episodes_judged"] = stats.get("episodes_judged", 0.0) + float(said.sum())
            stats["episodes_succeeded"] = stats.get("episodes_succeeded", 0.0) + float((success > 0).sum())
            stats["successes_without_intervention"] = stats.get("successes_without_intervention", 0.0) + float(
                ((success > 0) & ~helped).sum())
        self.helped[sl.start + ended] = False


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """What a recorded observation is stored as: floats as float32 (the policy computes in it), the rest as is."""
    return np.dtype(np.float32) if np.dtype(dtype).kind == "f" else np.dtype(dtype)


def _buffer(like: Any, T: int, N: int) -> Any:
    return tree_map(lambda x: np.zeros((T, N, *x.shape[1:]), dtype=storage_dtype(x.dtype)), like)


def _write(buf: Any, t: int, sl: slice, value: Any) -> None:
    if isinstance(buf, dict):
        for k, b in buf.items():
            _write(b, t, sl, value[k])
    else:
        buf[t, sl] = value


def _rows(value: Any, idx: Any) -> Any:
    return tree_map(lambda x: x[idx], value)


def _copy(value: Any) -> Any:
    return tree_map(lambda x: np.array(x), value)


class GymCollector:
    def __init__(self, config: Any, backend: Any, env: Any, shard_envs: int, chunks: int, pool: str,
                 env_offset: int = 0):
        self.config, self.backend, self.env = config, backend, env
        self.trajectory: Trajectory = config.spec.trajectory(config.algorithm) if config.collects else Trajectory(())
        wanted = set(self.trajectory.fields)
        unknown = sorted(wanted - set(OFFERS))
        if unknown:
            raise ValueError(f"algorithm {config.algorithm.name!r} asks for trajectory fields {unknown} the gym "
                             f"collector does not record; it offers {list(OFFERS)}")
        if (wanted & set(NEEDS_VALUE) or self.trajectory.bootstrap_truncated is not None) and not backend.has_value:
            raise ValueError(f"algorithm {config.algorithm.name!r} needs state values, but its policy "
                             f"{config.policy_name!r} has no value head")
        if self.trajectory.expert_acts > 0 and wanted & {"actions", "logp", "executed_actions"}:
            raise ValueError(f"algorithm {config.algorithm.name!r} has an expert act in some steps and records "
                             f"{sorted(wanted & {'actions', 'logp', 'executed_actions'})}: the records would be the "
                             f"policy's where the expert acted. Fix: record states only (the expert labels them)")
        self.N, self.C = shard_envs, chunks
        self.S = shard_envs // chunks
        self.pool = pool
        self.env_offset = env_offset
        self.obs: Any = None
        self.tally = EpisodeTally(shard_envs)
        G = self.trajectory.episode_groups
        if G and (shard_envs % G or env_offset % G):
            raise ValueError(f"algorithm {config.algorithm.name!r} compares episodes in groups of {G} envs, but this "
                             f"worker holds envs {env_offset}..{env_offset + shard_envs - 1}. Fix: make env.num_envs "
                             f"per rollout worker a multiple of {G}")

    # -- env channel ---------------------------------------------------------------------------------------
    def reset(self, seed: int) -> None:
        self.obs = _copy(self._reset(self.pool, seed, self.N))

    def _reset(self, pool: str, seed: int, num_envs: int | None = None, group: int = 1) -> Any:
        meta = {"pool": pool, "seed": seed, "group": group} | (
            {"num_envs": num_envs, "chunks": self.C} if num_envs else {})
        _, reply = self.env.request("reset", TensorBatch(meta=meta))
        return reply["obs"]

    # -- collection ----------------------------------------------------------------------------------------
    def collect(self, batch_index: int, version: int, stop: threading.Event | None) -> Collected:
        """One shard of T steps on this worker's N envs, with the weight version the backend holds."""
        cfg, traj = self.config, self.trajectory
        T, N, C, S = cfg.algorithm.n_steps, self.N, self.C, self.S
        if G := traj.episode_groups:  # fresh episodes, one start per group of G envs (seeds unique per batch)
            seed = cfg.seed + 1_000_003 * (batch_index + 1) + self.env_offset // G
            self.obs = _copy(self._reset(self.pool, seed, N, group=G))
            self.tally = EpisodeTally(N)
        want = set(traj.fields)
        obs_buf = _buffer(self.obs, T, N)
        act_buf: np.ndarray | None = None  # shaped by the policy's first raw actions and log-probs (an action
        logp_buf: np.ndarray | None = None  # chunk, a denoising chain, per-token log-probs ...)
        val_buf = np.zeros((T, N), dtype=np.float32)
        rew_buf = np.zeros((T, N), dtype=np.float32)
        done_buf = np.zeros((T, N), dtype=np.float32)
        term_buf = np.zeros((T, N), dtype=np.float32)
        trunc_buf = np.zeros((T, N), dtype=np.float32)
        next_buf = _buffer(self.obs, T, N) if "next_obs" in want else None
        step_bufs: dict[str, np.ndarray] = {}
        out = Collected(TensorBatch())
        explore = batch_index * cfg.batch_env_steps() < traj.random_until_env_steps
        beta = 0.0 if explore else traj.expert_share(batch_index)
        if beta > 0:  # the coin of each env step: the same draws for a batch whoever collects it
            coin = np.random.default_rng([cfg.seed, batch_index, self.env_offset]).random((T, N)) < beta
        gamma = traj.bootstrap_truncated

        def act(c: int, t: int) -> int:
            sl = slice(c * S, (c + 1) * S)
            p0 = time.perf_counter()
            obs = _rows(self.obs, sl)
            if explore:
                raw, env_actions = self.backend.random_actions(S)
                logp, values = np.zeros(S, np.float32), np.zeros(S, np.float32)
            else:
                raw, env_actions, logp, values = self.backend.act(obs)
                if beta > 0 and coin[t, sl].any():  # the expert acts in these envs (recorded: the policy's raw)
                    mine = coin[t, sl]
                    env_actions = np.array(env_actions)
                    env_actions[mine] = self.backend.expert_actions(_rows(obs, mine))
                    out.stats["expert_steps"] = out.stats.get("expert_steps", 0.0) + float(mine.sum())
            out.policy_seconds += time.perf_counter() - p0
            nonlocal act_buf, logp_buf
            if act_buf is None:
                act_buf = np.zeros((T, N, *raw.shape[1:]), dtype=np.int64 if raw.dtype.kind in "iu" else np.float32)
                logp_buf = np.zeros((T, N, *np.shape(logp)[1:]), dtype=np.float32)
            _write(obs_buf, t, sl, obs)
            act_buf[t, sl], logp_buf[t, sl], val_buf[t, sl] = raw, logp, values
            return self.env.send("step", TensorBatch({"actions": env_actions}, meta={"pool": self.pool, "chunk": c}))

        pending = [act(c, 0) for c in range(C)]
        for t in range(T):
            for c in range(C):
                if stop is not None and stop.is_set():
                    log.warning("discarding in-flight batch %d at step %d/%d on stop", batch_index, t, T)
                    raise Stopped(f"batch {batch_index} discarded at step {t}/{T}")
                e0 = time.perf_counter()
                _, step = self.env.recv(pending[c])
                out.env_seconds += time.perf_counter() - e0
                sl = slice(c * S, (c + 1) * S)
                reward = np.array(step["reward"], dtype=np.float32)
                terminated, truncated = np.asarray(step["terminated"]), np.asarray(step["truncated"])
                done = np.logical_or(terminated, truncated)
                if next_buf is not None:  # where each step led: the reset observation is not where it led
                    nxt = _copy(step["obs"])
                    if done.any():
                        _patch(nxt, step["final_obs"], done)
                    _write(next_buf, t, sl, nxt)
                if gamma is not None:
                    bootstrap = np.logical_and(truncated, np.logical_not(terminated))
                    if bootstrap.any():  # a time limit is not a failure: add the value of where the episode stopped
                        idx = np.flatnonzero(bootstrap)
                        reward[idx] += gamma * self.backend.value(_rows(step["final_obs"], idx))
                rew_buf[t, sl], done_buf[t, sl] = reward, done
                for key in want.intersection(STEP_FIELDS + TELEOP_FIELDS):
                    if key not in step:
                        raise ValueError(f"algorithm {cfg.algorithm.name!r} asks for {key!r}, which only envs that "
                                         + ("step action chunks report. Fix: set env.action_chunk > 1"
                                            if key in STEP_FIELDS else "a human can take over report. Fix: use "
                                                                       "env.adapter: robot with a teleop client"))
                    if key not in step_bufs:
                        step_bufs[key] = np.zeros((T, N, *np.shape(step[key])[1:]), np.float32)
                    step_bufs[key][t, sl] = step[key]
                term_buf[t, sl], trunc_buf[t, sl] = terminated, truncated
                self.tally.step(out.stats, sl, step, done)
                for i in np.flatnonzero(done):
                    out.returns.append(float(step["episode_return"][i]))
                    out.lengths.append(int(step["episode_length"][i]))
                _assign(self.obs, sl, step["obs"])
                if t + 1 < T:
                    pending[c] = act(c, t + 1)
        fields = {"obs": obs_buf, "actions": act_buf, "logp": logp_buf, "values": val_buf, "rewards": rew_buf,
                  "dones": done_buf, "terminated": term_buf, "truncated": trunc_buf, "next_obs": next_buf}
        if "weight_version" in want:  # per step: the weight version that acted (shards joined keep each their own)
            fields["weight_version"] = np.full((T, N), version, dtype=np.int64)
        tensors = {k: v for k, v in (fields | step_bufs).items() if k in want}
        field_dims = {}
        if "last_values" in want:
            tensors["last_values"] = self.backend.value(self.obs).astype(np.float32)
            field_dims["last_values"] = ("env",)
        out.batch = TensorBatch(tensors, version=version, dims=("time", "env"), field_dims=field_dims)
        return out

    # -- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self, episodes: int, deterministic: bool, seed: int,
                 stop: threading.Event | None = None) -> Evaluation:
        """``episodes`` episodes on the eval pool, spread evenly over its envs (no short-episode bias)."""
        evaluation, _ = play(self.env, self.backend, self.config.env.eval_envs, episodes, seed, deterministic,
                             stop=stop)
        return evaluation

    def probe(self, round_trips: int, stop: threading.Event | None = None) -> tuple[float, int]:
        """Median round trip of a message as large as one chunk's step (its observations) to the env and back."""
        return probe_echo(self.env, TensorBatch({"obs": _copy(_rows(self.obs, slice(0, self.S)))}), round_trips,
                          stop)


def intervened_transitions(batch: TensorBatch) -> TensorBatch | None:
    """The steps of a ("time", "env") shard that a human commanded, as ("sample",) rows for the interventions
    source: the observation and the action the human executed (not the policy's, which was overridden)."""
    if "intervened" not in batch or "executed_actions" not in batch:
        return None
    rows = np.asarray(batch["intervened"]).reshape(-1) > 0
    if not rows.any():
        return None
    flat = batch.flatten()
    out = TensorBatch({"obs": tree_map(lambda x: x[rows], flat["obs"]), "actions": flat["executed_actions"][rows]},
                      version=batch.version, dims=("sample",))
    out.meta = {"source": INTERVENTIONS}
    return out


def probe_echo(env: Any, payload: TensorBatch, round_trips: int,
               stop: threading.Event | None = None) -> tuple[float, int]:
    """(median seconds, bytes) of ``payload`` sent to the env channel and echoed back: the scheduler's IPC probe."""
    times = []
    for _ in range(max(1, round_trips)):
        if stop is not None and stop.is_set():
            raise Stopped("probe stopped: its caller went away")
        t0 = time.perf_counter()
        env.request("echo", payload)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), int(payload.nbytes)


def _assign(obs: Any, sl: slice, value: Any) -> None:
    """obs[sl] = value, per key for Dict observations."""
    if isinstance(obs, dict):
        for k in obs:
            _assign(obs[k], sl, value[k])
    else:
        obs[sl] = value


def _patch(nxt: Any, finals: Any, done: np.ndarray) -> None:
    """Where an episode ended, the step led to its final observation (the env already shows the reset one)."""
    if isinstance(nxt, dict):
        for k in nxt:
            _patch(nxt[k], finals[k], done)
    else:
        nxt[done] = np.asarray(finals)[done]


def play(env: Any, backend: Any, num_envs: int, episodes: int, seed: int, deterministic: bool = True,
         record: bool = False, random: bool = False,
         stop: threading.Event | None = None) -> tuple[Evaluation, TensorBatch | None]:
    """The one episode loop of evaluation and data-set collection: ``episodes`` episodes on the "eval" pool of
    an env channel, spread evenly over its ``num_envs`` envs (each plays its quota, then its steps are ignored),
    acting with the backend (or uniformly at random). With ``record``, the transitions of the counted episodes
    come back as a ("sample",) batch: obs, actions (as the policy emits them), rewards, next_obs, terminated,
    truncated, episode (index of the episode in the returned list)."""
    quota = np.full(num_envs, episodes // num_envs) + (np.arange(num_envs) < episodes % num_envs)
    got: list[list[float]] = [[] for _ in range(num_envs)]
    won: list[list[float]] = [[] for _ in range(num_envs)]  # is_success of each counted episode (-1: not said)
    _, reply = env.request("reset", TensorBatch(meta={"pool": "eval", "seed": seed}))
    obs = _copy(reply["obs"])
    steps: list[dict[str, Any]] = []
    open_ids = np.arange(num_envs)  # each env's running episode number (across envs: filled in at the end)
    while any(len(g) < q for g, q in zip(got, quota, strict=True)):
        if stop is not None and stop.is_set():  # the caller went away (a cancelled Evaluate): stop burning CPU
            raise Stopped(f"stopped after {sum(map(len, got))} of {episodes} episodes: the caller went away")
        if random:
            raw, env_actions = backend.random_actions(num_envs)
        else:
            raw, env_actions, _, _ = backend.act(obs, deterministic)
        _, out = env.request("step", TensorBatch({"actions": env_actions}, meta={"pool": "eval", "chunk": 0}))
        done = np.logical_or(out["terminated"], out["truncated"])
        counting = np.array([len(g) < q for g, q in zip(got, quota, strict=True)])
        if record:
            nxt = _copy(out["obs"])
            if done.any():
                _patch(nxt, out["final_obs"], done)
            steps.append({"obs": obs, "actions": raw, "rewards": np.asarray(out["reward"], np.float32),
                          "next_obs": nxt, "terminated": np.asarray(out["terminated"], np.float32),
                          "truncated": np.asarray(out["truncated"], np.float32), "env": open_ids.copy(),
                          "counting": counting})
        for i in np.flatnonzero(done):
            if len(got[i]) < quota[i]:
                got[i].append(float(out["episode_return"][i]))
                won[i].append(float(out["episode_success"][i]) if "episode_success" in out else -1.0)
            open_ids[i] += num_envs
        obs = _copy(out["obs"])
    returns = [r for g in got for r in g]
    successes = [s for w in won for s in w]
    evaluation = Evaluation(returns, successes if successes and min(successes) >= 0 else [])
    if not record:
        return evaluation, None
    return evaluation, _transitions(steps)


def _transitions(steps: list[dict[str, Any]]) -> TensorBatch:
    """Per-step records of all envs -> the rows of counted episodes, episode by episode."""
    keep = np.concatenate([s["counting"] for s in steps])
    episode = np.concatenate([s["env"] for s in steps])[keep]

    def stack(key: str) -> Any:
        first = steps[0][key]
        if isinstance(first, dict):
            return {k: np.concatenate([s[key][k] for s in steps])[keep] for k in first}
        return np.concatenate([np.asarray(s[key]) for s in steps])[keep]

    tensors = {k: stack(k) for k in ("obs", "actions", "rewards", "next_obs", "terminated", "truncated")}
    order = np.argsort(episode, kind="stable")  # episode by episode, steps in order
    _, episode = np.unique(episode, return_inverse=True)
    tensors = tree_map(lambda x: x[order], tensors)
    tensors["episode"] = episode[order].astype(np.int64)
    return TensorBatch(tensors, version=0, dims=("sample",))
