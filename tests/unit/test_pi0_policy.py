"""policy.name pi0: transformers' PI0ForConditionalGeneration as an actor-critic. The prefix's KV cache, computed
once, gives the expert what recomputing the prefix would; the learner re-scores a chain as the rollout scored it;
SFT on demonstrations makes the instruction steer the chunk; a fine-tuned model reloads in plain transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.config import PolicyConfig, RunConfig
from rlfabric.services.core.models import build_policy
from rlfabric.services.policies.pi0 import PI0Policy
from tests.vla_support import OBS_SPACE, TEXTS, VOCAB, chunk_space, imitate, observations

pytest.importorskip("transformers.models.pi0")

ACT_SPACE = chunk_space(3, 2)


def policy(**pi0) -> PI0Policy:
    torch.manual_seed(0)
    cfg = PolicyConfig(name="pi0", pi0={"patch": 8, "flow_steps": 3, **pi0})
    return build_policy("pi0", {"observation_space": OBS_SPACE, "action_space": ACT_SPACE}, cfg)


def plain_sample(plain, pol: PI0Policy, obs) -> torch.Tensor:
    """Plain transformers' sample_actions from zero noise on the policy's own inputs."""
    x = pol.inputs(obs)
    return plain.sample_actions(state=x["state"], input_ids=x["input_ids"], pixel_values=x["pixel_values"],
                                attention_mask=x["attention_mask"], pixel_attention_mask=x["pixel_attention_mask"],
                                noise=torch.zeros(len(x["state"]), pol.H, pol.A), num_steps=pol.steps)


def test_the_cached_prefix_gives_the_expert_what_recomputing_it_gives():
    pol = policy()
    x = pol.inputs(observations(TEXTS))
    cache, _ = pol.prefix(x)
    length = cache.get_seq_length()
    chunk = torch.randn(4, 3, 2)
    for tau in (0.0, 0.5):
        t = torch.full((4,), tau)
        cached = pol.velocity(chunk, t, x["state"], cache, x["attention_mask"])
        cache.crop(length - cache.get_seq_length())
        full = pol.model(noise=chunk, timestep=1.0 - t, **x).logits  # the prefix recomputed, no cache
        assert torch.allclose(cached, -full, atol=1e-5)
    assert cache.get_seq_length() == length  # the expert's tokens were cropped off


@pytest.mark.parametrize("level,sde_steps", [("chunk", "all"), ("action", "all"), ("token", "all"),
                                             ("token", "last"), ("chunk", "last")])
def test_the_learner_rescores_the_rollouts_chain_to_1e_4(level, sde_steps):
    pol = policy(logprob_level=level, sde_steps=sde_steps)
    obs = observations(TEXTS)
    chain, logp, value = pol.act(obs, generator=torch.Generator().manual_seed(1))
    assert chain.shape == (4, 4, 3, 2)  # [B, K+1, H, A]
    assert logp.shape == {"chunk": (4,), "action": (4, 3), "token": (4, 3, 2)}[level]
    new_logp, entropy, new_value = pol.evaluate(obs, chain)
    assert (new_logp - logp).abs().max() < 1e-4
    assert (new_value - value).abs().max() < 1e-5
    assert entropy.shape == logp.shape
    # the Flow-SDE log-prob depends on the chain: another chain's differs
    other, _, _ = pol.act(obs, generator=torch.Generator().manual_seed(2))
    assert (pol.evaluate(obs, other)[0] - logp).abs().max() > 1e-2


def test_with_noise_on_the_last_step_the_chain_follows_the_ode_until_its_last_point():
    """sde_steps: last: x_1..x_{K-1} are the ODE's from the recorded x_0 (what the deterministic chain from that x_0
    gives), only x_K is noisy; the update re-runs the steps, so a change of weights moves the earlier points' means
    and the log-prob of the same recorded chain."""
    pol = policy(sde_steps="last", flow_noise=0.3)
    obs = observations(TEXTS)
    chain, logp, _ = pol.act(obs, generator=torch.Generator().manual_seed(2))
    x_in = pol.inputs(obs)
    cache, _ = pol.prefix(x_in)
    length, x = cache.get_seq_length(), chain[:, 0]
    for k in range(pol.steps - 1):
        tau = torch.full((4,), k / pol.steps)
        v = pol.velocity(x, tau, x_in["state"], cache, x_in["attention_mask"])
        cache.crop(length - cache.get_seq_length())
        x = x + v / pol.steps
        assert torch.allclose(chain[:, k + 1], x, atol=1e-5)
    assert not torch.allclose(chain[:, -1], chain[:, -2] + pol.velocity(
        chain[:, -2], torch.full((4,), (pol.steps - 1) / pol.steps), x_in["state"], cache,
        x_in["attention_mask"]) / pol.steps, atol=1e-3)  # the last step drew noise
    with torch.no_grad():
        for p in pol.pi0.model.dit.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert (pol.evaluate(obs, chain)[0] - logp).abs().max() > 1e-3


def test_gradients_reach_the_vlm_through_the_cache_and_the_value_head():
    pol = policy()
    obs = observations(TEXTS)
    chain, _, _ = pol.act(obs)
    logp, _, value = pol.evaluate(obs, chain)
    (logp.sum() + value.sum()).backward()
    vlm = [p.grad for n, p in pol.named_parameters() if ".vlm.language_model." in n and p.grad is not None]
    vision = [p.grad for n, p in pol.named_parameters() if ".vision_tower." in n and p.grad is not None]
    assert vlm and all(torch.isfinite(g).all() for g in vlm)
    assert sum(g.abs().sum() for g in vlm) > 0 and sum(g.abs().sum() for g in vision) > 0


def test_decoding_noise_is_the_ode_from_it_and_from_zero_the_deterministic_chunk():
    """What a latent-noise policy (policy.name latent_noise, base pi0) steers: pi0's ODE from a given x_0."""
    pol = policy()
    obs = observations(TEXTS[:2], seed=5)
    chain, _, _ = pol.act(obs, deterministic=True)
    assert torch.allclose(pol.decode_noise(obs, torch.zeros(2, pol.act_dim)), chain[:, -1].clamp(-1, 1), atol=1e-5)
    noise = torch.randn(2, pol.act_dim, generator=torch.Generator().manual_seed(0))
    steered = pol.decode_noise(obs, noise)
    assert steered.shape == (2, 3, 2) and not torch.allclose(steered, chain[:, -1].clamp(-1, 1), atol=1e-3)


