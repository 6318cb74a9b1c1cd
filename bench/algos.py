"""Off-policy algorithms against their reference implementations, on this machine in one run: env steps and
wall-clock seconds until a deterministic evaluation reaches a mean return of -200 on Pendulum-v1,

- rlfabric SAC (``examples/pendulum_sac.yaml``) against Stable-Baselines3's ``SAC``,
- rlfabric CrossQ (``examples/pendulum_crossq.yaml``) against sb3-contrib's ``CrossQ``,

each pair with the same hyper-parameters (mapped below from the example spec, every time from the spec as loaded,
so an edit of the example moves both sides) and the same evaluation protocol, and

- rlfabric RLPD (``examples/pendulum_rlpd.yaml``) with 10 demonstration episodes against SAC without them (the
  SAC example, ``examples/pendulum_sac.yaml``), env steps only: ``rlpd_vs_sac_env_steps``, the ratio of their
  medians, target <= 0.7, as the issue defines it. What the demos alone are worth is measured beside it, against
  the RLPD spec without them (``algorithm.offline_weight=0``, no data set: SAC with RLPD's LayerNorm critic
  ensemble and update-to-data ratio, so the demos are the only difference): ``rlpd_demos_vs_no_demos_env_steps``,
  no target. The demos come from an expert trained once per bench run (the CrossQ example, seed 0, to its -200;
  ``rlfabric collect CHECKPOINT --episodes 10``, stochastic actions, collect's seed 0), shared by every seed and
  round. All three sides evaluate every 256 env steps (``RLPD_EVAL_EVERY_ITERATIONS`` iterations of 128: the RLPD
  example's cadence, and SAC's at 2 of its iterations) with the same 20 episodes; no SB3 side (SB3 has no RLPD).

The rlfabric side is the example run through every service (``rlfabric train SPEC --run-dir DIR --quiet --set
train.stop_at_eval_return=-200 ...``); its env steps and time are read from the run's metrics.csv at the first
evaluation >= -200 (the ``time`` column: time.time() when the row was written, after the evaluation). The SB3
side runs in its own process (``bench/_sb3_pendulum.py``) with torch's threads set as rlfabric's learner sets
them (``runtime.torch_threads``, interop threads 1). Both clocks run from process launch (imports and, for
rlfabric, service start-up included) to the end of the first evaluation that reaches -200.

Evaluation, both sides: after the update of every 4th iteration (every 512 env steps: 4 x n_steps 32 x 4 envs),
20 deterministic episodes over 20 envs, env i started from seed + 100,000 + i at every evaluation (rlfabric's eval
pool; SB3: ``eval_env.seed`` before each ``evaluate_policy``), and a final evaluation at the step cap. The SAC
example's own protocol (5 episodes every 10 iterations) is overridden with the CrossQ example's (20 episodes, as
its comment says: 5 fixed starts are too few to judge -200), so both algorithms are judged alike. A side that does
not reach -200 by the cap is "not reached" (counted as infinitely slow in a median, its ratio not measured).

Hyper-parameter mapping, rlfabric spec -> SB3 (``sb3_args``; the JSON records the exact arguments per algorithm):

- env.num_envs -> ``make_vec_env(n_envs=)``, training env i seeded seed + i on both sides.
- algorithm.learning_rate -> ``learning_rate`` (one step size for actor, critics and temperature on both).
- algorithm.batch_size -> ``batch_size``; algorithm.gamma -> ``gamma``; SAC's algorithm.tau -> ``tau``
  (target update every gradient step on both: ``target_update_interval=1``). CrossQ has no targets on either side.
- replay.capacity_transitions -> ``buffer_size``.
- algorithm.n_steps x env.num_envs (one iteration) -> ``train_freq=(n_steps, "step")`` (SB3 counts vector steps:
  n_steps x num_envs transitions) and ``gradient_steps = round(updates_per_env_step x n_steps x num_envs)``: SAC
  0.5 x 128 = 64, CrossQ 1.0 x 128 = 128 gradient steps after each 128 env steps, as rlfabric's ``updates_for``.
- algorithm.learning_starts L -> ``learning_starts = R - 1`` with R = L rounded up to whole iterations
  (SAC 1024 -> 1023, CrossQ 512 -> 511): rlfabric acts uniformly at random for whole iterations while
  ``batch_index x 128 < L`` and first updates once ``env_steps >= L``; SB3 acts at random while
  ``num_timesteps < learning_starts`` and first trains once ``num_timesteps > learning_starts``. With R - 1 both
  take R random env steps and first train after the R-th.
- policy.hidden_sizes -> ``net_arch["pi"]`` (the squashed-Gaussian actor); policy.activation -> ``activation_fn``.
  rlfabric's SAC critics use policy.hidden_sizes with ReLU -> ``net_arch["qf"]``; CrossQ's critics
  algorithm.critic_hidden_sizes -> ``net_arch["qf"]``. Two critics on both (``n_critics=2``).
- ent_coef "auto" -> "auto" (alpha starts at 1.0 on both); target_entropy None -> "auto" (-action_dim on both).
- CrossQ: policy_delay -> ``policy_delay`` (both count critic steps); adam_beta1 -> ``optimizer_kwargs={"betas":
  (adam_beta1, 0.999)}`` (actor and critics); brn_momentum m -> ``batch_norm_momentum = 1 - m`` (sb3-contrib's
  momentum weighs the batch, rlfabric's the running statistics); brn_warmup_steps W -> ``renorm_warmup_steps =
  W - 1`` (sb3-contrib renormalises once ``steps > warmup``, rlfabric once ``steps >= warmup``; both count
  train-mode critic forwards, one per critic step); BatchRenorm eps 1e-3 (rlfabric's fixed value) ->
  ``batch_norm_eps=1e-3``; brn_r_max 3 and brn_d_max 5 are sb3-contrib's fixed values (checked, not passed).
- Same on both without an argument: squashed-Gaussian actor with log-std clamped to [-20, 2], replay of squashed
  actions in [-1, 1], bootstrapping through time limits (``terminated`` only), uniform minibatches, Adam's
  defaults otherwise, torch's default initialisation, CPU.

What cannot be matched (also listed per algorithm in the JSON, "unmatched"):

- The random streams (actor noise, minibatch indices, uniform warm-up actions): same seeds, different draws, so
  each seed's learning curve differs between the sides; hence several seeds and medians.
- Critic loss scale: SB3 and sb3-contrib minimise 0.5 x sum_j MSE_j, rlfabric sum_j MSE_j. Adam is invariant to
  a constant gradient scale (up to its eps), so the updates agree to within eps.
- Order within a gradient step: SB3's SAC updates the temperature first and samples the actor's actions before
  the critic step; rlfabric steps critic, actor, then temperature (both use the temperature from before its step).
- sb3-contrib's CrossQ batch-renormalises the actor too (its ``batch_norm`` switch covers actor and critics
  together); rlfabric's CrossQ actor is the plain MLP, BatchRenorm in the critics only.
- sb3-contrib's CrossQ temperature optimiser is Adam with betas (0.9, 0.999), not exposed; rlfabric's uses
  adam_beta1 (0.5) for the temperature too.
- BatchRenorm details: sb3-contrib uses the unbiased batch variance and folds r, d into a shifted mean and
  scaled variance before adding eps; rlfabric uses the biased variance and applies r, d after normalising.
  r_max/d_max are not arguments in sb3-contrib (fixed 3 and 5, the examples' values).
- Env stepping: rlfabric's env service steps a gymnasium vector env in its own process and ships observations
  over its data plane; SB3 steps a DummyVecEnv in the training process. This is part of what the wall-clock
  ratio measures, not a hyper-parameter.

Rounds (bench/common.py): every side runs in ``--repeats`` rounds (default 3; ``--quick``: one), in turn
(SAC SB3, SAC rlfabric, CrossQ SB3, CrossQ rlfabric), every seed in each; a side's sample in a round is its median
over the seeds (a seed that never reaches -200 counts as infinitely slow). Ratios: rlfabric's median over the
rounds / SB3's, for wall-clock (target <= 1.0, the end-to-end convention of bench/e2e_cartpole.py) and for env
steps (no target: the same algorithm should need about the same steps; it says whether a wall-clock gap is
speed or sample efficiency). Every seed's run is in the JSON ("runs": algorithm -> side -> rounds -> seeds).

    python bench/algos.py --out bench/results/algos.json [--seeds 0 1 2] [--repeats 3 | --quick]
        [--algos sac crossq rlpd]

``--quick``: one round, seed 0, a 1536 env-step cap (it will not reach -200: it shows the bench runs end to end).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
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

from rlfabric.services.core.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = -200.0
SPECS = {"sac": ROOT / "examples" / "pendulum_sac.yaml", "crossq": ROOT / "examples" / "pendulum_crossq.yaml"}
SB3_CLASS = {"sac": "stable_baselines3.SAC", "crossq": "sb3_contrib.CrossQ"}
CAPS = {"sac": 30_720, "crossq": 15_360}
"""Env-step caps of the real run: 240 and 120 iterations (the SAC example reaches about -270 in 6.4k steps, the
CrossQ example -200 in about 4k); a side not at -200 by then is not reached."""
QUICK_CAP = 1536
EVAL_EVERY_ITERATIONS = 4
EVAL_EPISODES = 20
RUN_TIMEOUT_S = 1800
RLPD_SPEC = ROOT / "examples" / "pendulum_rlpd.yaml"
RLPD_CAP = 10_240
"""Env-step cap of an RLPD side (80 iterations): the example with demos reaches -200 in about 2k env steps."""
RLPD_EVAL_EVERY_ITERATIONS = 2
RLPD_EVAL_STEPS = 128
"""The RLPD example's env steps per iteration: every side evaluates every 2 x 128 env steps."""
RLPD_DEMO_EPISODES = 10
RLPD_SIDES = {"demos": (RLPD_SPEC, []), "no_demos": (RLPD_SPEC, ["algorithm.offline_weight=0", "replay.datasets={}"]),
              "sac": (SPECS["sac"], [])}
