import pytest

from rlfabric.services.core.config import ConfigError, RunConfig, load_config, parse_config


def test_defaults_and_examples_are_valid():
    assert RunConfig().algorithm.name == "ppo" and RunConfig().algorithm.n_steps == 32
    for name in ("cartpole_ppo.yaml", "pendulum_ppo.yaml"):
        cfg = load_config(f"examples/{name}")
        assert cfg.train.total_env_steps > 0


def test_every_example_run_spec_validates_and_its_text_data_builds():
    """Each examples/*.yaml passes the schema; the text ones whose data ships in examples/ also build their task
    (data files, options, reward); others write their data first (bench/reasoning_data.py)."""
    from pathlib import Path

    from rlfabric.services.env.adapters import text

    names = sorted(p.name for p in Path("examples").glob("*.yaml"))
    assert {"sums_sft.yaml", "sums_grpo.yaml", "arith_grpo.yaml"} <= set(names)
    for name in names:
        cfg = load_config(f"examples/{name}")
        if cfg.env.adapter == "text" and str(cfg.env.options.get("path", "examples/")).startswith("examples/"):
            text.check(cfg.env)


def test_malformed_yaml_names_line_and_fix():
    with pytest.raises(ConfigError, match=r"bad.yaml: line 4, column 1: malformed YAML.*Fix: check indentation"):
        parse_config("env:\n  id: CartPole-v1\n  num_envs: [8\n", "bad.yaml")


def test_unknown_field_suggests_the_closest_name():
    with pytest.raises(ConfigError) as info:
        parse_config("env:\n  num_env: 8\nalgo: {}\n")
    msg = str(info.value)
    assert "env.num_env: unknown field" in msg and "did you mean 'env.num_envs'" in msg
    assert "did you mean 'algorithm'" in msg


def test_bad_values_name_field_value_and_fix():
    with pytest.raises(ConfigError) as info:
        parse_config("train: {total_env_steps: -5}\nscheduling: {mode: warp}\nalgorithm: {name: sac, gamma: abc}")
    msg = str(info.value)
    assert "train.total_env_steps" in msg and "(got -5)" in msg and "Fix" in msg
    assert "scheduling.mode" in msg and "'hybrid' or 'auto'" in msg
    assert "algorithm.gamma" in msg and "set algorithm.gamma to a valid value" in msg


def test_algorithm_section_is_the_named_algorithms_config():
    """algorithm is a union tagged by name: each algorithm's own fields, errors that name them, a hint for specs
    written in the old nested layout, and the default algorithm when no name is given."""
    assert parse_config("algorithm: {name: sac, learning_starts: 5}").algorithm.learning_starts == 5
    assert parse_config("algorithm: {n_epochs: 3}").algorithm.n_epochs == 3  # no name: the default (ppo)
    with pytest.raises(ConfigError) as info:
        parse_config("algorithm: {name: sac, n_epochs: 3}")  # a PPO field on SAC
    assert "algorithm.n_epochs: unknown field" in str(info.value)
    with pytest.raises(ConfigError, match="'dqn' is not a registered algorithm. Fix: set algorithm.name to one of"):
        parse_config("algorithm: {name: dqn}")
    with pytest.raises(ConfigError, match="algorithm settings now sit directly under algorithm"):
        parse_config("algorithm: {name: ppo, ppo: {n_steps: 8}}")


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="divisible by scheduling.pipeline_chunks"):
        parse_config("env: {num_envs: 6}\nscheduling: {mode: disaggregated, pipeline_chunks: 4}")
    # collocated plans do not chunk, so any env count is fine
    assert parse_config("env: {num_envs: 6}\nscheduling: {pipeline_chunks: 4}").scheduling.chunks() == 1