def test_env_actions_are_the_chains_last_point_on_the_bounds():
    pol = policy()
    chain = torch.zeros(2, 4, 3, 2)
    chain[0, -1] = 1.0
    chain[1, -1] = -3.0  # clipped to -1 first
    out = pol.env_actions(chain)
    assert out.shape == (2, 3, 2)
    assert np.allclose(out[0], 2.0) and np.allclose(out[1], -2.0)


def test_sft_makes_the_instruction_steer_the_chunk():
    """Demonstrations: 'red' -> +1.2 on every action, 'blue' -> -1.2. After SFT on pi0's own flow loss, the
    deterministic chunk follows the words, on images it never saw."""
    pol = policy(flow_steps=4)
    texts = ["reach the red ball", "reach the blue ball"] * 8
    target = torch.tensor([1.2 if "red" in t else -1.2 for t in texts])[:, None, None].expand(-1, 3, 2)
    optimizer = torch.optim.AdamW(pol.parameters(), lr=2e-3)
    first = None
    for step in range(150):
        loss = pol.imitation_loss(observations(texts, seed=step), target)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first
    test = ["touch the red one", "touch the blue one"]
    chain, _, _ = pol.act(observations(test, seed=999), deterministic=True)
    chunk = pol.env_actions(chain)
    assert chunk[0].mean() > 0.3 and chunk[1].mean() < -0.3 and chunk[0].mean() - chunk[1].mean() > 1.2, chunk


