"""Execution modes on a workload where simulation and inference both cost real time: MuJoCo HalfCheetah-v5,
16 envs, a 256x256 policy (examples/halfcheetah_ppo.yaml). Everything is measured in this run, on this machine,
through real service processes (one stack of services, started once and shared by every round):

  * env steps/s of each plan (collocated, both hybrids, disaggregated; staleness 1 where the learner streams,
    and disaggregated at staleness 0 for reference), steady state (warm-up iterations dropped, no evaluation);
  * the plan ``scheduling.mode: auto`` picks and its steady-state steps/s, against the best measured plan; and
    the auto plan against itself: it runs twice per round ("auto" and "auto again", identical), and
    ``auto_vs_itself`` (target 1.0±0.1) is how far two runs of one plan disagree. ``auto_vs_best_measured`` reads
    both auto runs of every round (the side "auto, both runs"): with 3 samples a side, two runs of the bench put
    it at 1.11 and 0.93, though auto chose the same plan, the measured-fastest, every time;
  * the cluster simulator's predicted iteration time of every plan (from the auto runs' fitted profiles, median
    prediction) against the measured one;
  * online scaling: an env-bound variant (one epoch per update) runs collocated with one rollout worker, then
    ``Scale(rollout, +1)`` mid-run; steps/s before and after ("scale before" / "scale after").

The bench runs ``--repeats`` rounds (default 3; ``--quick``: one). Each round runs every plan, auto, auto again
and the scaling run once, in that order, so the sides alternate (A B C ... A B C ...); every ratio is a ratio of
the sides' medians over the rounds, each side's median, min and max are printed and written ("sides"), and a
side whose spread (max - min) exceeds 20% of its median is flagged NOISY with every ratio that uses it.

    python bench/modes.py --out bench/results/modes.json [--iterations 72] [--repeats 3 | --quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_repeat_args,
    interleave,
    median_of,
    ratio_of_medians,
    repeat_count,
    report,
)

from rlfabric.services.coordinator.client import STATE_NAMES, CoordinatorClient  # noqa: E402
from rlfabric.services.core.config import load_config  # noqa: E402
from rlfabric.services.launcher import LocalStack  # noqa: E402

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


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("|", "_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--iterations", type=int, default=72,
                    help="iterations per plan (the first 3 are warm-up); at 24 (~3 s of steady state) single plans spread"
                         " 22-33%% between rounds on 2 cores, at 72 by 4-20%% (docs/benchmarks.md)")
    add_repeat_args(ap)
    args = ap.parse_args()
    repeats = repeat_count(args)
    base = load_config(CONFIG)
    batch = base.batch_env_steps()
    work = Path(tempfile.mkdtemp(prefix="rlfabric-modes-"))
    stack, client = start_stack(work)
    metrics: dict = {"iterations": args.iterations}
    autos: list[dict] = []  # every auto run's plan.json (both auto sides, every round)
    scale_at: list[int] = []
    runs = itertools.count()  # a run directory per side and round

    def plan_side(name: str, sched: dict):
        def side() -> float:
            rows = train(client, base, sched, args.iterations, work / f"{slug(name)}-{next(runs)}")
            return steps_per_s(rows[WARMUP:])
        return side

    def auto_side(name: str):
        # auto: profiles and measures every candidate, then keeps one; its steady state comes after the decision
        def side() -> float:
            p = base.scheduling.profile_iterations
            auto_iters = 4 * (p + 1) + 8 + args.iterations
            auto_dir = work / f"{slug(name)}-{next(runs)}"
            rows = train(client, base, {"mode": "auto", "staleness": 1, "pipeline_chunks": 2}, auto_iters, auto_dir)
            plan = json.loads((auto_dir / "plan.json").read_text())
            decided = plan["decided_after_iteration"]  # every candidate measured (streams drain a few more)
            autos.append({"side": name, **plan})
            value = steps_per_s(rows[decided + WARMUP:])
            print(f"{name} -> {plan['chosen']}: {value:.0f} env steps/s ({plan['why']})", flush=True)
            return value
        return side

    def scale_side() -> dict[str, float]:
        # online scaling on an env-bound variant: one epoch per update, collocated, 1 -> 2 rollout workers
        scale_dir = work / f"scale-{next(runs)}"
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
        scale_at.append(reply.applied_at_iteration)
        return {"scale before": steps_per_s([r for r in rows if r["rollout_workers"] == 1][WARMUP:]),
                "scale after": steps_per_s([r for r in rows if r["rollout_workers"] == 2][WARMUP:])}

    sides = {name: plan_side(name, sched) for name, sched in PLANS.items()}
    sides |= {"auto": auto_side("auto"), "auto again": auto_side("auto again"), "scale": scale_side}
    try:
        samples = interleave(sides, repeats)
    finally:
        client.close()
        stack.stop()

    measured = {name: median_of(samples[name]) for name in PLANS}  # medians over the rounds
    for name, value in measured.items():
        metrics[f"{name} env_steps_per_s"] = value
    # auto's runs, both sides: one plan measured twice a round, so auto against the best plan reads 6 samples
    samples["auto, both runs"] = samples["auto"] + samples["auto again"]
    metrics["auto env_steps_per_s"] = median_of(samples["auto"])
    metrics["auto again env_steps_per_s"] = median_of(samples["auto again"])
    chosen = [a["chosen"] for a in autos]
    metrics["auto chose"] = max(set(chosen), key=chosen.count)  # the plan auto picked most often
    metrics["auto choices"] = [{"side": a["side"], "chosen": a["chosen"], "why": a["why"]} for a in autos]
    sim, compares = {}, {}
    for name in dict.fromkeys(d["plan"] for a in autos for d in a["decisions"]):
        predicted = [d["predicted_s"] for a in autos for d in a["decisions"] if d["plan"] == name]
        metrics[f"{name} predicted_iteration_s"] = statistics.median(predicted)
        metrics[f"{name} measured_iteration_s (auto run)"] = statistics.median(
            d["measured_s"] for a in autos for d in a["decisions"] if d["plan"] == name)
        if measured.get(name):  # against this bench's own longer measurement of the same plan
            key = f"simulated_vs_measured_steps_{slug(name)}"
            sim[key] = (batch / metrics[f"{name} predicted_iteration_s"]) / measured[name]
            compares[key] = [name]
    metrics["fitted_profile"] = autos[0]["profile"]
    metrics["fitted_profiles"] = [a["profile"] for a in autos]
    metrics.update({"scale before env_steps_per_s": median_of(samples["scale before"]),
                    "scale after env_steps_per_s": median_of(samples["scale after"]),
                    "scale applied_at_iteration": scale_at})

    pipelined = {k: v for k, v in measured.items() if k != "collocated"}
    best = max(pipelined, key=pipelined.get)
    best_all = max(measured, key=measured.get)
    metrics["best pipelined/hybrid plan"] = best
    metrics["best measured plan"] = best_all
    ratios = {
        "best_pipelined_vs_collocated": ratio_of_medians(samples, best, "collocated"),
        "auto_vs_best_measured": ratio_of_medians(samples, "auto, both runs", best_all),
        "auto_vs_itself": ratio_of_medians(samples, "auto again", "auto"),
        "scaled_rollout_vs_before": ratio_of_medians(samples, "scale after", "scale before"),
        **dict(sorted(sim.items())),
    }
    compares |= {"best_pipelined_vs_collocated": [best, "collocated"], "auto_vs_best_measured": ["auto, both runs", best_all],
                 "auto_vs_itself": ["auto again", "auto"], "scaled_rollout_vs_before": ["scale after", "scale before"]}
    targets = {"best_pipelined_vs_collocated": ">=1.3", "auto_vs_best_measured": ">=0.95", "auto_vs_itself": "1.0±0.1",
               "scaled_rollout_vs_before": ">=1.1"}
    report("modes", metrics, ratios, targets, args.out, sides=samples, compares=compares, repeats=repeats)


if __name__ == "__main__":
    main()
