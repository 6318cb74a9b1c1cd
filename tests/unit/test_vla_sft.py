"""SFT of action policies on demonstrations: ArmReach's scripted expert solves the task from privileged state,
`collect --expert` records it as a data set, and vla_sft clones it into a VLA policy through the policy's own
imitation loss (flow matching or bin cross-entropy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco")

from rlfabric.services.core.config import RunConfig  # noqa: E402
from rlfabric.services.core.models import build_policy  # noqa: E402
from rlfabric.services.rollout.evaluate import collect_dataset  # noqa: E402

SPEC = """
name: demos
env:
  id: rlfabric/ArmReachLang-v0
  kwargs: {observation: state}
  action_chunk: 4
  eval_envs: 8
algorithm: {name: ppo}
"""


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    path = tmp_path_factory.mktemp("demos") / "spec.yaml"
    path.write_text(SPEC)
    batch, returns = collect_dataset(path, episodes=24, seed=5, expert=True)
    return batch, returns


def test_the_scripted_expert_solves_arm_reach_lang_and_is_recorded_as_chunks(demos):
    batch, returns = demos
    assert len(returns) == 24 and np.mean(np.asarray(returns) > 1.0) >= 0.9  # a return above 1 is a success
    actions = batch["actions"]
    assert actions.shape[1:] == (4, 2) and np.abs(actions).max() <= 1.0 + 1e-6
    assert set(batch.tensors) >= {"obs/state", "obs/instruction", "rewards", "terminated", "episode"}
    assert int(batch["episode"].max()) == 23


def test_a_cautious_expert_moves_at_its_fraction_of_the_arms_speed_and_times_out_more():
    """``expert_speed``: demonstrations from an operator slower than the arm can move. Each move is that fraction
    of the full-speed expert's, in the same direction, so fewer episodes finish inside the time limit."""
    import gymnasium as gym

    import rlfabric.services.env.sims  # noqa: F401  (registers the ids)

    rates = {}
    for speed in (1.0, 0.33):
        env = gym.make("rlfabric/ArmReachLang-v0", observation="state", expert_speed=speed)
        env.reset(seed=3)
        if speed < 1.0:
            fast = env.unwrapped.expert_action(4) / speed  # the full-speed expert's moves in the same state
            slow = env.unwrapped.expert_action(4)
            assert np.abs(fast).max() == pytest.approx(1.0) and np.abs(slow).max() == pytest.approx(0.33)
        wins = 0
        for seed in range(40):
            env.reset(seed=100 + seed)
            done = False
            while not done:
                for move in env.unwrapped.expert_action(4):
                    _, _, terminated, truncated, info = env.step(move)
                    if done := terminated or truncated:
                        break
            wins += info["is_success"]
        rates[speed] = wins / 40
    assert rates[1.0] >= 0.9 and rates[0.33] <= rates[1.0] - 0.2, rates  # ~0.96 against ~0.63
    with pytest.raises(ValueError, match="expert_speed"):
        gym.make("rlfabric/ArmReachLang-v0", observation="state", expert_speed=1.5)


def test_collecting_with_the_expert_from_a_spec_needs_an_env_that_has_one(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("env: {id: CartPole-v1, eval_envs: 2}\nalgorithm: {name: ppo}\n")
    with pytest.raises(ValueError, match="no scripted expert"):
        collect_dataset(path, episodes=2, expert=True)
    with pytest.raises(ValueError, match="--expert"):
        collect_dataset(path, episodes=2)


@pytest.mark.parametrize("head", ["flow", "tokens"])
def test_random_collection_with_a_chunk_policy_records_uniform_chunks(tmp_path, head):
    """A chunk policy's own action form (a denoising chain, bin ids) has no uniform counterpart: --random draws
    the env's chunks, recorded as the expert's are (this once failed reshaping flat actions into chunks)."""
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + f"policy: {{name: vla, vla: {{head: {head}}}}}\n")
    batch, returns = collect_dataset(path, episodes=8, seed=1, random=True)
    actions = batch["actions"]
    assert len(returns) == 8 and actions.shape[1:] == (4, 2) and actions.dtype == np.float32
    assert np.abs(actions).max() <= 1.0 and actions.std() > 0.4  # uniform on [-1, 1]: std 0.58
    assert np.mean(np.asarray(returns) > 1.0) < 0.5  # random chunks rarely reach the named ball


@pytest.mark.parametrize("head", ["flow", "tokens"])
def test_vla_sft_clones_the_expert(demos, head):
    batch, _ = demos
    cfg = RunConfig.model_validate({
        "env": {"id": "rlfabric/ArmReachLang-v0", "action_chunk": 4, "kwargs": {"observation": "state"}},
        "policy": {"name": "vla", "vla": {"width": 32, "heads": 2, "layers": 1, "head": head, "bins": 11}},
        "algorithm": {"name": "vla_sft", "learning_rate": 3e-3}, "replay": {"datasets": {"offline": "x.npz"}}})
    spec = {"observation_space": {"kind": "dict", "spaces": {
        "state": {"kind": "box", "dtype": "float32", "shape": [12], "low": -np.inf, "high": np.inf},
        "instruction": {"kind": "box", "dtype": "int64", "shape": [12], "low": np.zeros(12),
                        "high": np.full(12, 95)}}},
        "action_space": {"kind": "box", "dtype": "float32", "shape": [4, 2], "low": -np.ones((4, 2)),
                         "high": np.ones((4, 2))}}
    torch.manual_seed(0)
    policy = build_policy(cfg.policy_name, spec, cfg.policy)
    algo = cfg.spec(policy, cfg, torch.Generator().manual_seed(0))
    obs = {"state": torch.as_tensor(batch["obs/state"]), "instruction": torch.as_tensor(batch["obs/instruction"])}
    actions = torch.as_tensor(batch["actions"])
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(60):
        idx = torch.randint(0, len(actions), (4, 32), generator=g)  # [U, B]: 4 minibatches per update
        losses.append(algo.update({"obs": {k: v[idx] for k, v in obs.items()}, "actions": actions[idx]})["sft_loss"])
    assert algo.optimizer_steps == 240
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:2])
    chosen = policy.env_actions(policy.act(obs, deterministic=True)[0])
    error = np.abs(chosen - batch["actions"]).mean()
    assert error < 0.35, error  # the expert's moves are +-1 along the way: a policy that ignored them errs ~0.8


