"""A learner of N torch.distributed ranks (FSDP2, gloo on CPU) makes the update one rank makes on the same batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rlfabric.services.core.batch import Ragged, TensorBatch  # noqa: E402
from rlfabric.services.core.config import parse_config  # noqa: E402
from rlfabric.services.core.models import build_policy  # noqa: E402
from tests.lm_support import SPEC  # noqa: E402

pytestmark = pytest.mark.minutes(0.7)  # on CI's 2 cores: the tiers start long files first


def run_config(agg: str, algorithm: str = "grpo", share_prompt: bool = False):
    return parse_config(f"""
name: ranks
seed: 5
env: {{adapter: text, id: arith, num_envs: 10, eval_envs: 2, options: {{group_size: 2}}}}
policy: {{lm: {{hidden_size: 64, intermediate_size: 128, layers: 2, heads: 2, max_positions: 48}}}}
algorithm: {{name: {algorithm}, learning_rate: 0.01, minibatch_size: 4, loss_agg: {agg}, epochs: 2,
             share_prompt: {str(share_prompt).lower()}}}
""")


def grpo_batch(policy) -> TensorBatch:
    """10 responses of different lengths to 5 prompts, rewarded unevenly: minibatches of 4 leave a last one of 2
    (and on 4 ranks a rank without rows)."""
    tok = policy.tokenizer
    rng = np.random.default_rng(0)
    rows, masks = [], []
    for i in range(10):
        prompt = [1, *tok.encode(f"Q: {i}+{i + 3}= A:", add_special_tokens=False)]
        answer = tok.encode(" " + "".join(rng.choice(list("0123456789"), size=1 + i % 4)), add_special_tokens=False)
        rows.append(prompt + answer + [2])
        masks.append([0] * len(prompt) + [1] * (len(answer) + 1))
    logp = [rng.normal(-3, 0.5, len(r)).astype(np.float32) for r in rows]
    return TensorBatch({
        "tokens": Ragged.from_rows(rows, dtype=np.int64), "loss_mask": Ragged.from_rows(masks, dtype=np.uint8),
        "logp": Ragged.from_rows(logp, dtype=np.float32),
        "rewards": np.array([1, 0, 0, 0, 1, 1, 0, 1, 0.5, 0], np.float32),
        "group": np.repeat(np.arange(5), 2), "response_tokens": np.array([sum(m) for m in masks]),
        "truncated": np.zeros(10, np.float32)}, dims=("env",))


def one_rank_update(config, batch: TensorBatch) -> dict[str, torch.Tensor]:
    torch.manual_seed(config.seed)
    policy = build_policy(config.spec.policy, SPEC, config.policy)
    algo = config.spec(policy, config, torch.Generator().manual_seed(config.seed + 7), env_spec=SPEC)
    algo.update(batch.to_torch())
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


@pytest.fixture(scope="module")
def two_ranks():
    from rlfabric.services.learner.ranks import RankGroup

    group = RankGroup(2, torch.device("cpu"), timeout_s=120)
    yield group
    group.close()


@pytest.mark.parametrize("agg, share", [("sequence", False), ("token", False), ("sequence", True)])
def test_two_gloo_ranks_make_the_one_rank_update(two_ranks, agg, share):
    """(share: each pair's common prompt start, "<bos>Q: ", runs once on each rank and both rows read its cache)"""
    config = run_config(agg, share_prompt=share)
    torch.manual_seed(config.seed)
    batch = grpo_batch(build_policy(config.spec.policy, SPEC, config.policy))
    expected = one_rank_update(config, batch)
    policy, algo, _ = two_ranks.configure(config, SPEC, None, None)
    initial = two_ranks.weights(policy)
    stats = two_ranks.update(algo, batch)
    got = two_ranks.weights(policy)
    assert two_ranks.dead() is None and stats["updated"] == 1.0 and algo.optimizer_steps == 6
    assert set(got) == set(expected)
    moved = max(float((got[k] - initial[k]).abs().max()) for k in got)
    assert moved > 1e-3  # the update did something (lr 0.01, 6 Adam steps)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=2e-5, rtol=1e-4, msg=name)


def test_a_resumed_rank_group_continues_exactly(two_ranks):
    """Weights, unsharded optimiser state and the minibatch order saved from a 2-rank learner, restored into a new
    one: its next update equals the one the first group made."""
    config = run_config("token")
    torch.manual_seed(config.seed)
    batch = grpo_batch(build_policy(config.spec.policy, SPEC, config.policy))
    group = two_ranks
    policy, algo, generator = group.configure(config, SPEC, None, None)
    group.update(algo, batch)
    saved = copy.deepcopy({"policy": group.weights(policy), "algorithm": group.algorithm_state(policy, algo),
                           "generator": generator.get_state()})  # (a state dict aliases live step counters)
    group.update(algo, batch)
    expected = group.weights(policy)
    policy, algo, _ = group.configure(config, SPEC, saved["policy"], saved)
    assert algo.optimizer_steps == 6
    group.update(algo, batch)
    got = group.weights(policy)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_the_rank_group_gathers_optimizer_state_and_fails_loudly_when_a_rank_dies(two_ranks):
    config = run_config("sequence")
    policy, algo, _ = two_ranks.configure(config, SPEC, None, None)
    two_ranks.update(algo, grpo_batch(build_policy(config.spec.policy, SPEC, config.policy)))
    weights = two_ranks.weights(policy)
    state = two_ranks.algorithm_state(policy, algo)
    moments = state["optimizer"]["state"]
    assert set(moments) == {k for k, p in policy.named_parameters() if p.requires_grad}
    for name, s in moments.items():  # whole tensors on rank 0, not this rank's shards
        assert s["exp_avg"].shape == weights[name].shape and float(s["exp_avg_sq"].abs().sum()) > 0, name
    assert state["optimizer_steps"] == 6

    two_ranks.procs[0].kill()
    two_ranks.procs[0].wait()
    assert "learner rank 1" in two_ranks.dead()
    with pytest.raises(RuntimeError):  # the next collective fails instead of hanging
        two_ranks.weights(policy)


def test_the_learner_service_trains_with_two_ranks(tmp_path):
    """``runtime.learner_ranks: 2`` through every service: the learner starts its second rank, trains, publishes
    every version and checkpoints the unsharded state."""
    import csv
    import subprocess
    import sys

    from rlfabric.services.learner import checkpoint as ckpt

    run = tmp_path / "ranks"
    sets = ["policy.init_checkpoint=''", "runtime.learner_ranks=2", "env.num_envs=16", "env.eval_envs=8",
            "algorithm.minibatch_size=8", "train.total_env_steps=48", "train.eval_every_iterations=0"]
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", "examples/arith_grpo.yaml", "--quiet",
                           "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["weight_version"]) for r in rows] == [1, 2, 3]
    assert all(float(r["updated"]) == 1.0 for r in rows)
    state = ckpt.unpack((run / "checkpoints" / "final.pt").read_bytes(), "final.pt")
    assert state["weight_version"] == 3 and state["algorithm"]["optimizer_steps"] == 6
    assert set(state["algorithm"]["optimizer"]["state"]) <= set(state["policy"])  # unsharded, keyed by name


def test_more_ranks_are_refused_for_an_algorithm_that_does_not_split_its_update():
    from rlfabric.services.core.config import ConfigError

    with pytest.raises(ConfigError, match="learner_ranks"):
        parse_config("name: r\nenv: {id: CartPole-v1}\nalgorithm: {name: ppo}\nruntime: {learner_ranks: 2}\n")
    assert parse_config("name: r\nenv: {id: CartPole-v1}\nalgorithm: {name: ppo}\n").runtime.learner_ranks == 1


def test_starting_weights_of_another_shape_are_refused_with_the_field_named():
    from rlfabric.services.learner.ranks import initial_policy

    config = run_config("sequence")
    with pytest.raises(ValueError, match="policy.init_checkpoint.*another policy shape"):
        initial_policy(config, SPEC, torch.device("cpu"), {"model.lm_head.weight": torch.zeros(3, 3)})
    a, b = (initial_policy(config, SPEC, torch.device("cpu"), None).state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)  # every rank builds the same policy from the run's seed
