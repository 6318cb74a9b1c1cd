"""Grounding pretraining of a VLM policy's image encoder (``warm_start.vision``): before any imitation, the SigLIP
encoder learns to say where things are. A linear read-out of all its tokens (every camera's) regresses the scene
state the env reports (``scene_state()``: ArmReach's ball positions; privileged, as a scripted expert's actions
are), and the encoder, saved as a SigLIP vision model, starts the policy's (``policy.pi0.vlm_path``).

Why: on ArmReachLang, pi0 imitating the expert from pixels stalls near 0.3 success, and its flow loss leaves a tiny
SigLIP no better at locating the balls than it started (an MLP on its frozen tokens: 13 cm median error; at random
init 10 cm). This regression gets ~1 cm in 3,000 steps (under a minute on 2 cores), and pi0 imitating over it with
the encoder frozen (``freeze_vision``) succeeds about twice as often (docs/benchmarks.md). Captioning the positions
as text (next-token training of the VLM) taught the same encoder little in as many steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models.encoders import is_image
from rlfabric.services.policies.vlm_inputs import siglip_paligemma_config, to_pixels


def scenes(envs: Any, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` scenes of a one-env vector env (seeds ``seed``, ``seed + 1``, ...): its camera images [N, C, H,
    W, 3] (every uint8 image entry, by name) and its ``scene_state()`` [N, D]."""
    from rlfabric.services.env.adapters.gymnasium import describe_space

    spaces = describe_space(envs.single_observation_space)
    keys = sorted(k for k, v in spaces["spaces"].items() if is_image(v)) if spaces["kind"] == "dict" else \
        ([None] if is_image(spaces) else [])
    if not keys:
        raise ValueError("the env gives no camera images (uint8 [H, W, 3] observations) to pretrain an image "
                         "encoder on. Fix: an env with pixel observations, or no warm_start.vision")
    images, states = [], []
    for k in range(count):
        obs, _ = envs.reset(seed=seed + k)
        try:
            state = envs.call("scene_state")[0]
        except AttributeError:
            raise ValueError("the env has no scene_state() saying where things are (ArmReach's: the balls' "
                             "positions). Fix: an env that reports its scene, or no warm_start.vision") from None
        images.append(np.stack([np.asarray(obs if key is None else obs[key])[0] for key in keys]))
        states.append(np.asarray(state, np.float32).reshape(-1))
    return np.stack(images), np.stack(states)


def encoder(sizes: Any, image_size: int, seed: int):
    """A random SigLIP vision model of a policy section's sizes: the same config as the VLM the policy builds,
    its initial weights drawn from ``seed``. Unseeded, a run's vision stage (and every stage after it) would
    differ from the same spec's last run: its held-out success moved by 0.03 between two runs of seed 0."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = siglip_paligemma_config(sizes, 2, image_size)["vision_config"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SiglipVisionModel(SiglipVisionConfig(**{k: v for k, v in config.items() if k != "model_type"}))


def pretrain(model: Any, images: np.ndarray, targets: np.ndarray, updates: int, batch_size: int,
             learning_rate: float, seed: int, heldout: float = 0.1,
             progress: Callable[[int, float], None] | None = None) -> list[dict[str, float]]:
    """Trains ``model`` (a SigLIP vision model) and a linear read-out of its tokens to regress ``targets`` from
    ``images`` (uint8 [N, C, H, W, 3]). Rows past ``1 - heldout`` of the scenes are held out: every tenth of the
    run logs the training loss and the held-out root-mean-square error per target (in the targets' units)."""
    torch.manual_seed(seed)
    size = model.config.image_size
    n, cams = images.shape[:2]
    split = max(1, int(round(n * (1 - heldout))))
    if split >= n:
        raise ValueError(f"warm_start.vision.scenes={n} leaves no held-out scene. Fix: at least 10 scenes")
    device = next(model.parameters()).device
    x = to_pixels(torch.as_tensor(images, device=device).flatten(0, 1), size).reshape(n, cams, 3, size, size)
    y = torch.as_tensor(targets, dtype=torch.float32, device=device)
    grid = size // model.config.patch_size
    head = nn.Linear(cams * grid * grid * model.config.hidden_size, y.shape[1]).to(device)

    def predict(batch: torch.Tensor) -> torch.Tensor:
        tokens = model(pixel_values=batch.flatten(0, 1)).last_hidden_state
        return head(tokens.reshape(batch.shape[0], -1))

    def heldout_rmse() -> float:
        with torch.no_grad():
            err = torch.cat([predict(x[i:i + 256]) - y[i:i + 256] for i in range(split, n, 256)])
        return float(err.pow(2).mean().sqrt())

    optimizer = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=learning_rate)
    log = [{"update": 0, "loss": float("nan"), "heldout_rmse": heldout_rmse()}]
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(1, updates + 1):
        idx = torch.randint(split, (batch_size,), generator=generator, device="cpu").to(device)
        loss = (predict(x[idx]) - y[idx]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % max(1, updates // 10) == 0 or step == updates:
            log.append({"update": step, "loss": sum(losses) / len(losses), "heldout_rmse": heldout_rmse()})
            losses = []
            if progress is not None:
                progress(step, log[-1]["heldout_rmse"])
    return log
