"""End-to-end: wall-clock seconds and env steps until a deterministic evaluation reaches 475 on CartPole-v1,
rlfabric (every service its own process) next to Stable-Baselines3 PPO with the same hyper-parameters and the
same evaluation schedule, measured in this run on this machine. Also data-plane throughput for 4 MiB tensor
batches against raw pyzmq.

Both clocks run from process launch (imports and service start-up included) to the end of the first evaluation
that reaches the target. Sample efficiency varies by seed, so each side runs the same seeds and medians are
compared.

The sides (SB3 and every ``--modes`` of rlfabric) run in ``--repeats`` rounds (default 3; ``--quick``: one), each
side once per round, in turn: SB3's seeds, then each mode's. A side's sample in a round is its median wall-clock
over the seeds (a seed that never reaches 475 counts as infinitely slow); every seed's run is kept in the JSON
("runs": side -> rounds -> seeds). The ratios are ratios of the sides' medians over the rounds; each side's median,
min and max are printed and written ("sides"), and a side whose spread (max - min) exceeds 20% of its median is
flagged NOISY with every ratio that uses it. The data-plane ratios compare the medians of bench/dataplane.py's own
alternating rounds, which are the sides there.

    python bench/e2e_cartpole.py --out bench/results/e2e_cartpole.json [--seeds 0 1 2] [--repeats 3 | --quick]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_repeat_args,
    interleave,
    median_of,
    python,
    ratio_of_medians,
    repeat_count,
    report,
    run,
    seed_median,
)

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


def run_rlfabric(seed: int, mode: str, workdir: Path, tag: str = "") -> dict:
    run_dir = workdir / f"{mode}-{seed}{tag}"
    launch = time.time()
    proc = run([python(), "-m", "rlfabric.services.cli", "train", str(CONFIG), "--run-dir", str(run_dir), "--quiet",
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


def over_seeds(results: list[dict], key: str) -> float:
    """Median over seeds; a seed that never reached the target counts as infinitely slow."""
    return seed_median(r[key] if r["reached"] else None for r in results)


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
    add_repeat_args(parser)
    args = parser.parse_args()
    repeats = repeat_count(args)
    # side -> one list per round -> one result per seed
    results: dict[str, list[list[dict]]] = {"sb3": []} | {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="rlfabric-bench-") as tmp:

        def side(name: str):
            def measure() -> float:
                tag = f"-round{len(results[name])}"
                rs = [run_sb3(seed) if name == "sb3" else run_rlfabric(seed, name, Path(tmp), tag)
                      for seed in args.seeds]
                results[name].append(rs)
                for r in rs:
                    wall = f"{r['wall_s']:.1f}s" if r["reached"] else "not reached"
                    print(f"  seed {r['seed']} {name:>14}: {wall:>12} at {r['env_steps']} env steps", flush=True)
                return over_seeds(rs, "wall_s")
            return measure

        print(f"wall-clock s to eval return {TARGET:.0f}, median over seeds {args.seeds}", flush=True)
        samples = interleave({name: side(name) for name in results}, repeats)
    metrics: dict = {"seeds": args.seeds, "target_eval_return": TARGET, "runs": results}
    ratios, targets, compares = {}, {}, {}
    for name in results:
        metrics[f"{name}_median_wall_s"] = median_of(samples[name])  # over rounds of the median over seeds
        metrics[f"{name}_median_env_steps"] = median_of([over_seeds(rs, "env_steps") for rs in results[name]])
        metrics[f"{name}_wall_s_per_round"] = samples[name]
    for mode in args.modes:
        key = "wall_to_475_vs_sb3" if mode == "collocated" else f"wall_to_475_{mode}_vs_sb3"
        ratios[key] = ratio_of_medians(samples, mode, "sb3")
        targets[key] = "<=1.0"
        compares[key] = [mode, "sb3"]
        print(f"{mode:>14}: median {_s(metrics[f'{mode}_median_wall_s'])} / "
              f"{_s(metrics[f'{mode}_median_env_steps'], '.0f', ' steps')}   SB3: {_s(metrics['sb3_median_wall_s'])} / "
              f"{_s(metrics['sb3_median_env_steps'], '.0f', ' steps')}")
    dp = dataplane_throughput()
    metrics["dataplane"] = dp
    for name in ("ours", "raw", "ours_curve", "raw_curve"):  # dataplane.py's own alternating rounds
        samples[f"dataplane {name} MiB/s"] = dp[f"{name}_rounds_mib_s"]
    ratios["dataplane_4mib_vs_raw_pyzmq"] = dp["ours_mib_s"] / dp["raw_mib_s"]
    targets["dataplane_4mib_vs_raw_pyzmq"] = ">=0.9"
    compares["dataplane_4mib_vs_raw_pyzmq"] = ["dataplane ours MiB/s", "dataplane raw MiB/s"]
    ratios["dataplane_4mib_curve_vs_raw_pyzmq_curve"] = dp["ours_curve_mib_s"] / dp["raw_curve_mib_s"]
    targets["dataplane_4mib_curve_vs_raw_pyzmq_curve"] = ">=0.9"
    compares["dataplane_4mib_curve_vs_raw_pyzmq_curve"] = ["dataplane ours_curve MiB/s", "dataplane raw_curve MiB/s"]
    print(f"data plane, 4 MiB batches: rlfabric {dp['ours_mib_s']:.0f} MiB/s, raw pyzmq {dp['raw_mib_s']:.0f} MiB/s; "
          f"with CURVE {dp['ours_curve_mib_s']:.0f} vs {dp['raw_curve_mib_s']:.0f} MiB/s")
    report("e2e_cartpole", metrics, ratios, targets, args.out, sides=samples, compares=compares, repeats=repeats)


def _s(value: float | None, spec: str = ".1f", unit: str = "s") -> str:
    return "not reached" if value is None else f"{value:{spec}}{unit}"


if __name__ == "__main__":
    main()