"""The RLPD comparison's sides, each a spec and its extra ``--set``s: RLPD with the demos (the data set is added per
run), RLPD without them, and the SAC example (no demos). Each evaluates every 256 env steps."""
# BatchRenorm constants of rlfabric's batch_renorm.BatchRenorm and sb3-contrib's BatchRenorm that are not config
BRN_EPS = 1e-3
SB3_BRN_R_MAX, SB3_BRN_D_MAX = 3.0, 5.0


def overrides(seed: int, cap: int, every: int = EVAL_EVERY_ITERATIONS) -> list[str]:
    """The ``--set``s of the rlfabric run (and of the config the SB3 arguments are mapped from)."""
    return [f"seed={seed}", f"train.stop_at_eval_return={TARGET:g}", f"train.total_env_steps={cap}",
            f"train.eval_every_iterations={every}", f"train.eval_episodes={EVAL_EPISODES}",
            f"env.eval_envs={EVAL_EPISODES}"]


def per_iteration(cfg) -> int:
    return cfg.algorithm.n_steps * cfg.env.num_envs


def round_cap(cfg, steps: int) -> int:
    """A cap in whole evaluation intervals (so both sides' last evaluation is at the same step)."""
    every = per_iteration(cfg) * EVAL_EVERY_ITERATIONS
    return max(1, math.ceil(steps / every)) * every


