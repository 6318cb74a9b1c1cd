"""MiniGrid adapter: grid worlds (MiniGrid, BabyAI) observed as RGB pixels, rendered on the CPU by MiniGrid's own
numpy renderer (no display, no GL). Observations are uint8 images ``[H, W, 3]``: the whole grid (``view: full``,
``tile_size`` pixels per cell) or the agent's egocentric 7x7 view (``view: partial``).

    env: {adapter: minigrid, id: MiniGrid-Empty-5x5-v0, options: {tile_size: 8, view: full}}

Needs the ``minigrid`` package (pip install -e '.[pixels]').
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from rlfabric.services.env.adapters.gymnasium import check_env_id, vectorize

collector = "gym"  # rollout.collector auto: gym stepping
OPTIONS = {"tile_size": int, "view": str}


def _import() -> Any:
    try:
        import minigrid  # noqa: F401  (registers the MiniGrid and BabyAI ids)
        from minigrid import wrappers
    except ImportError as exc:
        raise ValueError("env.adapter minigrid needs the minigrid package. Fix: pip install -e '.[pixels]'") from exc
    return wrappers


def check(env_cfg: Any) -> None:
    _import()
    check_env_id(env_cfg.id)
    unknown = sorted(set(env_cfg.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"env.options {unknown} are not minigrid options; use {sorted(OPTIONS)}")
    tile = env_cfg.options.get("tile_size", 8)
    if not isinstance(tile, int) or not 1 <= tile <= 32:
        raise ValueError(f"env.options.tile_size={tile!r}: pixels per grid cell, an integer in [1, 32]")
    if env_cfg.options.get("view", "full") not in ("full", "partial"):
        raise ValueError(f"env.options.view={env_cfg.options['view']!r}: use full (the whole grid) or partial")


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    wrappers = _import()
    tile = env_cfg.options.get("tile_size", 8)
    pixels = wrappers.RGBImgObsWrapper if env_cfg.options.get("view", "full") == "full" \
        else wrappers.RGBImgPartialObsWrapper
    env_id, kwargs = env_cfg.id, dict(env_cfg.kwargs)

    def make() -> gym.Env:
        return wrappers.ImgObsWrapper(pixels(gym.make(env_id, **kwargs), tile_size=tile))

    return vectorize(make, num_envs, vectorization, env_cfg.action_chunk)