def test_vla_sft_refuses_a_policy_without_an_imitation_loss():
    cfg = RunConfig.model_validate({"env": {"id": "Pendulum-v1"}, "policy": {"name": "actor_critic"},
                                    "algorithm": {"name": "vla_sft"}, "replay": {"datasets": {"offline": "x.npz"}}})
    policy = build_policy("actor_critic", {"observation_space": {"kind": "box", "shape": [3]},
                                           "action_space": {"kind": "box", "shape": [1], "low": [-2.0],
                                                            "high": [2.0]}}, cfg.policy)
    with pytest.raises(ValueError, match="imitation_loss.*policy.name: pi0, vla or vla_tokens"):
        cfg.spec(policy, cfg)


@pytest.mark.parametrize("warm_start, message", [
    ({"demos": 10}, "warm_start.supervised is empty"),
    ({"dataset": "data/lerobot"}, "warm_start.supervised is empty"),
    ({"supervised": {"name": "vla_sft"}}, "warm_start.demos: N episodes .* or warm_start.dataset"),
    ({"demos": 10, "supervised": {"name": "ppo"}}, "collects with a rollout"),
    ({"demos": 10, "supervised": {"name": "vla_sft", "total_updates": 0}}, "at vla_sft.total_updates"),
])
def test_a_warm_start_names_demonstrations_and_an_offline_stage(warm_start, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate({"warm_start": warm_start})
    ok = RunConfig.model_validate({"warm_start": {"demos": 10, "supervised": {"name": "vla_sft"}}})
    assert ok.warm_start.enabled and not RunConfig().warm_start.enabled
    lerobot = RunConfig.model_validate({"warm_start": {"dataset": "data/lerobot", "supervised": {"name": "vla_sft"}}})
    assert lerobot.warm_start.enabled and lerobot.warm_start.demos == 0


def _first_scenes(batch) -> np.ndarray:
    """The balls' positions at the start of each recorded episode (the state observation's last four entries)."""
    episode = np.asarray(batch["episode"])
    starts = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    return np.round(np.asarray(batch["obs"]["state"])[starts, 8:12], 5)


def test_the_warm_start_does_not_imitate_the_scenes_the_run_evaluates_on(tmp_path):
    """Demonstrations and evaluation used to share env seeds (demos_seed 100000 = seed 0's evaluation seed): every
    evaluation replayed the scenes the policy had imitated. Now their scenes differ, and a spec that makes them
    collide is refused with the fix."""
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    run = RunConfig.model_validate({"warm_start": {"demos": 8, "supervised": {"name": "vla_sft"}},
                                    "env": {"eval_envs": 8}})
    demos, _ = collect_dataset(path, episodes=16, seed=run.warm_start.demos_seed, expert=True)
    evaluated, _ = collect_dataset(path, episodes=16, seed=run.eval_seed(), expert=True)
    shared = {tuple(s) for s in _first_scenes(demos)} & {tuple(s) for s in _first_scenes(evaluated)}
    assert len(_first_scenes(demos)) == 16 and not shared
    again, _ = collect_dataset(path, episodes=16, seed=run.eval_seed(), expert=True)  # a seed fixes the scenes
    np.testing.assert_array_equal(_first_scenes(again), _first_scenes(evaluated))
    for seed, demos_seed, what in ((0, 100_000, "evaluation"), (7, 3, "training"), (0, 99_995, "evaluation")):
        with pytest.raises(ValueError, match=f"warm_start.demos_seed={demos_seed} .* overlap the {what}"):
            RunConfig.model_validate({"seed": seed, "env": {"eval_envs": 8},
                                      "warm_start": {"demos": 8, "demos_seed": demos_seed,
                                                     "supervised": {"name": "vla_sft"}}})
    RunConfig.model_validate({"env": {"eval_envs": 8}, "warm_start": {"demos": 8, "demos_seed": 99_992,
                                                                     "supervised": {"name": "vla_sft"}}})
    with pytest.raises(ValueError, match="overlap the evaluation"):  # the vision stage's scenes count too
        RunConfig.model_validate({"warm_start": {"vision": {"scenes": 200_000}, "demos_seed": 0}})
    warm = {"demos": 8, "demos_seed": 1_000_004, "supervised": {"name": "vla_sft"}}  # the held-out seeds' range
    with pytest.raises(ValueError, match="overlap the held-out evaluation env seeds 1000000..1000007"):
        RunConfig.model_validate({"env": {"eval_envs": 8}, "train": {"held_out_episodes": 64}, "warm_start": warm})
    RunConfig.model_validate({"env": {"eval_envs": 8}, "warm_start": warm})  # no held-out evaluation asked for
