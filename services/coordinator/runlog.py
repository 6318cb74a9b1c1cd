"""RunLog: what every run leaves behind — config.yaml, metrics.csv, TensorBoard events and curve.png."""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path

from services.core.config import RunConfig, dump_yaml

COLUMNS = [
    "iteration", "env_steps", "time", "wall_time_s", "weight_version", "batch_version",
    "train_return_mean", "train_episodes", "eval_return_mean", "eval_return_std", "eval_weight_version",
    "optimizer_steps", "fps",
    "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance",
    "learning_rate", "clip_range", "collect_seconds", "train_seconds", "update_seconds", "publish_seconds",
    "env_seconds", "policy_seconds",
    "weight_wait_seconds", "train_wait_seconds", "iteration_seconds", "rollout_workers", "env_workers",
    "offload_bytes", "offload_seconds", "onload_seconds",
]


def import_tensorboardx():
    """tensorboardX imports torch (1.4 s of CPU) only to recognise torch tensors; we log floats. In a process that
    has not imported torch (the coordinator never does), hide torch for the import: 0.15 s instead."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


class RunLog:
    def __init__(self, run_dir: Path, config: RunConfig, resume_iteration: int | None = None, resume_env_steps: int = 0):
        """A fresh run log, or (``resume_iteration``) the existing one cut back to the checkpoint: rows after it
        were produced by work the resumed run repeats, so the curve continues without a jump back."""
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, float]] = []
        path = run_dir / "metrics.csv"
        kept: list[dict[str, str]] = []
        if resume_iteration is not None and path.exists():
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(float(r["iteration"])) <= resume_iteration]
            self.rows = [{k: float(v) for k, v in r.items() if k in COLUMNS and v not in ("", None)} for r in kept]
        else:
            (run_dir / "config.yaml").write_text(dump_yaml(config))
        self._csv_file = open(path, "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=COLUMNS, extrasaction="ignore")
        self._csv.writeheader()
        for row in kept:  # verbatim: the resumed file reads exactly as it did before the stop
            self._csv.writerow(row)
        self._csv_file.flush()
        # purge_step drops TensorBoard events at or after it, written before the run stopped
        purge = resume_env_steps + 1 if resume_iteration is not None else None
        self._tb = import_tensorboardx().SummaryWriter(str(run_dir), flush_secs=5, purge_step=purge)

    def write(self, row: dict[str, float]) -> None:
        row = {k: v for k, v in row.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        row.setdefault("time", time.time())
        self.rows.append(row)
        self._csv.writerow(row)
        self._csv_file.flush()
        step = int(row.get("env_steps", 0))
        for key, value in row.items():
            if key not in ("iteration", "env_steps", "time"):
                group = "eval" if key.startswith("eval_") else "train" if key.startswith("train_") else "stats"
                self._tb.add_scalar(f"{group}/{key}", float(value), step)

    def close(self) -> None:
        self._tb.close()
        self._csv_file.close()
        self.plot()

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        for key, label in (("train_return_mean", "train (rolling mean)"), ("eval_return_mean", "eval")):
            pts = [(r["env_steps"], r[key]) for r in self.rows if key in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if key.startswith("eval") else None, label=label)
        ax.set_xlabel("env steps")
        ax.set_ylabel("episode return")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.run_dir / "curve.png"
        fig.savefig(path)
        plt.close(fig)
        return path