def sb3_args(cfg) -> tuple[dict, dict, list[str]]:
    """(kwargs of the SB3 constructor, its policy_kwargs, what could not be matched) for an rlfabric config of
    the SAC or CrossQ family (the module docstring says why each mapping is what it is)."""
    a, p = cfg.algorithm, cfg.policy
    per = per_iteration(cfg)
    random_steps = math.ceil(a.learning_starts / per) * per
    kwargs = {"learning_rate": a.learning_rate, "buffer_size": cfg.replay.capacity_transitions,
              "learning_starts": max(random_steps - 1, 0), "batch_size": a.batch_size, "gamma": a.gamma,
              "train_freq": [a.n_steps, "step"], "gradient_steps": max(1, round(a.updates_per_env_step * per)),
              "ent_coef": a.ent_coef, "target_entropy": "auto" if a.target_entropy is None else a.target_entropy}
    unmatched = ["random streams: same seeds, different draws (actor noise, minibatches, warm-up actions)",
                 "critic loss scale: SB3 0.5 x sum of MSEs, rlfabric sum of MSEs (Adam: same updates up to eps)"]
    if a.name == "sac":
        kwargs |= {"tau": a.tau, "target_update_interval": 1}
        policy = {"net_arch": {"pi": list(p.hidden_sizes), "qf": list(p.hidden_sizes)}, "activation_fn": p.activation,
                  "n_critics": 2}
        unmatched.append("order within a step: SB3 temperature, critic, actor; rlfabric critic, actor, temperature")
        if p.activation != "relu":
            unmatched.append(f"critic activation: rlfabric's SAC critics use relu, SB3's the policy's {p.activation}")
    elif a.name == "crossq":
        kwargs |= {"policy_delay": a.policy_delay}
        policy = {"net_arch": {"pi": list(p.hidden_sizes), "qf": list(a.critic_hidden_sizes)},
                  "activation_fn": p.activation, "n_critics": 2, "batch_norm": True,
                  "batch_norm_momentum": round(1.0 - a.brn_momentum, 12), "batch_norm_eps": BRN_EPS,
                  "renorm_warmup_steps": a.brn_warmup_steps - 1,
                  "optimizer_kwargs": {"betas": [a.adam_beta1, 0.999]}}
        unmatched += ["sb3-contrib batch-renormalises the actor too (one batch_norm switch); rlfabric's actor is "
                      "a plain MLP",
                      f"temperature optimiser: sb3-contrib Adam betas (0.9, 0.999), not exposed; rlfabric "
                      f"({a.adam_beta1}, 0.999)",
                      "BatchRenorm: sb3-contrib's unbiased batch variance, rlfabric's biased"]
        if p.activation != "relu":
            unmatched.append(f"critic activation: rlfabric's CrossQ critics use relu, sb3-contrib's the policy's "
                             f"{p.activation}")
        if (a.brn_r_max, a.brn_d_max) != (SB3_BRN_R_MAX, SB3_BRN_D_MAX):
            unmatched.append(f"BatchRenorm r_max/d_max: the spec's {a.brn_r_max}/{a.brn_d_max}, sb3-contrib's "
                             f"fixed {SB3_BRN_R_MAX}/{SB3_BRN_D_MAX}")
    else:
        raise ValueError(f"no SB3 mapping for algorithm {a.name!r}")
    unmatched.append("env stepping: rlfabric's env service in its own process, SB3's DummyVecEnv in-process "
                     "(measured by the wall-clock ratio)")
    return kwargs, policy, unmatched


