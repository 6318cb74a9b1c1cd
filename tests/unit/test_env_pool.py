import numpy as np
import pytest

from rlfabric.services.core.config import EnvConfig
from rlfabric.services.env.adapters.gymnasium import UnknownEnvError, check_env_id
from rlfabric.services.env.pool import EnvPool


def _env(env_id: str) -> EnvConfig:
    return EnvConfig(id=env_id)


def test_unknown_env_id_suggests_close_match():
    with pytest.raises(UnknownEnvError, match="did you mean 'CartPole-v1'"):
        check_env_id("CartPol-v1")


def test_wrong_action_shape_names_space_and_fix():
    pool = EnvPool(_env("CartPole-v1"), 4, chunks=2)
    pool.reset(0)
    with pytest.raises(ValueError, match=r"shape \(2, 2\).*expects \(2,\).*fix the policy"):
        pool.step(0, np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="must lie in"):
        pool.step(1, np.array([0, 5]))
    with pytest.raises(ValueError, match="integers"):
        pool.step(1, np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="chunk 2 out of range"):
        pool.step(2, np.zeros(2, np.int64))
    cont = EnvPool(_env("Pendulum-v1"), 2)
    cont.reset(0)
    with pytest.raises(ValueError, match="NaN"):
        cont.step(0, np.full((2, 1), np.nan, np.float32))


def test_episode_statistics_and_final_observation():
    pool = EnvPool(_env("CartPole-v1"), 2)
    pool.reset(0)
    finished = []
    for _ in range(200):
        out = pool.step(0, np.ones(2, np.int64))  # always push right: episodes end fast
        done = out["terminated"] | out["truncated"]
        assert ("final_obs" in out) == done.any()  # episode-end tensors only ride when an episode ended
        for i in np.flatnonzero(done):
            finished.append(out["episode_return"][i])
            assert abs(out["final_obs"][i][2]) > 0.2  # the pole had fallen in the final observation
            assert abs(out["obs"][i][2]) < 0.06        # while obs is already the reset state
    assert len(finished) >= 10 and pool.finished_returns[: len(finished)] == pytest.approx(finished)
    assert all(r == length for r, length in zip(pool.finished_returns, pool.finished_lengths, strict=True))
    assert pool.env_steps == 400


def test_seeding_is_reproducible_per_env():
    a, b = EnvPool(_env("CartPole-v1"), 3), EnvPool(_env("CartPole-v1"), 3)
    np.testing.assert_array_equal(a.reset(5)[0], b.reset(5)[0])
    assert not np.array_equal(a.reset(5)[0][0], a.reset(5)[0][1])


def test_env_shards_are_bounded_by_the_run_env_batch_whatever_resets_name():
    """Regression: every reset naming a new pool built a new set of envs that was never freed (+100 MB for 2,000
    names). Shard names are bounded by env.num_envs (each rollout worker has one env at least), and the shards
    together never hold more envs than the run's batch: shards an earlier plan left give way, oldest first."""
    from rlfabric.services.core.config import RunConfig
    from rlfabric.services.env.pool import EnvPools

    pools = EnvPools(RunConfig.model_validate({"env": {"num_envs": 4, "eval_envs": 2}}), build_train=False)
    refused = 0
    for i in range(2000):
        try:
            pools.handle("reset", {"pool": f"train/{i}", "num_envs": 4, "seed": i}, {})
        except ValueError:
            refused += 1
    assert refused == 2000 - 4
    held = {name: p.num_envs for name, p in pools.pools.items() if name.startswith("train")}
    assert sum(held.values()) <= 4, held
    for w in range(2):  # a plan of two workers, two envs each, after that churn: both shards live side by side
        pools.handle("reset", {"pool": f"train/{w}", "num_envs": 2, "seed": w}, {})
    held = {name: p.num_envs for name, p in pools.pools.items() if name.startswith("train")}
    assert held == {"train/0": 2, "train/1": 2}, held
    out = pools.handle("step", {"pool": "train/0", "chunk": 0}, {"actions": np.ones(2, np.int64)})
    assert out[0] == "stepped"
