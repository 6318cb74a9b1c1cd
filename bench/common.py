"""Shared bits of the benchmarks: machine description and the JSON report format of DESIGN.md section 8."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        model = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        info["cpu"] = model[0] if model else ""
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = 1
    except ImportError:
        pass
    return info


def report(name: str, metrics: dict, ratios: dict[str, float], targets: dict[str, str], out: str | None) -> dict:
    doc = {"name": name, "machine": machine(), "metrics": metrics, "ratios": ratios, "targets": targets}
    for key, value in ratios.items():
        target = targets.get(key, "")
        ok = _meets(value, target)
        print(f"{key} = {value:.3f}  (target {target or 'none'}{'' if ok is None else ', met' if ok else ', NOT met'})")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {out}")
    return doc


def _meets(value: float, target: str) -> bool | None:
    if not target:
        return None
    op, num = target[:2], float(target[2:])
    return value <= num if op == "<=" else value >= num


def python() -> str:
    return sys.executable


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def pi0_ode_recomputing_prefix(policy, obs: dict):
    """pi0's ODE from zero noise with the prefix (images and words) recomputed at every denoising step: what acting
    without the KV cache costs. ``policy.act(obs, deterministic=True)`` gives the same chunk from the cache."""
    import torch

    with torch.no_grad():
        x_in = policy.inputs(obs)
        B, K = x_in["state"].shape[0], policy.steps
        x = torch.zeros(B, policy.H, policy.A, device=x_in["state"].device)
        for k in range(K):
            tau = torch.full((B,), k / K, device=x.device)
            v = -policy.model(noise=x, timestep=1.0 - tau, **x_in).logits[:, :policy.H, :policy.A]
            x = x + v / K  # the ODE's Euler step (sigma 0)
        return x