def run_sb3(algo: str, seed: int, cap: int) -> dict:
    cfg = load_config(SPECS[algo], overrides(seed, cap))
    kwargs, policy, _ = sb3_args(cfg)
    hp = {"algo": algo, "seed": seed, "total": cap, "target": TARGET, "threads": cfg.runtime.torch_threads,
          "env_id": cfg.env.id, "num_envs": cfg.env.num_envs, "eval_envs": cfg.env.eval_envs,
          "eval_episodes": cfg.train.eval_episodes, "eval_every": per_iteration(cfg) * EVAL_EVERY_ITERATIONS,
          "eval_seed": cfg.eval_seed(), "kwargs": kwargs, "policy_kwargs": policy}
    launch = time.time()
    proc = run([python(), str(ROOT / "bench" / "_sb3_pendulum.py"), json.dumps(hp)], timeout=RUN_TIMEOUT_S,
               cwd=ROOT)
    end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"SB3 {algo} seed {seed} failed: {proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    last = doc["evals"][-1] if doc["evals"] else [None, None]
    out = {"seed": seed, "reached": doc["reached_at"] is not None, "wall_s": None, "env_steps": None,
           "process_s": end - launch, "last_eval": last, "evals": len(doc["evals"])}
    if out["reached"]:
        out |= {"wall_s": doc["reached_at"] - launch, "env_steps": doc["env_steps"]}
    return out


