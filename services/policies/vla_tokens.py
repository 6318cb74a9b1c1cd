"""VLATokensPolicy (``policy.name: vla_tokens``): an OpenVLA-style policy on a transformers image-text-to-text VLM
(PaliGemma, SmolVLM or Qwen2.5-VL: services/policies/vlm_families.py): each action dimension of each step of the
chunk is one token, ``bins`` bins over [low, high] mapped onto the vocabulary's last ids, as OpenVLA maps its 256
bins.

    prefix   the camera images (SigLIP), the instruction's ids and one proprioception embedding (a linear
             projection, as OFT feeds proprio), attended as the family attends (both ways in PaliGemma's prefix)
    tokens   autoregressive: H*A action tokens decoded one by one with the prefix's KV cache (OpenVLA); or
             parallel: H*A learned action queries appended to the prefix, decoded in one forward pass (OFT)

Log-probs are the bins' log-softmax at each action position (the VLM's own LM head, restricted to the bin ids), per
token, action or chunk. The learner re-scores a chunk teacher-forced in one pass. A value head reads the masked
mean of the prefix's last hidden states. Imitation is the bins' cross-entropy (OpenVLA's training), against
the nearest bin or against a Gaussian over the bins around the demonstrated action (``imitation_sigma``),
which leaves RL nearby actions to explore. RL may sample at a ``temperature`` above 1 to explore; the learner
scores at the same one, so the policy it improves is the one that acted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlfabric.services.core.models.hf_cache import cache_of
from rlfabric.services.policies.chunk_policy import ChunkPolicy
from rlfabric.services.policies.obs_critic import VLMCritic
from rlfabric.services.policies.vlm_body import VLMBody, build_vlm
from rlfabric.services.policies.vlm_inputs import VLMInputs, save_merged


class VLATokensPolicy(ChunkPolicy, VLMBody):
    critic_only_privileged = True  # VLMInputs skips an env's privileged entries; critic: own reads them

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        v = cfg.vla_tokens
        self.init_chunks(action_space, "vla_tokens", v.logprob_level)
        self.n = self.H * self.A
        self.bins, self.parallel, self.temperature = v.bins, v.parallel, v.temperature
        self.imitation_sigma = v.imitation_sigma
        self.read = VLMInputs(obs_space, "vla_tokens")
        # tiny: the env's instruction ids, then the bins (the vocabulary's last ids)
        self.model, self.family = build_vlm(v, self.read, self.read.text_vocab + v.bins, "policy.vla_tokens")
        c = self.model.config
        vocab = c.text_config.vocab_size
        if vocab < self.read.text_vocab + v.bins:
            raise ValueError(f"the VLM's vocabulary ({vocab} ids) cannot hold the instruction's {self.read.text_vocab} "
                             f"ids and policy.vla_tokens.bins={v.bins} action bins after them. Fix: fewer bins")
        if v.lora.rank:
            from rlfabric.services.core.models.lm import with_lora

            self.model = with_lora(self.model, v.lora)
        self.freeze_vision(v)
        self.register_buffer("bin_ids", torch.arange(vocab - v.bins, vocab))
        self.register_buffer("centers", torch.linspace(-1.0, 1.0, v.bins))
        width = c.text_config.hidden_size
        self.state_proj = nn.Linear(max(self.read.state_dim, 1), width)
        if self.parallel:
            self.queries = nn.Parameter(0.02 * torch.randn(1, self.n, width))
        self.value_head = VLMCritic(obs_space, cfg.cnn, v, width)

    # -- the VLM (the prefix and its runs: VLMBody) ---------------------------------------------------------
    def _bin_logits(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log-softmax over the bins (the LM head's rows of the bin ids) at each hidden state [..., W], the logits
        divided by ``temperature``."""
        weight = self.vlm.lm_head.weight[self.bin_ids]
        return torch.log_softmax(hidden @ weight.T / temperature, -1)

    def _score(self, obs: Any, bins: torch.Tensor | None, temperature: float = 1.0):
        """Bin log-probs [B, n, bins] of every action position at ``temperature`` and the value, teacher-forced on
        ``bins`` [B, n] (autoregressive) or from the action queries (parallel, ``bins`` unused): one forward pass."""
        emb, mask = self._prefix(obs)
        B, P = mask.shape
        if self.parallel:
            emb = torch.cat([emb, self.queries.expand(B, -1, -1)], 1)
            mask = torch.cat([mask, mask.new_ones(B, self.n)], 1)
            out = self._lm(emb, mask, self._positions(mask), None)
            hidden = out.last_hidden_state[:, P:]
        else:  # the last prefix position predicts token 1, token i predicts token i + 1
            emb = torch.cat([emb, self._embed(self.bin_ids[bins[:, :-1]])], 1)
            mask = torch.cat([mask, mask.new_ones(B, self.n - 1)], 1)
            out = self._run(emb, mask, P)
            hidden = out.last_hidden_state[:, P - 1:]
        value = self.value_head(obs, self._pooled(out.last_hidden_state, mask, P))
        return self._bin_logits(hidden, temperature), value

    # -- actor-critic interface ----------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """Bin ids [B, H, A], their log-probs (at ``temperature``) and the value: parallel in one pass, or token by
        token with the prefix's KV cache."""
        if self.parallel:
            log_probs, value = self._score(obs, None, self.temperature)
            idx = log_probs.argmax(-1) if deterministic else torch.multinomial(
                log_probs.exp().reshape(-1, self.bins), 1, generator=generator).reshape(log_probs.shape[:2])
            logp = log_probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
            return idx.reshape(-1, self.H, self.A), self.reduce(logp.reshape(-1, self.H, self.A)), value
        emb, mask = self._prefix(obs)
        B, P = mask.shape
        out = self._run(emb, mask, P, use_cache=True)
        value = self.value_head(obs, self._pooled(out.last_hidden_state, mask, P))
        cache, hidden = cache_of(out), out.last_hidden_state[:, -1]
        position = self._positions(mask)[:, -1]
        chosen, logps = [], []
        for i in range(self.n):
            log_probs = self._bin_logits(hidden, self.temperature)
            idx = log_probs.argmax(-1) if deterministic else torch.multinomial(log_probs.exp(), 1,
                                                                               generator=generator).squeeze(-1)
            chosen.append(idx)
            logps.append(log_probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1))
            if i + 1 < self.n:
                mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
                position = position + 1
                out = self._run(self._embed(self.bin_ids[idx]).unsqueeze(1), mask, P, cache, position)
                cache, hidden = cache_of(out), out.last_hidden_state[:, -1]
        idx = torch.stack(chosen, 1).reshape(B, self.H, self.A)
        return idx, self.reduce(torch.stack(logps, 1).reshape(B, self.H, self.A)), value

    def evaluate(self, obs: Any, actions: torch.Tensor):
        """Log-probs, entropies (at the configured level) and values of recorded bin ids [B, H, A]."""
        B = actions.shape[0]
        bins = actions.reshape(B, self.n).long()
        log_probs, value = self._score(obs, bins, self.temperature)
        logp = log_probs.gather(-1, bins.unsqueeze(-1)).squeeze(-1).reshape(B, self.H, self.A)
        entropy = -(log_probs.exp() * log_probs).sum(-1).reshape(B, self.H, self.A)
        return self.reduce(logp), self.reduce(entropy), value

    def value(self, obs: Any) -> torch.Tensor:
        if not self.value_head.reads_prefix:  # its own encoder: no VLM pass needed
            return self.value_head(obs)
        if self.parallel:  # the prefix attends to the action queries too: the value is the one pass's
            return self._score(obs, None)[1]
        emb, mask = self._prefix(obs)
        out = self._run(emb, mask, mask.shape[1])
        return self.value_head(obs, self._pooled(out.last_hidden_state, mask, mask.shape[1]))

    def imitation_loss(self, obs: Any, actions: torch.Tensor) -> torch.Tensor:
        """The bins' cross-entropy of demonstrated env actions [B, H, A], teacher-forced on their nearest
        bins: against those bins (one-hot), or against a Gaussian over the bins centred on each action,
        ``imitation_sigma`` bins wide."""
        B = actions.shape[0]
        unit = self.to_unit(actions).reshape(B, self.n)
        bins = torch.round((unit + 1.0) * 0.5 * (self.bins - 1)).long()
        log_probs, _ = self._score(obs, bins)
        if not self.imitation_sigma:
            return F.nll_loss(log_probs.reshape(B * self.n, self.bins), bins.reshape(-1))
        spacing = 2.0 / (self.bins - 1)
        distance = (self.centers - unit.unsqueeze(-1)) / (spacing * self.imitation_sigma)  # [B, n, bins]
        target = torch.softmax(-0.5 * distance.square(), -1)
        return -(target * log_probs).sum(-1).mean()

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Bin centres mapped from [-1, 1] onto the bounds."""
        unit = self.centers[actions.long()]
        return self.to_env(unit)

    def save_pretrained(self, directory: str) -> None:
        """The VLM alone (LoRA adapters folded in), loadable by plain transformers (the proprio projection and the
        value head are ours)."""
        save_merged(self.model, directory)
