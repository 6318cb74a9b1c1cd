"""The pixel env adapters' cases (pixel_adapters_cases.py) in a process of their own, with OSMesa chosen before
anything imports MuJoCo (tests/rendering_support.py says why)."""

from __future__ import annotations

from pathlib import Path

from tests.rendering_support import run_rendering_cases


def test_pixel_adapters_in_a_rendering_process():
    run_rendering_cases(Path(__file__).with_name("pixel_adapters_cases.py"), allow_skips=True)
