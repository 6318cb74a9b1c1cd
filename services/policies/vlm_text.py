"""VLMTextPolicy (``policy.name: vlm``): a transformers image-text-to-text VLM (PaliGemma, SmolVLM or Qwen2.5-VL)
that writes text about its images, as an actor-critic over token sequences. Supervised training of a VLM is its
imitation loss on demonstrated texts; RL scores whole texts.

    prefix   the images (SigLIP), the prompt's ids (the env's ``instruction`` entry) and the proprioception token
             when the env has state, attended as the family attends (services/policies/vlm_body.py)
    text     L tokens decoded one by one with the prefix's KV cache; id 0 ends the text (every later position is
             0 and carries no log-prob)

An action is the text's ids [L] (an integer Box: ``env.adapter: captions`` gives one), in the env's vocabulary,
which is the VLM's: the ids feed its embedding and its LM head's rows score them, as the prompt's ids do. The
log-prob of a text is the sum over its live tokens (those up to and including the ending 0); imitation is the mean
cross-entropy over them (next-token training, teacher-forced in one pass).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models.hf_cache import cache_of
from rlfabric.services.policies.obs_critic import VLMCritic
from rlfabric.services.policies.vlm_body import VLMBody, build_vlm
from rlfabric.services.policies.vlm_inputs import VLMInputs, save_merged


def live_tokens(ids: torch.Tensor) -> torch.Tensor:
    """[B, L] 1.0 up to and including each row's first 0 (the end), 0.0 after it."""
    before = torch.cumprod((ids != 0).long(), -1)
    return torch.cat([torch.ones_like(before[:, :1]), before[:, :-1]], -1).float()


class VLMTextPolicy(VLMBody):
    has_value = True
    serves = "actor_critic"
    discrete = False

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        p = cfg.vlm
        shape = list(action_space.get("shape", []))
        if action_space["kind"] != "box" or not str(action_space.get("dtype", "")).startswith("int") or \
                len(shape) != 1:
            raise ValueError(f"policy.name=vlm writes text: the env's actions must be token ids, an integer Box [L] "
                             f"(env.adapter: captions gives one), not {action_space['kind']} "
                             f"{action_space.get('dtype')} {shape}")
        self.L = shape[0]
        self.V = int(np.max(action_space["high"])) + 1
        self.read = VLMInputs(obs_space, "vlm")
        vocab = max(self.read.text_vocab, self.V)
        self.model, self.family = build_vlm(p, self.read, vocab, "policy.vlm")
        c = self.model.config
        if c.text_config.vocab_size < vocab:
            raise ValueError(f"the VLM's vocabulary ({c.text_config.vocab_size} ids) cannot hold the env's {vocab} "
                             f"text ids. Fix: a model whose tokenizer the env's ids come from")
        if p.lora.rank:
            from rlfabric.services.core.models.lm import with_lora

            self.model = with_lora(self.model, p.lora)
        self.freeze_vision(p)
        width = c.text_config.hidden_size
        self.state_proj = nn.Linear(max(self.read.state_dim, 1), width)
        self.value_head = VLMCritic(obs_space, cfg.cnn, p, width)

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """log-softmax over the env's text ids (the LM head's first V rows) at each hidden state [..., W]."""
        return torch.log_softmax(hidden @ self.vlm.lm_head.weight[:self.V].T, -1)

    def _score(self, obs: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B, L, V] of every position, teacher-forced on ``ids`` [B, L], and the value: one pass."""
        emb, mask = self._prefix(obs)
        B, P = mask.shape
        emb = torch.cat([emb, self._embed(ids[:, :-1])], 1)  # the last prefix position predicts token 1
        mask = torch.cat([mask, mask.new_ones(B, self.L - 1)], 1)
        out = self._run(emb, mask, P)
        value = self.value_head(obs, self._pooled(out.last_hidden_state, mask, P))
        return self._log_probs(out.last_hidden_state[:, P - 1:]), value

    # -- actor-critic interface ----------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """Texts [B, L] decoded with the prefix's KV cache (greedy when deterministic), their log-probs [B] and
        the value."""
        emb, mask = self._prefix(obs)
        B, P = mask.shape
        out = self._run(emb, mask, P, use_cache=True)
        value = self.value_head(obs, self._pooled(out.last_hidden_state, mask, P))
        cache, hidden, position = cache_of(out), out.last_hidden_state[:, -1], self._positions(mask)[:, -1]
        alive = torch.ones(B, dtype=torch.bool, device=emb.device)
        ids = torch.zeros(B, self.L, dtype=torch.long, device=emb.device)
        logp = torch.zeros(B, device=emb.device)
        for i in range(self.L):
            log_probs = self._log_probs(hidden)
            idx = log_probs.argmax(-1) if deterministic else torch.multinomial(
                log_probs.exp(), 1, generator=generator).squeeze(-1)
            idx = torch.where(alive, idx, torch.zeros_like(idx))
            logp = logp + torch.where(alive, log_probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
            ids[:, i] = idx
            alive = alive & (idx != 0)
            if i + 1 == self.L or not alive.any():
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            position = position + 1
            out = self._run(self._embed(idx).unsqueeze(1), mask, P, cache, position)
            cache, hidden = cache_of(out), out.last_hidden_state[:, -1]
        return ids, logp, value

    def evaluate(self, obs: Any, actions: torch.Tensor):
        """Log-probs [B], entropies [B] (summed over live tokens) and values of recorded texts [B, L]."""
        ids = actions.long()
        log_probs, value = self._score(obs, ids)
        live = live_tokens(ids)
        logp = (log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * live).sum(-1)
        entropy = (-(log_probs.exp() * log_probs).sum(-1) * live).sum(-1)
        return logp, entropy, value

    def value(self, obs: Any) -> torch.Tensor:
        if not self.value_head.reads_prefix:
            return self.value_head(obs)
        emb, mask = self._prefix(obs)
        out = self._run(emb, mask, mask.shape[1])
        return self.value_head(obs, self._pooled(out.last_hidden_state, mask, mask.shape[1]))

    def imitation_loss(self, obs: Any, actions: torch.Tensor) -> torch.Tensor:
        """Next-token training: the mean cross-entropy of demonstrated texts [B, L] over their live tokens."""
        ids = actions.long()
        log_probs, _ = self._score(obs, ids)
        live = live_tokens(ids)
        return -(log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * live).sum() / live.sum().clamp(min=1.0)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        return actions.long().cpu().numpy()

    def random_actions(self, n: int, generator: torch.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``n`` texts of uniformly drawn ids (``rlfabric collect --random``)."""
        ids = torch.randint(0, self.V, (n, self.L), generator=generator,
                            device=generator.device if generator is not None else "cpu").cpu().numpy()
        return ids, ids

    def save_pretrained(self, directory: str) -> None:
        """The VLM alone (LoRA adapters folded in), loadable by plain transformers."""
        save_merged(self.model, directory)
