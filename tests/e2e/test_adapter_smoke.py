"""Every pixel adapter the README documents, through `rlfabric train` under default settings (rollout.collector:
auto, the default policy and plan) and once with every service in its own process: a few iterations to exit 0.
These adapters once failed at rollout Configure ("no collector serves env.adapter 'mujoco_pixels'"), and the
default CNN once refused a 32x32 camera; no test ran them through a rollout worker."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys

import pytest
import yaml

TOTAL_STEPS = 256
CASES = {  # adapter -> (env id, the package it needs, the extra that brings it)
    "mujoco_pixels": ("Reacher-v5", "mujoco", "robotics"),
    "robotics": ("FetchReach-v4", "gymnasium_robotics", "robotics"),
    "metaworld": ("reach-v3", "metaworld", "metaworld"),  # pins its own mujoco: not installed in CI
}


def _train(tmp_path, adapter: str, *sets: str) -> list[dict[str, str]]:
    env_id, package, extra = CASES[adapter]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"env.adapter {adapter} needs the {package} package, not installed here (pip install -e "
                    f"'.[{extra}]')")
    spec = {"name": f"smoke-{adapter}",
            "env": {"adapter": adapter, "id": env_id, "options": {"image_size": 32}, "num_envs": 2, "eval_envs": 2},
            "train": {"total_env_steps": TOTAL_STEPS, "eval_every_iterations": 0}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    args = [item for s in sets for item in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "services.cli", "train", str(config), "--run-dir", str(run_dir),
                           "--quiet", *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(csv.DictReader(open(run_dir / "metrics.csv")))


@pytest.mark.slow
@pytest.mark.parametrize("adapter", sorted(CASES))
def test_each_pixel_adapter_trains_under_default_settings(tmp_path, adapter):
    rows = _train(tmp_path, adapter)
    assert int(rows[-1]["env_steps"]) == TOTAL_STEPS and len(rows) >= 2
    assert rows[-1]["eval_return_mean"]  # the final evaluation ran through the same collector


@pytest.mark.slow
@pytest.mark.parametrize("adapter", sorted(CASES))
def test_each_pixel_adapter_trains_with_every_service_in_its_own_process(tmp_path, adapter):
    """The env service steps the adapter, the rollout worker acts with the collector the adapter declares."""
    rows = _train(tmp_path, adapter, "scheduling.mode=disaggregated")
    assert int(rows[-1]["env_steps"]) == TOTAL_STEPS and len(rows) >= 2
