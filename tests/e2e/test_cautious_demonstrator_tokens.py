"""RL beyond a cautious demonstrator for vla_tokens: the recipe and gates are test_cautious_demonstrator.py's; this
file of its own lets the slow tier's second worker run it beside pi0's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.pi0")
pytest.importorskip("mujoco")

from tests.e2e.test_cautious_demonstrator import rl_raises_a_vla_over_its_imitation  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 438 s on CI's 2 cores beside pi0's run (2026-11-29)
@pytest.mark.parametrize("family", ["vla_tokens"])
def test_rl_raises_a_vla_over_its_imitation_of_a_cautious_demonstrator(request, tmp_path, family):
    rl_raises_a_vla_over_its_imitation(request, tmp_path, family, ("demos", "vision"))