def test_save_pretrained_reloads_in_plain_transformers_to_the_same_deterministic_actions(tmp_path):
    from transformers import PI0ForConditionalGeneration

    pol = policy()
    with torch.no_grad():  # move off the init so the check is not of an untrained model
        for p in pol.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    obs = observations(TEXTS)
    chain, _, _ = pol.act(obs, deterministic=True)
    pol.save_pretrained(str(tmp_path))
    plain = PI0ForConditionalGeneration.from_pretrained(str(tmp_path), local_files_only=True).eval()
    actions = plain_sample(plain, pol, obs)
    assert torch.allclose(actions, chain[:, -1], atol=1e-5)
    again = build_policy("pi0", {"observation_space": OBS_SPACE, "action_space": ACT_SPACE},
                         PolicyConfig(name="pi0", pi0={"path": str(tmp_path), "flow_steps": 3}))
    assert torch.allclose(again.act(obs, deterministic=True)[0], chain, atol=1e-6)


def test_bad_specs_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="policy.pi0.path.*save_pretrained"):
        policy(path=str(tmp_path))
    state_only = {"kind": "box", "dtype": "float32", "shape": [8], "low": -np.inf, "high": np.inf}
    with pytest.raises(ValueError, match="pi0 reads camera images"):
        build_policy("pi0", {"observation_space": state_only, "action_space": ACT_SPACE}, PolicyConfig(name="pi0"))
    long_chunk = dict(ACT_SPACE, shape=[5, 2], low=np.full((5, 2), -1.0), high=np.full((5, 2), 1.0))
    pol = policy()
    pol.save_pretrained(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="env.action_chunk <= 3"):
        build_policy("pi0", {"observation_space": OBS_SPACE, "action_space": long_chunk},
                     PolicyConfig(name="pi0", pi0={"path": str(tmp_path / "m")}))


def test_pi0_starts_its_vlm_from_a_saved_paligemma_and_can_keep_its_encoder_frozen(tmp_path):
    """vlm_path: every VLM tensor whose name and shape agree comes from the saved PaliGemma (its embedding, of
    another vocabulary, does not); freeze_vision: SFT steps move the expert and the language model, not the
    encoder."""
    from rlfabric.services.policies.vlm_families import FAMILIES

    sizes = PolicyConfig(name="pi0", pi0={"patch": 8}).pi0
    torch.manual_seed(5)
    source = FAMILIES["paligemma"].tiny(sizes, VOCAB + 40, 32)
    source.save_pretrained(str(tmp_path / "vlm"))
    saved = source.model.state_dict()
    pol = policy(vlm_path=str(tmp_path / "vlm"), freeze_vision=True)
    vlm = pol.pi0.model.vlm.state_dict()
    assert all(torch.equal(vlm[k], saved[k]) for k in vlm if not k.endswith("embed_tokens.weight"))
    assert not torch.equal(vlm["language_model.embed_tokens.weight"][:VOCAB], saved["language_model.embed_tokens.weight"][:VOCAB])
    encoder = {k: v.clone() for k, v in pol.pi0.model.vlm.vision_tower.state_dict().items()}
    expert = {k: v.clone() for k, v in pol.pi0.model.dit.state_dict().items()}
    imitate(pol, 2, (3, 2))
    assert all(torch.equal(v, pol.pi0.model.vlm.vision_tower.state_dict()[k]) for k, v in encoder.items())
    assert any(not torch.equal(v, pol.pi0.model.dit.state_dict()[k]) for k, v in expert.items())

    with pytest.raises(ValueError, match="image encoder differs.*vision_width"):
        policy(vlm_path=str(tmp_path / "vlm"), vision_width=32)
    pol.save_pretrained(str(tmp_path / "pi0"))
    with pytest.raises(ValueError, match="holds a pi0 model.*PaliGemma VLM's or a SigLIP"):
        policy(vlm_path=str(tmp_path / "pi0"))
    with pytest.raises(ValueError, match="set one of them"):
        policy(vlm_path=str(tmp_path / "vlm"), path=str(tmp_path / "pi0"))


