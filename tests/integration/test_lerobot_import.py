"""The LeRobot import's cases (lerobot_import_cases.py) in a process of their own: they render the env to compare
its frames with the decoded video, with OSMesa chosen before MuJoCo loads (tests/rendering_support.py says why)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rendering_support import run_rendering_cases

pytestmark = pytest.mark.minutes(0.4)  # on CI's 2 cores: the tiers start long files first


def test_lerobot_import_in_a_rendering_process():
    run_rendering_cases(Path(__file__).with_name("lerobot_import_cases.py"))
