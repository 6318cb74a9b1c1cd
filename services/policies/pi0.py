"""PI0Policy (``policy.name: pi0``): transformers' PI0ForConditionalGeneration as an actor-critic for RL and as a
flow-matching policy that imitates demonstrations.

    prefix   the camera images (SigLIP patches) and the instruction's ids run through the PaliGemma VLM once per
             decision; its KV cache is what the action expert reads, and its pooled features feed the value head
    suffix   the expert (a Gemma with its own weights) reads that cache, the proprioceptive state and a noisy chunk
             at time t, and predicts the velocity; pi0 integrates it from noise (t = 1) to the chunk (t = 0)

RL scores the denoising chain with Flow-SDE (services/policies/flow_sde.py): each of the K steps is a Gaussian
around the SDE's Euler-Maruyama mean, so log pi(chain) is a sum of K Gaussian log-probs, computed through pi0's own
expert (``sde_steps: all``); or only the last step draws noise, around the ODE's last Euler step from the recorded
x_0 (``sde_steps: last``). Acting computes the prefix's cache once and reuses it for all K steps (cropping the
expert's tokens off after each); the learner re-scores all K steps of a batch in one expert call over the cache
repeated K times (all), or re-runs them in turn from x_0 (last), with gradients flowing into the VLM through it. Deterministic acting is pi0's own ODE from zero noise, so the same
weights saved with ``save_pretrained`` give the same chunk from plain transformers' ``sample_actions``.

Chains and chunks live in [-1, 1] per action dimension (the env's bounds mapped onto it); a chunk shorter than the
model's ``chunk_size`` or narrower than its ``max_action_dim`` is zero-padded in and cropped out, as pi0 pads.
The instruction arrives as the env's token ids and feeds the VLM's embedding directly, so a loaded checkpoint must
share the env's vocabulary.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlfabric.services.core.models.hf_cache import cache_arg, cache_of
from rlfabric.services.policies import flow_sde
from rlfabric.services.policies.chunk_policy import ChunkPolicy
from rlfabric.services.policies.obs_critic import VLMCritic
from rlfabric.services.policies.vlm_families import FAMILIES
from rlfabric.services.policies.vlm_inputs import (
    VLMInputs,
    freeze,
    save_merged,
    siglip_paligemma_config,
    start_vlm,
    unwrapped,
)

log = logging.getLogger(__name__)


def tiny_config(p: Any, vocab: int, image_size: int, chunk: int, action_dim: int, state_dim: int):
    """A PI0Config from ``policy.pi0``'s sizes (random init): the expert as deep as the language model, whose
    cache it reads layer by layer, with its own width."""
    from transformers import PI0Config

    vlm = siglip_paligemma_config(p, vocab, image_size)
    return PI0Config(vlm_config=vlm, dit_config=vlm["text_config"] | {"hidden_size": p.expert_width,
                                                                      "intermediate_size": 4 * p.expert_width},
                     chunk_size=chunk, max_action_dim=action_dim, max_state_dim=max(state_dim, 1),
                     num_inference_steps=p.flow_steps)


def load_pretrained(path: str):
    """A local save_pretrained directory (``policy.pi0.path``); never a hub id."""
    from pathlib import Path

    from transformers import PI0ForConditionalGeneration

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"policy.pi0.path={path!r} is not a save_pretrained directory (no config.json). Fix: point "
                         f"it at a local directory written by PI0ForConditionalGeneration.save_pretrained; nothing "
                         f"is downloaded")
    return PI0ForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=torch.float32)


class PI0Policy(ChunkPolicy):
    critic_only_privileged = True  # VLMInputs skips an env's privileged entries; critic: own reads them

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        from transformers import PI0ForConditionalGeneration

        p = cfg.pi0
        self.init_chunks(action_space, "pi0", p.logprob_level)
        self.steps, self.sigma, self.noisy_last_only = p.flow_steps, p.flow_noise, p.sde_steps == "last"
        self.read = VLMInputs(obs_space, "pi0")
        if p.path:
            self.model = load_pretrained(p.path)
        else:
            config = tiny_config(p, self.read.text_vocab, p.image_size or self.read.env_image_size, self.H, self.A,
                                 self.read.state_dim)
            self.model = PI0ForConditionalGeneration(config)
            if p.vlm_path:
                fresh = start_vlm(self.model.model.vlm, p.vlm_path, "policy.pi0.vlm_path")
                log.info("pi0's VLM starts from %s; random init: %s", p.vlm_path, ", ".join(fresh) or "none")
        c = self.model.config
        if c.chunk_size < self.H or c.max_action_dim < self.A or c.max_state_dim < self.read.state_dim:
            raise ValueError(f"the pi0 model makes chunks of {c.chunk_size}x{c.max_action_dim} from states of "
                             f"{c.max_state_dim}, but the env needs {self.H}x{self.A} from {self.read.state_dim}. "
                             f"Fix: env.action_chunk <= {c.chunk_size}, or a model with larger "
                             f"chunk_size/max_action_dim")
        vision = c.vlm_config.vision_config
        grid = vision.image_size // vision.patch_size
        self.read.bind(vision.image_size, (grid, grid), c.vlm_config.image_token_id,
                       c.vlm_config.text_config.vocab_size)
        if p.lora.rank:  # adapters on the attention of the VLM's language model, the expert or both
            from rlfabric.services.core.models.lm import with_lora

            scope = {"vlm": r"vlm\.language_model", "expert": r"dit", "both": r"(vlm\.language_model|dit)"}[p.lora_on]
            targets = rf".*model\.{scope}\.layers\.\d+\.self_attn\.({'|'.join(p.lora.targets)})"
            self.model = with_lora(self.model, p.lora, targets, train=("embed_action_time", "action_out_proj"))
        if p.freeze_vision:  # adapters on it included
            freeze(FAMILIES["paligemma"].image_encoder(self.pi0.model.vlm))
        self.value_head = VLMCritic(obs_space, cfg.cnn, p, c.vlm_config.text_config.hidden_size)

    @property
    def pi0(self):
        """The transformers model (inside peft's wrapper when LoRA is on)."""
        return unwrapped(self.model)

    # -- inputs and the prefix -----------------------------------------------------------------------------
    def inputs(self, obs: Any) -> dict[str, torch.Tensor]:
        """pi0's inputs from an observation batch (services/policies/vlm_inputs.py), the state zero-padded to the
        model's ``max_state_dim``."""
        return self.read(obs, self.pi0.config.max_state_dim)

    def prefix(self, x: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """The VLM over images and words, once: its KV cache (what every denoising step reads) and the masked mean
        of its last hidden states (the value head's input)."""
        pi0 = self.pi0.model
        embeds = pi0.embed_prefix(x["input_ids"], x["pixel_values"], x["pixel_attention_mask"])
        mask = x["attention_mask"]
        out = pi0.vlm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1,
                      token_type_ids=torch.zeros_like(mask), use_cache=True, return_dict=True)
        weights = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)
        pooled = (out.last_hidden_state * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return cache_of(out), pooled

    def velocity(self, x: torch.Tensor, tau: torch.Tensor, state: torch.Tensor, cache: Any,
                 mask: torch.Tensor) -> torch.Tensor:
        """Our velocity E[x1 - x0 | x_tau] for chunks x [N, H, A] at times tau [N]: pi0 runs time the other way
        (t = 1 - tau, its velocity points from chunk to noise), so it is the negated expert output. The expert's
        own tokens are appended to ``cache``; callers crop them off."""
        c = self.pi0.config
        noise = F.pad(x, (0, c.max_action_dim - self.A, 0, c.chunk_size - self.H))
        out = self.pi0(state=state, noise=noise, timestep=1.0 - tau, attention_mask=mask,
                       **{cache_arg(self.pi0): cache})
        return -out.logits[:, :self.H, :self.A]

    # -- actor-critic interface ----------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """A denoising chain [B, K+1, H, A] per observation, its log-prob and the value. The prefix runs once;
        each step's velocity gives both the step taken and its Flow-SDE mean, so scoring costs no extra call."""
        x_in = self.inputs(obs)
        cache, pooled = self.prefix(x_in)
        value = self.value_head(obs, pooled)
        B, K, device = pooled.shape[0], self.steps, pooled.device
        length = cache.get_seq_length()
        if deterministic:  # pi0's ODE from zero noise: plain transformers' sample_actions(noise=0)
            x = torch.zeros(B, self.H, self.A, device=device)
        else:
            x = torch.randn(B, self.H, self.A, generator=generator, device=device)
        chain, means = [x], []
        # noise on every step: the SDE's mean and step std; on the last step only: the ODE's mean and sigma itself
        sigma, std = (0.0, self.sigma) if self.noisy_last_only else (self.sigma, flow_sde.step_std(self.sigma, K))
        for k in range(K):
            tau = torch.full((B,), k / K, device=device)
            v = self.velocity(x, tau, x_in["state"], cache, x_in["attention_mask"])
            cache.crop(length - cache.get_seq_length())  # drop the expert's tokens (a negative crop)
            noisy = not deterministic and (k == K - 1 or not self.noisy_last_only)
            means.append(mu := flow_sde.step_mean(x, v, tau, sigma, K))
            if noisy:
                x = mu + std * torch.randn(mu.shape, generator=generator, device=device)
            else:
                x = flow_sde.step_mean(x, v, tau, 0.0, K)
            chain.append(x)
        chain_t = torch.stack(chain, 1)
        if self.noisy_last_only:
            logp = flow_sde.last_step_logp(chain_t[:, -1], means[-1], self.sigma)
        else:
            logp = flow_sde.chain_logp(chain_t, torch.stack(means, 1), self.sigma, K)
        return chain_t, self.reduce(logp), value

    def evaluate(self, obs: Any, actions: torch.Tensor):
        """Log-probs (at the configured level), entropies and values of recorded chains [B, K+1, H, A]: the prefix
        once, then all K steps of every row in one expert call over the cache repeated K times (noise on every
        step), or the K steps in turn from the recorded x_0 (noise on the last step: the earlier points depend on
        the weights)."""
        x_in = self.inputs(obs)
        cache, pooled = self.prefix(x_in)
        value = self.value_head(obs, pooled)
        B, K = pooled.shape[0], self.steps
        chain = actions.reshape(B, K + 1, self.H, self.A).float()
        if self.noisy_last_only:
            x = self.ode(x_in, cache, chain[:, 0], K)  # the last step's mean: the ODE's K steps
            logp = flow_sde.last_step_logp(chain[:, -1], x, self.sigma)
            entropy = torch.full_like(logp, flow_sde.last_step_entropy(self.sigma))
            return self.reduce(logp), self.reduce(entropy), value
        cache.batch_repeat_interleave(K)
        x = chain[:, :K].reshape(B * K, self.H, self.A)
        tau = (torch.arange(K, device=x.device, dtype=x.dtype) / K).repeat(B)
        v = self.velocity(x, tau, x_in["state"].repeat_interleave(K, 0), cache,
                          x_in["attention_mask"].repeat_interleave(K, 0))
        means = flow_sde.step_mean(x, v, tau, self.sigma, K).reshape(B, K, self.H, self.A)
        logp = flow_sde.chain_logp(chain, means, self.sigma, K)
        entropy = torch.full_like(logp, flow_sde.chain_entropy(self.sigma, K))
        return self.reduce(logp), self.reduce(entropy), value

    def ode(self, x_in: dict[str, torch.Tensor], cache: Any, x: torch.Tensor, steps: int) -> torch.Tensor:
        """The first ``steps`` Euler steps of the ODE from x [B, H, A] over the prefix's cache."""
        length, B, K = cache.get_seq_length(), x.shape[0], self.steps
        for k in range(steps):
            tau = torch.full((B,), k / K, device=x.device, dtype=x.dtype)
            v = self.velocity(x, tau, x_in["state"], cache, x_in["attention_mask"])
            cache.crop(length - cache.get_seq_length())  # drop the expert's tokens (a negative crop)
            x = flow_sde.step_mean(x, v, tau, 0.0, K)
        return x

    @torch.no_grad()
    def decode_noise(self, obs: Any, noise: torch.Tensor) -> torch.Tensor:
        """The chunk in [-1, 1] [B, H, A] pi0's ODE carries the initial noise [B, H*A] to (deterministic acting
        starts it from 0): what a latent-noise policy steers."""
        x_in = self.inputs(obs)
        cache, _ = self.prefix(x_in)
        x = noise.reshape(-1, self.H, self.A).to(x_in["state"].dtype)
        return self.ode(x_in, cache, x, self.steps).clamp(-1.0, 1.0)

    def value(self, obs: Any) -> torch.Tensor:
        if not self.value_head.reads_prefix:  # its own encoder: no VLM pass needed
            return self.value_head(obs)
        return self.value_head(obs, self.prefix(self.inputs(obs))[1])

    def imitation_loss(self, obs: Any, actions: torch.Tensor) -> torch.Tensor:
        """pi0's own flow-matching loss on demonstrated env actions [B, H, A] (supervised): mapped onto [-1, 1] and
        zero-padded as pi0 trains."""
        x_in = self.inputs(obs)
        c = self.pi0.config
        target = F.pad(self.to_unit(actions), (0, c.max_action_dim - self.A, 0, c.chunk_size - self.H))
        return self.pi0(actions=target, **x_in).loss

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """The chunk the env executes: the chain's last point, clipped to [-1, 1], mapped onto the bounds."""
        unit = actions[:, -1].clamp(-1.0, 1.0)
        return self.to_env(unit)

    def save_pretrained(self, directory: str) -> None:
        """The pi0 model alone (LoRA adapters folded in), loadable by plain transformers (the value head is ours,
        not pi0's)."""
        save_merged(self.model, directory)
