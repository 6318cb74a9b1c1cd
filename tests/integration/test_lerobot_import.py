"""The LeRobot import's cases (lerobot_import_cases.py) in a process of their own: they render the env to compare
its frames with the decoded video, with OSMesa chosen before MuJoCo loads (tests/rendering_support.py says why)."""

from __future__ import annotations

from pathlib import Path

from tests.rendering_support import run_rendering_cases


def test_lerobot_import_in_a_rendering_process():
    run_rendering_cases(Path(__file__).with_name("lerobot_import_cases.py"))