def run_rlfabric(algo: str, seed: int, cap: int, workdir: Path, tag: str, spec: Path | None = None,
                 extra: list[str] = (), every: int = EVAL_EVERY_ITERATIONS) -> dict:
    run_dir = workdir / f"{algo}-{seed}{tag}"
    sets = [x for s in [*overrides(seed, cap, every), *extra] for x in ("--set", s)]
    launch = time.time()
    proc = run([python(), "-m", "rlfabric.services.cli", "train", str(spec or SPECS[algo]), "--run-dir", str(run_dir),
                "--quiet", *sets], timeout=RUN_TIMEOUT_S, cwd=ROOT)
    end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"rlfabric {algo} seed {seed} failed: {proc.stderr[-2000:]}")
    evals = []
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("eval_return_mean"):
                evals.append((int(float(row["env_steps"])), float(row["eval_return_mean"]), float(row["time"])))
    out = {"seed": seed, "reached": False, "wall_s": None, "env_steps": None, "process_s": end - launch,
           "last_eval": list(evals[-1][:2]) if evals else [None, None], "evals": len(evals)}
    for steps, mean, at in evals:
        if mean >= TARGET:
            return out | {"reached": True, "wall_s": at - launch, "env_steps": steps}
    return out


def make_demos(workdir: Path) -> tuple[Path, list[float]]:
    """10 episodes of an expert: the CrossQ example trained to -200 (seed 0), then ``rlfabric collect``; the data
    set and its episode returns."""
    expert = workdir / "rlpd-expert"
    proc = run([python(), "-m", "rlfabric.services.cli", "train", str(SPECS["crossq"]), "--run-dir", str(expert),
                "--quiet"], timeout=RUN_TIMEOUT_S, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the RLPD expert (CrossQ example) failed: {proc.stderr[-2000:]}")
    demos = workdir / "rlpd-demos.npz"
    proc = run([python(), "-m", "rlfabric.services.cli", "collect", str(expert / "checkpoints" / "final.pt"),
                "--episodes", str(RLPD_DEMO_EPISODES), "--out", str(demos)], timeout=RUN_TIMEOUT_S, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"collecting the RLPD demos failed: {proc.stderr[-2000:]}")
    import numpy as np

    with np.load(demos) as data:
        returns = [float(data["rewards"][data["episode"] == e].sum()) for e in np.unique(data["episode"])]
    return demos, returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "algos.json"))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--algos", nargs="+", choices=[*sorted(SPECS), "rlpd"], default=[*SPECS, "rlpd"])
    parser.add_argument("--max-env-steps", type=int, default=None,
                        help=f"env-step cap of every run (default {CAPS}; --quick: {QUICK_CAP}), rounded up to "
                             f"whole evaluation intervals")
    add_repeat_args(parser)
    args = parser.parse_args()
    repeats = repeat_count(args)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    with_rlpd = "rlpd" in args.algos
    args.algos = [a for a in args.algos if a in SPECS]  # the SB3 pairs
    caps = {}
    for algo in args.algos:
        want = args.max_env_steps or (QUICK_CAP if args.quick else CAPS[algo])
        caps[algo] = round_cap(load_config(SPECS[algo]), want)
    rlpd_cap = args.max_env_steps or (QUICK_CAP if args.quick else RLPD_CAP)
    # the SAC example gets its own cap (it needs ~6k env steps): a side cut short would count as never reaching
    rlpd_caps = {who: rlpd_cap if who != "sac" or args.max_env_steps or args.quick else CAPS["sac"]
                 for who in RLPD_SIDES}
    # algorithm -> side -> one list per round -> one result per seed
    results: dict[str, dict[str, list[list[dict]]]] = {a: {"sb3": [], "rlfabric": []} for a in args.algos}
    rlpd_results: dict[str, list[list[dict]]] = {who: [] for who in RLPD_SIDES}
    rlpd_demos: dict = {}
    with tempfile.TemporaryDirectory(prefix="rlfabric-bench-algos-") as tmp:

        def side(algo: str, who: str):
            def measure() -> dict[str, float | None]:
                rounds = results[algo][who]
                tag = f"-round{len(rounds)}"
                rs = [run_sb3(algo, seed, caps[algo]) if who == "sb3"
                      else run_rlfabric(algo, seed, caps[algo], Path(tmp), tag) for seed in seeds]
                rounds.append(rs)
                for r in rs:
                    got = (f"{r['wall_s']:.1f}s at {r['env_steps']} env steps" if r["reached"] else
                           f"not reached by {caps[algo]} env steps (last eval {_eval(r['last_eval'])})")
                    print(f"  {algo} seed {r['seed']} {who:>8}: {got}; process {r['process_s']:.1f}s", flush=True)
                return {f"{algo} {who} wall_s": over_seeds(rs, "wall_s"),
                        f"{algo} {who} env_steps": over_seeds(rs, "env_steps")}
            return measure

        print(f"env steps and wall-clock s to a deterministic eval mean of {TARGET:g} on Pendulum-v1 "
              f"({EVAL_EPISODES} episodes every {EVAL_EVERY_ITERATIONS} iterations), median over seeds {seeds}, "
              f"caps {caps}" + (f"; RLPD with and without demos: every {RLPD_EVAL_EVERY_ITERATIONS} iterations, "
                                 f"cap {rlpd_cap}" if with_rlpd else ""), flush=True)
        sides = {f"{algo} {who}": side(algo, who) for algo in args.algos for who in ("sb3", "rlfabric")}
        if with_rlpd:
            demos, returns = make_demos(Path(tmp))
            rlpd_demos |= {"episodes": len(returns), "mean_return": sum(returns) / len(returns), "returns": returns}
            print(f"RLPD demos: {len(returns)} expert episodes, mean return {rlpd_demos['mean_return']:.1f}",
                  flush=True)

            def rlpd_side(who: str):
                def measure() -> dict[str, float | None]:
                    rounds = rlpd_results[who]
                    spec, extra = RLPD_SIDES[who]
                    extra = [*extra, *([f"replay.datasets={{offline: {demos}}}"] if who == "demos" else [])]
                    every = RLPD_EVAL_EVERY_ITERATIONS * RLPD_EVAL_STEPS // per_iteration(load_config(spec))
                    cap = rlpd_caps[who]
                    rs = [run_rlfabric(f"rlpd-{who}", seed, cap, Path(tmp), f"-round{len(rounds)}", spec,
                                       extra, every) for seed in seeds]
                    rounds.append(rs)
                    for r in rs:
                        got = (f"{r['env_steps']} env steps ({r['wall_s']:.1f}s)" if r["reached"] else
                               f"not reached by {cap} env steps (last eval {_eval(r['last_eval'])})")
                        print(f"  rlpd seed {r['seed']} {who:>8}: {got}; process {r['process_s']:.1f}s", flush=True)
                    return {f"rlpd {who} env_steps": over_seeds(rs, "env_steps")}
                return measure

            sides |= {f"rlpd {who}": rlpd_side(who) for who in RLPD_SIDES}
        samples = interleave(sides, repeats)
    metrics: dict = {"target_eval_return": TARGET, "seeds": seeds, "eval_episodes": EVAL_EPISODES,
                     "eval_every_iterations": EVAL_EVERY_ITERATIONS}
    ratios, targets, compares = {}, {}, {}
    for algo in args.algos:
        cfg = load_config(SPECS[algo], overrides(seeds[0], caps[algo]))
        kwargs, policy, unmatched = sb3_args(cfg)
        m = {"spec": str(SPECS[algo].relative_to(ROOT)), "overrides": overrides(seeds[0], caps[algo]),
             "cap_env_steps": caps[algo], "sb3_class": SB3_CLASS[algo],
             "sb3_args": kwargs | {"policy_kwargs": policy, "n_envs": cfg.env.num_envs,
                                   "torch_threads": cfg.runtime.torch_threads},
             "unmatched": unmatched, "runs": results[algo]}
        for who in ("rlfabric", "sb3"):
            m[f"{who}_median_wall_s"] = median_of(samples[f"{algo} {who} wall_s"])
            m[f"{who}_median_env_steps"] = median_of(samples[f"{algo} {who} env_steps"])
            m[f"{who}_wall_s_per_round"] = samples[f"{algo} {who} wall_s"]
        metrics[algo] = m
        for what, target in (("wall", "<=1.0"), ("env_steps", "")):
            key = f"{algo}_{what}_to_{TARGET:g}_vs_sb3"
            unit = "wall_s" if what == "wall" else "env_steps"
            num, den = f"{algo} rlfabric {unit}", f"{algo} sb3 {unit}"
            ratios[key] = ratio_of_medians(samples, num, den)
            compares[key] = [num, den]
            if target:
                targets[key] = target
        print(f"{algo:>7}: rlfabric {_s(m['rlfabric_median_wall_s'])} / "
              f"{_s(m['rlfabric_median_env_steps'], '.0f', ' steps')}   {SB3_CLASS[algo]}: "
              f"{_s(m['sb3_median_wall_s'])} / {_s(m['sb3_median_env_steps'], '.0f', ' steps')}", flush=True)
    if with_rlpd:
        for key, base, target in (("rlpd_vs_sac_env_steps", "sac", "<=0.7"),
                                  ("rlpd_demos_vs_no_demos_env_steps", "no_demos", "")):
            ratios[key] = ratio_of_medians(samples, "rlpd demos env_steps", f"rlpd {base} env_steps")
            compares[key] = ["rlpd demos env_steps", f"rlpd {base} env_steps"]
            if target:
                targets[key] = target
        metrics["rlpd"] = {"spec": str(RLPD_SPEC.relative_to(ROOT)), "cap_env_steps": rlpd_caps,
                           "eval_every_env_steps": RLPD_EVAL_EVERY_ITERATIONS * RLPD_EVAL_STEPS,
                           "sides": {who: [str(spec.relative_to(ROOT)), extra]
                                     for who, (spec, extra) in RLPD_SIDES.items()},
                           "demos": rlpd_demos, "runs": rlpd_results,
                           **{f"{who}_median_env_steps": median_of(samples[f"rlpd {who} env_steps"])
                              for who in RLPD_SIDES}}
        print(f"   rlpd: with demos {_s(metrics['rlpd']['demos_median_env_steps'], '.0f', ' steps')}   without "
              f"them {_s(metrics['rlpd']['no_demos_median_env_steps'], '.0f', ' steps')}   SAC example "
              f"{_s(metrics['rlpd']['sac_median_env_steps'], '.0f', ' steps')}", flush=True)
    report("algos", metrics, ratios, targets, args.out, sides=samples, compares=compares, repeats=repeats)


def over_seeds(results: list[dict], key: str) -> float:
    """Median over seeds; a seed that never reached the target counts as infinitely slow."""
    return seed_median(r[key] if r["reached"] else None for r in results)


def _eval(last: list) -> str:
    return "none" if last[1] is None else f"{last[1]:.1f} at {last[0]}"


def _s(value: float | None, spec: str = ".1f", unit: str = "s") -> str:
    return "not reached" if value is None else f"{value:{spec}}{unit}"


if __name__ == "__main__":
    main()
