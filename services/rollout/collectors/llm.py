"""LLMCollector: a language-model policy answering text tasks, single- or multi-turn, in groups.

Every iteration resets the shard's envs with a fresh seed and plays one episode per env: the env's observation
(the prompt, later a tool's reply) is appended to that env's context, the backend generates the model's turn, the
env scores it or answers with a tool's output, until the episode ends. A sample is the whole context: its tokens,
a loss mask (1 on tokens the model generated, 0 on prompt and tool-output tokens), the log-probs the engine
sampled them with (0 where masked), its reward, and its group (envs i // group_size answer the same prompt).

A context starts as the backend renders the prompt (``prompt_ids``: the checkpoint's bos, or its chat template
for a chat prompt). The env's step reply may carry ``reward_failed`` (1 where a sample's reward function raised,
hung or died); their count reaches metrics.csv as ``reward_failures``.

The shard is an ("env",) batch (one sample per env): tokens, loss_mask, logp (Ragged, one cell per sample), rewards, group, turns,
response_tokens (tokens the model generated), truncated (cut by the length limit or the turn limit) and kept.

Over-sampling (``rollout.finish_fraction`` < 1): a generation round streams samples out of the engine as they
finish and ends once that fraction of the shard's groups are complete; the long tail is aborted, and every sample
of its groups is marked ``kept = 0`` (the update drops them, the shard keeps its shape).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np

from rlfabric.services.core.batch import Ragged, TensorBatch
from rlfabric.services.rollout.collectors.gym import Collected, Evaluation, Stopped, probe_echo

OFFERS = ("tokens", "loss_mask", "logp", "rewards", "group", "turns", "response_tokens", "truncated", "kept")
SEED_STRIDE = 100_003  # iterations draw disjoint seed ranges (a prime: group seeds never line up)


class Episodes:
    """The running episodes of one pool: contexts, masks, log-probs and rewards, per env."""

    def __init__(self, prompts: list[str], backend: Any):
        self.backend = backend
        n = len(prompts)
        self.tokens = [list(backend.prompt_ids(p)) for p in prompts]  # the checkpoint's bos / chat template
        self.mask = [[0] * len(t) for t in self.tokens]
        self.logp = [[0.0] * len(t) for t in self.tokens]
        self.rewards = np.zeros(n, dtype=np.float32)
        self.turns = np.zeros(n, dtype=np.int64)
        self.truncated = np.zeros(n, dtype=np.float32)
        self.done = np.zeros(n, dtype=bool)
        self.kept = np.ones(n, dtype=np.float32)  # 0: its group was cut from an over-sampled round
        self.groups = np.arange(n)  # which prompt each sample answers (set by the collector)
        self.reward_failures = 0.0  # samples whose reward function raised, hung or died (the env's reward_failed)

    def add_context(self, i: int, text: str) -> None:
        ids = self.backend.encode(text)
        self.tokens[i] += ids
        self.mask[i] += [0] * len(ids)
        self.logp[i] += [0.0] * len(ids)


class LLMCollector:
    def __init__(self, config: Any, backend: Any, env: Any, shard_envs: int, chunks: int, pool: str,
                 env_offset: int = 0):
        self.config, self.backend, self.env = config, backend, env
        if not hasattr(backend, "generate"):
            raise ValueError(f"rollout.backend {config.rollout.backend!r} cannot generate text; use hf or vllm")
        self.trajectory = config.spec.trajectory(config.algorithm) if config.collects else None
        if self.trajectory is not None:
            unknown = sorted(set(self.trajectory.fields) - set(OFFERS))
            if unknown:
                raise ValueError(f"algorithm {config.algorithm.name!r} asks for trajectory fields {unknown} the llm "
                                 f"collector does not record; it offers {list(OFFERS)}")
        self.N, self.C, self.pool, self.env_offset = shard_envs, chunks, pool, env_offset
        self.S = shard_envs // chunks
        self.group_size = int(config.env.options.get("group_size", 1))
        self.max_new = config.rollout.max_new_tokens
        # the model's context (a checkpoint's own, see CausalLMPolicy.context); a plug-in backend without one: the spec's
        self.max_len = int(getattr(getattr(backend, "policy", None), "context", 0) or config.policy.lm.max_positions)
        self.seed = config.seed

    def reset(self, seed: int) -> None:
        self.seed = seed

    def _enough(self, ep: Episodes, active: np.ndarray) -> Any:
        """The early cut of one streamed round: enough once ``finish_fraction`` of the groups are complete (every
        sample done, none cut)."""
        _, groups = np.unique(ep.groups, return_inverse=True)
        need = math.ceil(self.config.rollout.finish_fraction * (int(groups.max()) + 1))

        def enough(finished: set[int]) -> bool:
            done = ep.done & (ep.kept > 0)
            done[active[list(finished)]] = True
            return int((np.bincount(groups, weights=~done) == 0).sum()) >= need

        return enough

    def _episodes(self, pool: str, num_envs: int | None, seed: int, sample: bool, chunks: int,
                  stop: threading.Event | None = None, cut: bool = False) -> tuple[Episodes, float, float]:
        meta = {"pool": pool, "seed": seed} | ({"num_envs": num_envs, "chunks": chunks} if num_envs else {})
        _, reply = self.env.request("reset", TensorBatch(meta=meta))
        ep = Episodes(reply["obs"].texts("obs"), self.backend)
        n = len(ep.tokens)
        ep.groups = (self.env_offset + np.arange(n)) // self.group_size
        size = n // chunks
        env_s = policy_s = 0.0
        while not ep.done.all():
            if stop is not None and stop.is_set():
                raise Stopped("episodes discarded on stop")
            # a context that cannot hold another turn ends here, cut (the env never sees its next turn)
            full = [i for i in np.flatnonzero(~ep.done) if len(ep.tokens[i]) + self.max_new > self.max_len]
            if full and not ep.turns[full].any():  # a prompt that leaves no room for its first turn: the spec's
                i = full[0]
                raise ValueError(f"a prompt of {len(ep.tokens[i])} tokens plus rollout.max_new_tokens={self.max_new} "
                                 f"exceeds the model's context of {self.max_len} tokens, so no episode could "
                                 f"start. Fix: lower rollout.max_new_tokens, shorten the prompts, or raise "
                                 f"policy.lm.max_positions (up to the checkpoint's max_position_embeddings)")
            ep.done[full], ep.truncated[full] = True, 1.0
            active = np.flatnonzero(~ep.done)
            if not len(active):
                break
            p0 = time.perf_counter()
            gens = self.backend.generate([ep.tokens[i] for i in active], self.max_new, sample,
                                         self._enough(ep, active) if cut else None)
            policy_s += time.perf_counter() - p0
            actions = [""] * n
            for i in active[[g is None for g in gens]]:  # the aborted tail: its whole group leaves the update
                group = ep.groups == ep.groups[i]
                ep.done[group], ep.kept[group] = True, 0.0
            for i, g in zip(active, gens, strict=True):
                if not ep.kept[i]:
                    continue
                ep.tokens[i] += g.tokens.tolist()
                ep.mask[i] += [1] * len(g.tokens)
                ep.logp[i] += g.logp.tolist()
                ep.turns[i] += 1
                if not g.finished:
                    ep.truncated[i] = 1.0
                actions[i] = self.backend.decode(g.tokens)
            acting = set(active.tolist())
            e0 = time.perf_counter()
            for c in range(chunks):
                sl = slice(c * size, (c + 1) * size)
                _, step = self.env.request("step", TensorBatch({"actions": Ragged.from_texts(actions[sl])},
                                                               meta={"pool": pool, "chunk": c}))
                obs = step["obs"].texts("obs")
                ended = np.logical_or(step["terminated"], step["truncated"])
                failed = step["reward_failed"] if "reward_failed" in step else None
                for j in range(size):
                    i = c * size + j
                    if ep.done[i] or i not in acting:
                        continue
                    ep.rewards[i] += float(step["reward"][j])
                    if failed is not None:
                        ep.reward_failures += float(failed[j])
                    if ended[j]:
                        ep.done[i] = True
                        ep.truncated[i] = max(ep.truncated[i], float(step["truncated"][j]))
                    else:
                        ep.add_context(i, obs[j])
            env_s += time.perf_counter() - e0
        return ep, env_s, policy_s

    def collect(self, batch_index: int, version: int, stop: threading.Event | None) -> Collected:
        ep, env_s, policy_s = self._episodes(self.pool, self.N, self.seed + SEED_STRIDE * batch_index, True,
                                             self.C, stop, cut=self.config.rollout.finish_fraction < 1)
        groups = ep.groups + batch_index * SEED_STRIDE
        fields = {
            "tokens": Ragged.from_rows(ep.tokens, dtype=np.int64),
            "loss_mask": Ragged.from_rows(ep.mask, dtype=np.uint8),
            "logp": Ragged.from_rows(ep.logp, dtype=np.float32),
            "rewards": ep.rewards, "group": groups.astype(np.int64), "turns": ep.turns,
            "response_tokens": np.array([sum(m) for m in ep.mask], dtype=np.int64), "truncated": ep.truncated,
            "kept": ep.kept,
        }
        want = set(self.trajectory.fields) if self.trajectory is not None else set(fields)
        out = Collected(TensorBatch({k: v for k, v in fields.items() if k in want}, version=version,
                                    dims=("env",)))
        kept = ep.kept > 0
        out.returns, out.lengths = ep.rewards[kept].tolist(), ep.turns[kept].tolist()
        out.env_seconds, out.policy_seconds = env_s, policy_s
        out.stats["reward_failures"] = ep.reward_failures  # summed over shards into metrics.csv
        return out

    def evaluate(self, episodes: int, deterministic: bool, seed: int,
                 stop: threading.Event | None = None) -> Evaluation:
        """``episodes`` episodes on the eval pool (greedy when ``deterministic``): rounds of one episode per env."""
        returns: list[float] = []
        for r in range(math.ceil(episodes / self.config.env.eval_envs)):
            if stop is not None and stop.is_set():  # the caller went away: stop between rounds
                raise Stopped(f"stopped after {len(returns)} of {episodes} episodes: the caller went away")
            ep, _, _ = self._episodes("eval", None, seed + SEED_STRIDE * r, not deterministic, 1)
            returns += ep.rewards.tolist()
        return Evaluation(returns[:episodes])

    def probe(self, round_trips: int, stop: threading.Event | None = None) -> tuple[float, int]:
        """The echo round trip of a prompt-sized text message."""
        return probe_echo(self.env, TensorBatch({"obs": Ragged.from_texts(["x" * 64] * self.S)}), round_trips, stop)
