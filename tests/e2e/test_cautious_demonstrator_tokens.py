"""RL beyond a cautious demonstrator for vla_tokens: the recipe and gates are test_cautious_demonstrator.py's; this
file of its own lets the slow tier's second worker run it beside pi0's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.pi0")
pytest.importorskip("mujoco")

from tests.e2e.test_cautious_demonstrator import rl_raises_a_vla_over_its_imitation  # noqa: E402

# Fourth of the slow tier, not second: started beside pi0's run it recorded the demonstrations (10 s), then
# waited 67 s for the vision stage pi0's run builds (77 s), its core idle. Placed as a 6-minute file (after pi0's
# 30-minute timeout and the multi-host files' 8 and 6.7 minutes), it goes to the second worker behind the multi-host
# deployment file (~2 minutes) while pi0's run builds both stages, and then finds them built.
pytestmark = pytest.mark.start_as(6)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 438 s on CI's 2 cores beside pi0's run (2026-11-29)
@pytest.mark.parametrize("family", ["vla_tokens"])
def test_rl_raises_a_vla_over_its_imitation_of_a_cautious_demonstrator(request, tmp_path, family):
    rl_raises_a_vla_over_its_imitation(request, tmp_path, family, ("demos", "vision"))
