"""End-to-end: wall-clock seconds and env steps until a deterministic evaluation reaches 475 on CartPole-v1,
rlfabric (every service its own process) next to Stable-Baselines3 PPO with the same hyper-parameters and the
same evaluation schedule, measured in this run on this machine. Also data-plane throughput for 4 MiB tensor
batches against raw pyzmq.

Both clocks run from process launch (imports and service start-up included) to the end of the first evaluation
that reaches the target. Sample efficiency varies by seed, so each side runs the same seeds and medians are
compared.

    python bench/e2e_cartpole.py --out bench/results/e2e_cartpole.json [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import python, report, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cartpole_ppo.yaml"
TARGET = 475.0


def run_sb3(seed: int) -> dict:
    launch = time.time()
    proc = run([python(), str(ROOT / "bench" / "_sb3_cartpole.py"), str(seed), "100000", str(TARGET)], timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"SB3 baseline failed: {proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    if doc["reached_at"] is None:
        return {"seed": seed, "reached": False, "wall_s": None, "env_steps": None}
    return {"seed": seed, "reached": True, "wall_s": doc["reached_at"] - launch, "env_steps": doc["env_steps"]}


def run_rlfabric(seed: int, mode: str, workdir: Path) -> dict:
    run_dir = workdir / f"{mode}-{seed}"
    launch = time.time()
    proc = run([python(), "-m", "services.cli", "train", str(CONFIG), "--run-dir", str(run_dir), "--quiet",
                "--set", f"seed={seed}", "--set", f"scheduling.mode={mode}"], timeout=900, cwd=ROOT)
    end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"rlfabric {mode} seed {seed} failed: {proc.stderr[-2000:]}")
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("eval_return_mean") and float(row["eval_return_mean"]) >= TARGET:
                return {"seed": seed, "reached": True, "wall_s": float(row["time"]) - launch,
                        "env_steps": int(row["env_steps"]), "process_s": end - launch}
    return {"seed": seed, "reached": False, "wall_s": None, "env_steps": None, "process_s": end - launch}


def median_of(results: list[dict], key: str) -> float:
    """Median over seeds; a seed that never reached the target counts as infinitely slow."""
    return statistics.median([r[key] if r["reached"] else float("inf") for r in results])


def dataplane_throughput(mib: int = 4, seconds: float = 3.0) -> dict:
    proc = run([python(), str(ROOT / "bench" / "dataplane.py"), "--mib", str(mib), "--seconds", str(seconds),
                "--json"], timeout=300, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"data-plane bench failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--modes", nargs="+", default=["collocated", "disaggregated"])
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"sb3": []} | {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="rlfabric-bench-") as tmp:
        for seed in args.seeds:  # interleaved, so drift on the machine hits every side alike
            results["sb3"].append(run_sb3(seed))
            for mode in args.modes:
                results[mode].append(run_rlfabric(seed, mode, Path(tmp)))
            for name, rs in results.items():
                r = rs[-1]
                wall = f"{r['wall_s']:.1f}s" if r["reached"] else "not reached"
                print(f"seed {seed} {name:>14}: {wall:>12} at {r['env_steps']} env steps", flush=True)
    metrics: dict = {"seeds": args.seeds, "target_eval_return": TARGET, "runs": results}
    ratios, targets = {}, {}
    sb3_wall = median_of(results["sb3"], "wall_s")
    metrics["sb3_median_wall_s"] = sb3_wall
    metrics["sb3_median_env_steps"] = median_of(results["sb3"], "env_steps")
    for mode in args.modes:
        wall = median_of(results[mode], "wall_s")
        metrics[f"{mode}_median_wall_s"] = wall
        metrics[f"{mode}_median_env_steps"] = median_of(results[mode], "env_steps")
        key = "wall_to_475_vs_sb3" if mode == "collocated" else f"wall_to_475_{mode}_vs_sb3"
        ratios[key] = wall / sb3_wall
        targets[key] = "<=1.0"
        print(f"{mode:>14}: median {wall:.1f}s / {metrics[f'{mode}_median_env_steps']:.0f} steps   "
              f"SB3: {sb3_wall:.1f}s / {metrics['sb3_median_env_steps']:.0f} steps")
    dp = dataplane_throughput()
    metrics["dataplane"] = dp
    ratios["dataplane_4mib_vs_raw_pyzmq"] = dp["ours_mib_s"] / dp["raw_mib_s"]
    targets["dataplane_4mib_vs_raw_pyzmq"] = ">=0.9"
    ratios["dataplane_4mib_curve_vs_raw_pyzmq_curve"] = dp["ours_curve_mib_s"] / dp["raw_curve_mib_s"]
    targets["dataplane_4mib_curve_vs_raw_pyzmq_curve"] = ">=0.9"
    print(f"data plane, 4 MiB batches: rlfabric {dp['ours_mib_s']:.0f} MiB/s, raw pyzmq {dp['raw_mib_s']:.0f} MiB/s; "
          f"with CURVE {dp['ours_curve_mib_s']:.0f} vs {dp['raw_curve_mib_s']:.0f} MiB/s")
    report("e2e_cartpole", metrics, ratios, targets, args.out)


if __name__ == "__main__":
    main()