def test_a_run_spec_names_pi0_and_its_sizes():
    cfg = RunConfig.model_validate({"env": {"id": "rlfabric/ArmReachLang-v0", "action_chunk": 4},
                                    "policy": {"name": "pi0", "pi0": {"width": 32, "flow_steps": 6}},
                                    "algorithm": {"name": "ppo"}})
    assert cfg.policy.pi0.flow_steps == 6
    with pytest.raises(ValueError, match="flow_noise"):
        RunConfig.model_validate({"policy": {"name": "pi0", "pi0": {"flow_noise": 0}}})


@pytest.mark.parametrize("sde_steps", ["all", "last"])
def test_a_ppo_update_raises_the_log_prob_of_advantaged_chains_and_lowers_the_others(sde_steps):
    cfg = RunConfig.model_validate({"env": {"id": "rlfabric/ArmReachLang-v0", "action_chunk": 3},
                                    "policy": {"name": "pi0", "pi0": {"patch": 8, "flow_steps": 3,
                                                                      "sde_steps": sde_steps}},
                                    "algorithm": {"name": "ppo", "n_epochs": 4, "batch_size": 16,
                                                  "learning_rate": 3e-4, "lr_schedule": "constant"}})
    pol = policy(sde_steps=sde_steps)
    algo = cfg.spec(pol, cfg, torch.Generator().manual_seed(0))
    T, N = 2, 8
    obs = observations(TEXTS * 2, seed=3)
    chains, logp, values = pol.act(obs, generator=torch.Generator().manual_seed(4))
    good = torch.arange(N) % 2 == 0  # every other env's chain earned a reward
    batch = {"obs": {k: v[None].expand(T, *v.shape).contiguous() for k, v in obs.items()},
             "actions": chains[None].expand(T, *chains.shape).contiguous(),
             "logp": logp[None].expand(T, N).contiguous(), "values": values[None].expand(T, N).contiguous(),
             "rewards": good.float()[None].expand(T, N).contiguous(), "dones": torch.ones(T, N),
             "last_values": torch.zeros(N)}
    stats = algo.update(batch)
    after = pol.evaluate(obs, chains)[0].detach()
    assert stats["logprob_mismatch_abs"] < 1e-4  # the learner re-scored the rollout's chains
    assert (after - logp)[good].mean() > 0.05 and (after - logp)[~good].mean() < -0.05, after - logp


@pytest.mark.parametrize("where", ["vlm", "expert", "both"])
def test_lora_trains_adapters_where_asked_and_exports_a_plain_model(tmp_path, where):
    """Adapters (peft) on the attention of the VLM's language model, the expert or both; the action and state
    projections and the value head train in full, the rest stays frozen. save_pretrained folds them in."""
    from transformers import PI0ForConditionalGeneration

    pol = policy(lora={"rank": 4, "alpha": 8.0}, lora_on=where)
    trainable = {n for n, p in pol.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if "lora_" in n}
    assert adapters and all("self_attn" in n for n in adapters)
    assert any(".dit." in n for n in adapters) == (where != "vlm")
    assert any("vlm.language_model" in n for n in adapters) == (where != "expert")
    assert not any("vision_tower" in n for n in trainable)
    assert any("action_out_proj" in n for n in trainable) and any(n.startswith("value_head") for n in trainable)
    obs = observations(TEXTS)
    chain, logp, _ = pol.act(obs, generator=torch.Generator().manual_seed(1))
    assert (pol.evaluate(obs, chain)[0] - logp).abs().max() < 1e-4
    with torch.no_grad():  # as if trained: the adapters' B is zero at init
        for n, p in pol.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn_like(p))
    moved, _, _ = pol.act(obs, deterministic=True)
    pol.save_pretrained(str(tmp_path))
    plain = PI0ForConditionalGeneration.from_pretrained(str(tmp_path), local_files_only=True)
    assert not any("lora" in k for k in plain.state_dict())
    actions = plain_sample(plain, pol, obs)
    assert torch.allclose(actions, moved[:, -1], atol=1e-5)
