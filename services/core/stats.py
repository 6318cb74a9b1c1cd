"""Small statistics shared by services (episode summaries)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlfabric.services.core.proto.rlfabric.v1 import common_pb2


def episode_stats(returns: Sequence[float], lengths: Sequence[int] = ()) -> common_pb2.EpisodeStats:
    if not len(returns):
        return common_pb2.EpisodeStats(episodes=0)
    r = np.asarray(returns, dtype=np.float64)
    return common_pb2.EpisodeStats(episodes=len(r), return_mean=float(r.mean()), return_std=float(r.std()),
                                   return_min=float(r.min()), return_max=float(r.max()),
                                   length_mean=float(np.mean(lengths)) if len(lengths) else 0.0)