def test_overrides_parse_yaml_scalars():
    cfg = parse_config("seed: 1", overrides=["train.total_env_steps=5000", "algorithm.clip_range_vf=0.3",
                                              "env.kwargs={max_episode_steps: 50}", "name=x"])
    assert cfg.train.total_env_steps == 5000 and cfg.algorithm.clip_range_vf == 0.3
    assert cfg.env.kwargs == {"max_episode_steps": 50} and cfg.name == "x"
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_config("", overrides=["seed"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        parse_config("seed: 1", overrides=["seed.x=1"])


def test_top_level_must_be_mapping_and_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_config("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_json_round_trip_and_bad_json():
    cfg = parse_config("seed: 3\nenv: {id: Pendulum-v1}")
    assert RunConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunConfig.from_json("{")
    with pytest.raises(ConfigError, match="seed"):
        RunConfig.from_json('{"seed": "x"}')


def test_the_cheap_spec_reader_agrees_with_the_schema_on_overrides(tmp_path):
    """The launcher reads a spec's name and threads without the schema (no torch): same YAML, same overrides."""
    from rlfabric.services.core.spec_yaml import read_spec_file

    spec = tmp_path / "s.yaml"
    spec.write_text("name: a\nruntime:\n  torch_threads: 2\n")
    raw = read_spec_file(spec, ["name=b", "runtime.torch_threads=3", "train.total_env_steps=4096"])
    assert raw == {"name": "b", "runtime": {"torch_threads": 3}, "train": {"total_env_steps": 4096}}
    config = load_config(spec, ["name=b", "runtime.torch_threads=3", "train.total_env_steps=4096"])
    assert (config.name, config.runtime.torch_threads, config.train.total_env_steps) == ("b", 3, 4096)
    with pytest.raises(ConfigError, match="'name' is a value, not a section"):
        read_spec_file(spec, ["name.x=1"])


def test_a_policy_chosen_by_name_must_serve_the_algorithm():
    """policy.name picks another registered policy for an algorithm, if it serves the same interface: the VLA
    policy serves PPO as an actor-critic, not SAC's squashed-Gaussian actor; unknown names list the known ones."""
    cfg = parse_config("policy: {name: vla}\nenv: {id: rlfabric/ArmReach-v0, action_chunk: 4}")
    assert cfg.policy_name == "vla" and RunConfig().policy_name == "actor_critic"
    with pytest.raises(ConfigError, match="policy.name='vla' serves as 'actor_critic', but algorithm 'sac' trains a "
                                          "'squashed_gaussian' policy"):
        parse_config("policy: {name: vla}\nalgorithm: {name: sac}")
    with pytest.raises(ConfigError, match="policy.name 'vlaa' is not a registered policy; available"):
        parse_config("policy: {name: vlaa}")
    with pytest.raises(ConfigError, match="policy.vla: .*width=60 is not divisible by heads=8"):
        parse_config("policy: {name: vla, vla: {width: 60, heads: 8}}")


def test_a_policy_familys_section_comes_from_its_options_model_and_names_a_misspelled_option():
    """policy.pi0, policy.vla_tokens, ...: sections the schema builds from the options models rlfabric registers as
    entry points (services/policies/options.py), as strict as core's own sections."""
    from rlfabric.services.core.config import PolicyConfig
    from rlfabric.services.policies.options import PI0PolicyConfig, VLATokensConfig

    assert PolicyConfig.model_fields["pi0"].annotation is PI0PolicyConfig
    assert PolicyConfig.model_fields["vla_tokens"].annotation is VLATokensConfig
    assert parse_config("policy: {name: pi0, pi0: {flow_steps: 6}}").policy.pi0.flow_steps == 6
    with pytest.raises(ConfigError) as err:
        parse_config("policy: {name: pi0, pi0: {flow_step: 6}}")
    assert "policy.pi0.flow_step: unknown field. Fix: remove it; did you mean 'policy.pi0.flow_steps'?" in str(err.value)
    with pytest.raises(ConfigError, match="policy.pi0: .*policy.pi0.path loads a whole pi0"):
        parse_config("policy: {pi0: {path: a, vlm_path: b}}")


@pytest.mark.parametrize(("override", "field"), [
    ("seed=-1", "seed"),  # numpy refuses a negative seed: the workers failed after the coordinator accepted it
    ("name=" + "n" * 101, "name"),  # the run id, its directory and its object-store keys start with the name
    ("env.kwargs={render_mode: human}", "env.kwargs"),  # a window on a headless env service
    ("algorithm.ent_coef=.inf", "algorithm.ent_coef"),  # the learner failed with "Unexpected ValueError"
])
def test_specs_that_workers_would_reject_are_refused_at_parse_time_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        parse_config("name: x\n", "spec", [override])
    assert f"{field}:" in str(err.value) and "Fix" in str(err.value)
    parse_config("name: x\n", "spec", ["env.kwargs={render_mode: rgb_array}", "seed=4294967295"])  # still fine


BILLION_LAUGHS = """
name: laughs
env:
  kwargs:
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


def test_a_spec_whose_aliases_expand_to_billions_of_values_is_refused_before_the_schema_walks_it():
    """It grew the coordinator to 5 GB and hung it for ~50 s; now it is refused while it is read."""
    with pytest.raises(ConfigError, match="aliases"):
        parse_config(BILLION_LAUGHS)
    few = "name: x\nenv:\n  kwargs:\n    l0: &l0 [1, 2, 3, 4, 5, 6, 7, 8]\n" + "".join(
        f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 8) + "]\n" for i in range(1, 6))  # 40 aliases, 8^6 values
    with pytest.raises(ConfigError, match="expands to more than"):
        parse_config(few)
    levels = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"] + [
        f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]  # 72 aliases, 9^9 values
    with pytest.raises(ConfigError, match="aliases"):  # through --set (SubmitRun's overrides) too
        parse_config("name: x\n", overrides=["env.kwargs={" + ", ".join(levels) + "}"])
    assert parse_config("name: x\nenv: &e {num_envs: 2}\ntrain: {total_env_steps: 100}\n").env.num_envs == 2


def test_an_oversized_spec_is_refused_by_its_size():
    """A 7.5 MB spec froze the coordinator for ~5 s; a spec is a few KiB."""
    with pytest.raises(ConfigError, match="bytes, over the"):
        parse_config("name: x\n#" + "x" * (2 << 20) + "\n")
