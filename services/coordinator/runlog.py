"""RunLog: what every run leaves behind — config.yaml, metrics.csv, TensorBoard events and curve.png."""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from pathlib import Path

from rlfabric.services.core.config import RunConfig, dump_yaml

# Every run's columns, first; an algorithm's own statistics (its losses, learning rate, ...) follow in the order
# they first appear (the file is rewritten with the wider header when one appears).
COLUMNS = [
    "iteration", "env_steps", "time", "wall_time_s", "weight_version", "batch_version",
    "train_return_mean", "train_episodes", "eval_return_mean", "eval_return_std", "eval_success_rate", "eval_weight_version",
    "optimizer_steps", "fps", "collect_seconds", "train_seconds", "update_seconds", "publish_seconds",
    "env_seconds", "policy_seconds", "weight_wait_seconds", "train_wait_seconds", "iteration_seconds",
    "rollout_workers", "env_workers", "offload_bytes", "offload_seconds", "onload_seconds",
]


def write_private(path: Path, text: str) -> None:
    """Write ``path`` owner-only (0600, also when it existed wider), never through a symlink planted there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


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
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(run_dir, 0o700)  # owner-only: a run's files are no other local user's business
        # the x axis: env steps, or iterations for a run that collects nothing (offline)
        self.step_key = "env_steps" if config.collects else "iteration"
        self.rows: list[dict[str, float]] = []
        self.path = run_dir / "metrics.csv"
        self.columns = list(COLUMNS)
        kept: list[dict[str, str]] = []
        if resume_iteration is not None and self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                kept = [r for r in reader if int(float(r["iteration"])) <= resume_iteration]
                self.columns += [c for c in reader.fieldnames or [] if c not in self.columns]
            self.rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in kept]
        else:  # without its secrets (S3 keys, a Redis password): `rlfabric resume` takes them from the workers
            write_private(run_dir / "config.yaml", dump_yaml(config.redacted()))
        self._csv_file = None
        self._written: list[dict] = list(kept)  # verbatim: a resumed file reads exactly as it did before the stop
        self._rewrite()
        # purge_step drops TensorBoard events at or after it, written before the run stopped
        purge = resume_env_steps + 1 if resume_iteration is not None else None
        self._tb = import_tensorboardx().SummaryWriter(str(run_dir), flush_secs=5, purge_step=purge)

    def _rewrite(self) -> None:
        """The CSV from scratch with the current columns (at the start, and when a statistic first appears),
        written beside it and renamed over it: a reader, or a crash, never sees a half-written file."""
        if self._csv_file is not None:
            self._csv_file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self._written)
        os.replace(tmp, self.path)
        self._csv_file = open(self.path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self.columns, extrasaction="ignore")

    def write(self, row: dict[str, float]) -> None:
        row = {k: v for k, v in row.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        row.setdefault("time", time.time())
        self.rows.append(row)
        self._written.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
        else:
            self._csv.writerow(row)
            self._csv_file.flush()
        step = int(row.get(self.step_key, 0))
        for key, value in row.items():
            if key not in ("iteration", "env_steps", "time"):
                group = "eval" if key.startswith("eval_") else "train" if key.startswith("train_") else "stats"
                self._tb.add_scalar(f"{group}/{key}", float(value), step)

    def recovery(self, event) -> None:
        """A row of recoveries.csv: a lost worker the run recovered from, what was discarded and where it resumed."""
        path = self.run_dir / "recoveries.csv"
        fields = ["time", "attempt", "role", "worker_id", "cause", "discarded", "resumed_from",
                  "resumed_at_iteration", "weight_version", "seconds"]
        new = not path.exists()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            if new:
                writer.writeheader()
            writer.writerow({k: getattr(event, k) for k in fields})

    def close(self) -> None:
        self._tb.close()
        self._csv_file.close()
        self.plot()

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        curves = [("train_return_mean", "train (rolling mean)"), ("eval_return_mean", "eval")]
        ylabel = "episode return"
        if not any(key in r for key, _ in curves for r in self.rows):  # no returns (offline, no eval): the losses
            curves = [(c, c) for c in self.columns if c.endswith("_loss")]
            ylabel = "loss"
        for key, label in curves:
            pts = [(r.get(self.step_key, 0), r[key]) for r in self.rows if key in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if key.startswith("eval") else None, label=label)
        ax.set_xlabel(self.step_key.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.run_dir / "curve.png"
        fig.savefig(path)
        plt.close(fig)
        return path
