"""Execution modes on a workload where simulation and inference both cost real time: MuJoCo HalfCheetah-v5,
16 envs, a 256x256 policy (examples/halfcheetah_ppo.yaml). Everything is measured in this run, on this machine,
through real service processes:

  * env steps/s of each plan (collocated, both hybrids, disaggregated; staleness 1 where the learner streams,
    and disaggregated at staleness 0 for reference), steady state (warm-up iterations dropped, no evaluation);
  * the plan ``scheduling.mode: auto`` picks and its steady-state steps/s, against the best measured plan;
  * the cluster simulator's predicted iteration time of every plan (from the auto run's fitted profile) against
    the measured one;
  * online scaling: an env-bound variant (one epoch per update) runs collocated with one rollout worker, then
    ``Scale(rollout, +1)`` mid-run; steps/s before and after.

    python bench/modes.py --out bench/results/modes.json [--iterations 24]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from services.coordinator.client import STATE_NAMES, CoordinatorClient  # noqa: E402
from services.core.config import load_config  # noqa: E402
from services.launcher import LocalStack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "halfcheetah_ppo.yaml"
WARMUP = 3
PLANS = {
    "collocated": {"mode": "collocated"},
    "hybrid env+rollout|learner": {"mode": "hybrid", "pipeline_chunks": 1, "staleness": 1,
                                   "placement": {"env": "a", "rollout": "a", "learner": "b"}},
    "hybrid env|rollout+learner": {"mode": "hybrid", "pipeline_chunks": 2,
                                   "placement": {"env": "a", "rollout": "b", "learner": "b"}},
    "disaggregated": {"mode": "disaggregated", "pipeline_chunks": 2, "staleness": 1},
    "disaggregated k=0": {"mode": "disaggregated", "pipeline_chunks": 2, "staleness": 0},
}


def rows_of(run_dir: Path) -> list[dict[str, float]]:
    import csv

    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]


def steps_per_s(rows: list[dict[str, float]]) -> float:
    """Steady-state env steps/s: trained env steps over wall time between two recorded iterations."""
    a, b = rows[0], rows[-1]
    return (b["env_steps"] - a["env_steps"]) / (b["wall_time_s"] - a["wall_time_s"])


def train(client: CoordinatorClient, base, scheduling: dict, iterations: int, run_dir: Path) -> list[dict]:
    cfg = base.model_copy(deep=True)
    data = json.loads(cfg.to_json())
    data["scheduling"] = {**data["scheduling"], **scheduling}
    data["train"].update(total_env_steps=iterations * cfg.batch_env_steps(), eval_every_iterations=0,
                         stop_at_eval_return=None)
    data["checkpoint"]["every_iterations"] = 0
    cfg = type(base).model_validate(data)
    status = client.wait(client.submit(cfg, run_dir=run_dir).run_id)
    if STATE_NAMES[status.state] != "SUCCEEDED":
        raise RuntimeError(f"{scheduling}: {status.reason}")
    return rows_of(run_dir)


def start_stack(work: Path) -> tuple[LocalStack, CoordinatorClient]:
    """Two env and two rollout workers, replay and a learner, as local processes, all registered and alive."""
    stack = LocalStack(log_dir=work / "logs", runs_root=work,
                       roles=("env", "env", "replay", "learner", "rollout", "rollout"))
    stack.start()
    client = CoordinatorClient(stack.address)
    try:
        client.wait_ready(60)
        deadline = time.monotonic() + 120
        while len([w for w in client.workers() if w.alive]) < 6:
            if time.monotonic() > deadline or stack.dead():
                raise RuntimeError(f"services did not start; logs in {work / 'logs'}")
            time.sleep(0.2)
    except BaseException:
        client.close()
        stack.stop()
        raise
    return stack, client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--iterations", type=int, default=24, help="iterations per plan (the first 3 are warm-up)")
    args = ap.parse_args()
    base = load_config(CONFIG)
    work = Path(tempfile.mkdtemp(prefix="rlfabric-modes-"))
    stack, client = start_stack(work)
    metrics: dict[str, float] = {}
    try:
        measured: dict[str, float] = {}
        for name, sched in PLANS.items():
            rows = train(client, base, sched, args.iterations, work / name.replace(" ", "_").replace("|", "_"))
            measured[name] = steps_per_s(rows[WARMUP:])
            metrics[f"{name} env_steps_per_s"] = measured[name]
            print(f"{name:<28} {measured[name]:8.0f} env steps/s", flush=True)

        # auto: profiles and measures every candidate, then keeps one; its steady state comes after the decision
        p = base.scheduling.profile_iterations
        auto_iters = 4 * (p + 1) + 8 + args.iterations
        auto_dir = work / "auto"
        rows = train(client, base, {"mode": "auto", "staleness": 1, "pipeline_chunks": 2}, auto_iters, auto_dir)
        plan = json.loads((auto_dir / "plan.json").read_text())
        decided = plan["decided_after_iteration"]  # every candidate measured (streams drain a few more)
        auto = steps_per_s(rows[decided + WARMUP:])
        metrics["auto env_steps_per_s"] = auto
        metrics["auto chose"] = plan["chosen"]
        print(f"{'auto -> ' + plan['chosen']:<28} {auto:8.0f} env steps/s ({plan['why']})", flush=True)
        batch = base.batch_env_steps()
        sim = {}
        for d in plan["decisions"]:
            name = d["plan"]
            metrics[f"{name} predicted_iteration_s"] = d["predicted_s"]
            metrics[f"{name} measured_iteration_s (auto run)"] = d["measured_s"]
            if name in measured:  # against this bench's own longer measurement of the same plan
                sim[name] = (batch / d["predicted_s"]) / measured[name]
        metrics["fitted_profile"] = plan["profile"]

        # online scaling on an env-bound variant: one epoch per update, collocated, 1 -> 2 rollout workers
        scale_dir = work / "scale"
        cfg = json.loads(base.to_json())
        cfg["algorithm"]["n_epochs"] = 1
        cfg["scheduling"].update(mode="collocated", rollout_workers=1)
        cfg["train"].update(total_env_steps=400 * batch, eval_every_iterations=0, stop_at_eval_return=None)
        cfg["checkpoint"]["every_iterations"] = 0
        run_id = client.submit(type(base).model_validate(cfg), run_dir=scale_dir).run_id
        half = args.iterations
        while client.status(run_id).iteration < half:
            time.sleep(0.1)
        reply = client.scale(run_id, "rollout", delta=+1, timeout_s=60)
        while client.status(run_id).iteration < reply.applied_at_iteration + half:
            time.sleep(0.1)
        client.stop(run_id)
        rows = rows_of(scale_dir)
        before = steps_per_s([r for r in rows if r["rollout_workers"] == 1][WARMUP:])
        after = steps_per_s([r for r in rows if r["rollout_workers"] == 2][WARMUP:])
        metrics.update({"scale before env_steps_per_s": before, "scale after env_steps_per_s": after,
                        "scale applied_at_iteration": reply.applied_at_iteration})
        print(f"scale rollout +1 (env-bound, collocated): {before:.0f} -> {after:.0f} env steps/s", flush=True)
    finally:
        client.close()
        stack.stop()

    pipelined = {k: v for k, v in measured.items() if k != "collocated"}
    best = max(pipelined, key=pipelined.get)
    best_all = max(measured.values())
    metrics["best pipelined/hybrid plan"] = best
    ratios = {
        "best_pipelined_vs_collocated": pipelined[best] / measured["collocated"],
        "auto_vs_best_measured": auto / best_all,
        "scaled_rollout_vs_before": after / before,
        **{f"simulated_vs_measured_steps_{k.replace(' ', '_').replace('|', '_')}": v for k, v in sim.items()},
    }
    targets = {"best_pipelined_vs_collocated": ">=1.3", "auto_vs_best_measured": ">=0.95",
               "scaled_rollout_vs_before": ">=1.1"}
    report("modes", metrics, ratios, targets, args.out)


if __name__ == "__main__":
    main()
