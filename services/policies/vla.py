"""VLAPolicy: a small vision-language-action policy built from config with random init, shaped like OpenVLA-OFT
and pi0: image patches (a ViT patch embedding), instruction tokens (the task's BPE ids) and proprioception become
tokens of one transformer trunk, and an action-chunk head reads it. It serves policy-gradient algorithms as an
actor-critic (``act``, ``evaluate``, ``value``), with a value head on the trunk's pooled context.

Image tokens come from a conv stem (``encoder: cnn``, three stride-2 convolutions, one token per 8x8 patch), a ViT's
linear patch embedding (``encoder: vit``), or a Nature-CNN over the whole image whose features become a few tokens
(``encoder: nature``, RT-1's compact image summary). Learning from RL rewards alone, the Nature-CNN summary finds a
few-pixel object far sooner than per-patch tokens do (docs/benchmarks.md has the figures).
With ``keypoints: K`` one more token carries a spatial softmax over K full-resolution feature maps (their expected
x, y positions), the keypoint encoder robot-learning policies use: where things are, readable in one token.

    tokens  each action dimension of each step of the chunk is a discrete token over ``bins`` bins; H*A learned
            query tokens join the sequence and are decoded in parallel (one forward pass, no autoregression)
    flow    a flow-matching action expert v(x, tau | context), integrated over K = ``flow_steps`` steps from noise
            to the chunk as a Flow-SDE, so every step is a Gaussian with a log-prob (the piRL method)

Flow-SDE (services/policies/flow_sde.py): each denoising step is a Gaussian, so the chain x_0..x_K is the raw
action the update re-scores. The env gets x_K clipped to the action bounds. Deterministic acting integrates the ODE
from x_0 = 0.

Log-prob levels (``logprob_level``): chunk -> one per decision [B]; action -> one per step of the chunk [B, H];
token -> one per action dimension [B, H, A]. An update broadcasts a decision's advantage over them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models.encoders import CNN, is_image
from rlfabric.services.policies import flow_sde
from rlfabric.services.policies.chunk_policy import ChunkPolicy


class VLAPolicy(ChunkPolicy):
    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        v = cfg.vla
        self.init_chunks(action_space, "vla", v.logprob_level)
        self.head = v.head
        self._inputs(obs_space, v, cfg)
        layer = nn.TransformerEncoderLayer(v.width, v.heads, 4 * v.width, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.trunk = nn.TransformerEncoder(layer, v.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(v.width)
        self.cls = nn.Parameter(torch.zeros(1, 1, v.width))
        value_in = v.width + (self.image_cnn.out_dim if self.image_cnn is not None else 0)
        self.value_head = nn.Sequential(nn.Linear(value_in, v.width), nn.Tanh(), nn.Linear(v.width, 1))
        if self.head == "tokens":
            self.bins = v.bins
            self.queries = nn.Parameter(0.02 * torch.randn(1, self.act_dim, v.width))
            self.bin_head = nn.Linear(v.width, v.bins)
            nn.init.zeros_(self.bin_head.weight)  # uniform over bins at init: maximal exploration
            nn.init.zeros_(self.bin_head.bias)
            self.register_buffer("centers", torch.linspace(-1.0, 1.0, v.bins))
        else:
            self.steps, self.sigma = v.flow_steps, v.flow_noise
            hidden = 4 * v.width
            self.expert = nn.Sequential(nn.Linear(self.act_dim + v.width + 32, hidden), nn.GELU(),
                                        nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, self.act_dim))
            nn.init.zeros_(self.expert[-1].weight)
            nn.init.zeros_(self.expert[-1].bias)

    def _inputs(self, space: dict[str, Any], v: Any, cfg: Any) -> None:
        """Token embeddings of each observation entry: an image (see ``_image_inputs``), an instruction's ids (an
        int64 Box named ``instruction``; 0 pads), the rest flattened into one proprioception token."""
        spaces = space["spaces"] if space["kind"] == "dict" else {"image" if is_image(space) else "state": space}
        self.image_key = next((k for k, s in sorted(spaces.items()) if is_image(s)), None)
        self.text_key = "instruction" if "instruction" in spaces else None
        self.state_keys = sorted(k for k in spaces if k not in (self.image_key, self.text_key))
        self.dict_obs = space["kind"] == "dict"
        self.image_cnn: CNN | None = None
        self.keypoints = 0
        if self.image_key is not None:
            self._image_inputs(spaces[self.image_key], v, cfg)
        if self.text_key is not None:
            s = spaces[self.text_key]
            self.vocab = int(np.max(s["high"])) + 1
            self.embed = nn.Embedding(self.vocab, v.width, padding_idx=0)
            self.text_pos = nn.Parameter(0.02 * torch.randn(1, s["shape"][0], v.width))
        n = sum(int(np.prod(spaces[k]["shape"])) if spaces[k]["shape"] else 1 for k in self.state_keys)
        self.state_proj = nn.Linear(n, v.width) if n else None

    def _image_inputs(self, space: dict[str, Any], v: Any, cfg: Any) -> None:
        """The image's tokens: a Nature-CNN summary (``image_tokens`` tokens), or one token per patch (a conv stem
        or a ViT patch embedding), optionally with a keypoint token."""
        shape = list(space["shape"])
        self.channels_last = shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4)
        c, h, w = (shape[2], shape[0], shape[1]) if self.channels_last else shape
        if v.encoder == "nature":
            self.image_cnn = CNN(space, cfg.cnn, activation="relu")
            self.image_proj = nn.Linear(self.image_cnn.out_dim, v.image_tokens * v.width)
            self.image_pos = nn.Parameter(0.02 * torch.randn(1, v.image_tokens, v.width))
            for m in self.image_cnn.modules():  # orthogonal sqrt(2), as the CNN actor-critic that learns it
                if isinstance(m, nn.Linear | nn.Conv2d):
                    nn.init.orthogonal_(m.weight, math.sqrt(2))
                    nn.init.zeros_(m.bias)
            return
        if h % v.patch or w % v.patch:
            raise ValueError(f"policy.vla.patch={v.patch} does not divide the {h}x{w} image; pick a divisor")
        if v.encoder == "vit":
            self.patchify = nn.Conv2d(c, v.width, v.patch, v.patch)
        else:  # a conv stem: localises small objects with far fewer samples than a linear patch embedding
            if v.patch != 8:
                raise ValueError(f"policy.vla.encoder=cnn makes 8x8-pixel tokens; set policy.vla.patch: 8 (got "
                                 f"{v.patch}) or encoder: vit")
            self.patchify = nn.Sequential(nn.Conv2d(c, 16, 3, 2, 1), nn.GELU(), nn.Conv2d(16, 32, 3, 2, 1),
                                          nn.GELU(), nn.Conv2d(32, v.width, 3, 2, 1))
        self.keypoints = v.keypoints
        if self.keypoints:
            self.keypoint_conv = nn.Conv2d(c, self.keypoints, 5, 1, 2)
            self.keypoint_proj = nn.Linear(2 * self.keypoints, v.width)
            self.register_buffer("grid_x", torch.linspace(-1.0, 1.0, w).repeat(h))
            self.register_buffer("grid_y", torch.linspace(-1.0, 1.0, h).repeat_interleave(w))
        self.image_pos = nn.Parameter(0.02 * torch.randn(1, (h // v.patch) * (w // v.patch), v.width))

    # -- trunk ---------------------------------------------------------------------------------------------
    def _tokens(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        parts: dict[str, torch.Tensor] = obs if self.dict_obs else {self.image_key or "state": obs}
        B = next(iter(parts.values())).shape[0]
        tokens = [self.cls.expand(B, -1, -1)]
        pads = [torch.zeros(B, 1, dtype=torch.bool, device=self.cls.device)]  # True where a token is padding
        feats = None
        if self.image_key is not None:
            first = len(tokens)
            if self.image_cnn is not None:  # the CNN scales and permutes the uint8 image itself
                feats = self.image_cnn(parts[self.image_key])
                tokens.append(self.image_proj(feats).reshape(B, self.image_pos.shape[1], -1) + self.image_pos)
            else:
                x = parts[self.image_key].float() / 255.0 - 0.5
                if self.channels_last:
                    x = x.permute(0, 3, 1, 2)
                tokens.append(self.patchify(x).flatten(2).transpose(1, 2) + self.image_pos)
                if self.keypoints:
                    tokens.append(self.keypoint_proj(self._keypoints(x)).unsqueeze(1))
            pads.append(torch.zeros(B, sum(t.shape[1] for t in tokens[first:]), dtype=torch.bool,
                                    device=self.cls.device))
        if self.text_key is not None:
            ids = parts[self.text_key].long().clamp(0, self.vocab - 1)
            tokens.append(self.embed(ids) + self.text_pos)
            pads.append(ids == 0)
        if self.state_proj is not None:
            state = torch.cat([parts[k].reshape(B, -1).float() for k in self.state_keys], -1)
            tokens.append(self.state_proj(state).unsqueeze(1))
            pads.append(pads[0])
        return torch.cat(tokens, 1), torch.cat(pads, 1), feats

    def _keypoints(self, image: torch.Tensor) -> torch.Tensor:
        """Spatial softmax: for each of K feature maps, the softmax-weighted mean pixel position -> [B, 2K]."""
        attention = torch.softmax(self.keypoint_conv(image).flatten(2), -1)  # [B, K, H*W]
        return torch.cat([attention @ self.grid_x, attention @ self.grid_y], -1)

    def _run(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(pooled context [B, W], the action queries' outputs [B, H*A, W] for the tokens head, the value head's
        input: the context, and with a Nature-CNN image encoder its features too, as an actor-critic's critic
        reads its encoder)."""
        x, pad, feats = self._tokens(obs)
        if self.head == "tokens":
            B = x.shape[0]
            x = torch.cat([x, self.queries.expand(B, -1, -1)], 1)
            pad = torch.cat([pad, torch.zeros(B, self.act_dim, dtype=torch.bool, device=x.device)], 1)
        y = self.norm(self.trunk(x, src_key_padding_mask=pad))
        value_in = y[:, 0] if feats is None else torch.cat([y[:, 0], feats], -1)
        return y[:, 0], (y[:, -self.act_dim:] if self.head == "tokens" else None), value_in

    # -- the flow expert -----------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, tau: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """v(x, tau | context) for flat chunks x [N, H*A] at times tau [N]."""
        freqs = torch.exp(torch.linspace(0.0, math.log(1000.0), 16, device=x.device))
        angles = tau[:, None] * freqs[None]
        return self.expert(torch.cat([x, context, angles.sin(), angles.cos()], -1))

    def step_mean(self, x: torch.Tensor, k: int | torch.Tensor, context: torch.Tensor,
                  sigma: float | None = None) -> torch.Tensor:
        """mu_k: the mean of the Flow-SDE step from x_k (with sigma 0: the ODE's Euler step)."""
        sigma = self.sigma if sigma is None else sigma
        tau = (torch.as_tensor(k, device=x.device, dtype=x.dtype) / self.steps).expand(x.shape[0])
        return flow_sde.step_mean(x, self.velocity(x, tau, context), tau, sigma, self.steps)

    def _chain_logp(self, chain: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Per-token log-prob [B, H, A] of a denoising chain [B, K+1, H, A]: all K steps in one expert call."""
        B, K = chain.shape[0], self.steps
        x = chain[:, :K].reshape(B * K, self.act_dim)
        k = torch.arange(K, device=chain.device).repeat(B)
        mu = self.step_mean(x, k, context.repeat_interleave(K, 0)).reshape(B, K, self.H, self.A)
        return flow_sde.chain_logp(chain, mu, self.sigma, K)

    # -- actor-critic interface ----------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        context, queries, value_in = self._run(obs)
        value = self.value_head(value_in).squeeze(-1)
        B = context.shape[0]
        if self.head == "tokens":
            log_probs = torch.log_softmax(self.bin_head(queries), -1)  # [B, H*A, bins]
            if deterministic:
                idx = log_probs.argmax(-1)
            else:
                idx = torch.multinomial(log_probs.exp().reshape(-1, self.bins), 1, generator=generator)
                idx = idx.reshape(B, self.act_dim)
            logp = log_probs.gather(-1, idx.unsqueeze(-1)).reshape(B, self.H, self.A)
            return idx.reshape(B, self.H, self.A), self.reduce(logp), value
        if deterministic:  # the ODE from x_0 = 0
            x = torch.zeros(B, self.act_dim, device=context.device)
            chain = [x]
            for k in range(self.steps):
                chain.append(x := self.step_mean(x, k, context, sigma=0.0))
        else:
            std = flow_sde.step_std(self.sigma, self.steps)
            x = torch.randn(B, self.act_dim, generator=generator, device=context.device)
            chain = [x]
            for k in range(self.steps):
                mu = self.step_mean(x, k, context)
                chain.append(x := mu + std * torch.randn(mu.shape, generator=generator, device=mu.device))
        chain_t = torch.stack(chain, 1).reshape(B, self.steps + 1, self.H, self.A)
        return chain_t, self.reduce(self._chain_logp(chain_t, context)), value

    def evaluate(self, obs: Any, actions: torch.Tensor):
        """Log-probs (at the configured level), entropies (same shape) and values of recorded raw actions: bin
        ids [B, H, A] for the tokens head, denoising chains [B, K+1, H, A] for the flow head."""
        context, queries, value_in = self._run(obs)
        value = self.value_head(value_in).squeeze(-1)
        B = context.shape[0]
        if self.head == "tokens":
            log_probs = torch.log_softmax(self.bin_head(queries), -1)
            logp = log_probs.gather(-1, actions.reshape(B, self.act_dim, 1).long()).reshape(B, self.H, self.A)
            entropy = -(log_probs.exp() * log_probs).sum(-1).reshape(B, self.H, self.A)
            return self.reduce(logp), self.reduce(entropy), value
        logp = self._chain_logp(actions.reshape(B, self.steps + 1, self.H, self.A), context)
        entropy = torch.full_like(logp, flow_sde.chain_entropy(self.sigma, self.steps))
        return self.reduce(logp), self.reduce(entropy), value

    @torch.no_grad()
    def decode_noise(self, obs: Any, noise: torch.Tensor) -> torch.Tensor:
        """Flow head: the chunk in [-1, 1] [B, H, A] the ODE carries the initial noise [B, H*A] to (deterministic
        acting starts it from 0): what a latent-noise policy steers."""
        if self.head != "flow":
            raise ValueError("policy.vla.head=tokens has no initial noise to steer; set policy.vla.head: flow")
        context = self._run(obs)[0]
        x = noise.reshape(context.shape[0], self.act_dim).to(context.dtype)
        for k in range(self.steps):
            x = self.step_mean(x, k, context, sigma=0.0)
        return x.clamp(-1.0, 1.0).reshape(-1, self.H, self.A)

    def imitation_loss(self, obs: Any, actions: torch.Tensor) -> torch.Tensor:
        """Imitation of demonstrated env actions [B, H, A]: the cross-entropy of each dimension's nearest bin (tokens
        head), or flow matching toward the chunk in [-1, 1] (flow head: x_tau = (1 - tau) noise + tau chunk,
        target velocity chunk - noise)."""
        context, queries, _ = self._run(obs)
        B = context.shape[0]
        unit = self.to_unit(actions)
        if self.head == "tokens":
            target = torch.round((unit + 1.0) * 0.5 * (self.bins - 1)).long().reshape(B * self.act_dim)
            return nn.functional.cross_entropy(self.bin_head(queries).reshape(B * self.act_dim, self.bins), target)
        x1 = unit.reshape(B, self.act_dim)
        x0 = torch.randn_like(x1)
        tau = torch.rand(B, device=x1.device)
        x = (1 - tau[:, None]) * x0 + tau[:, None] * x1
        return (self.velocity(x, tau, context) - (x1 - x0)).pow(2).mean()

    def value(self, obs: Any) -> torch.Tensor:
        return self.value_head(self._run(obs)[2]).squeeze(-1)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """The chunk the env executes: bin centres, or the chain's last point, mapped from [-1, 1] onto bounds."""
        if self.head == "tokens":
            unit = self.centers[actions.long()]
        else:
            unit = actions[:, -1].clamp(-1.0, 1.0)
        return self.to_env(unit)
