"""``bench/gpu_check.py --examples``: every example spec, and every algorithm at least once, through all services on
one device (issue 40: the LM family had never run on a GPU, and nothing in CI could see it).

Each entry runs in a process of its own (gpu_check's ``run_check``) under its own time budget: a local stack (the
processes the spec's plan needs), the spec submitted with ``runtime.device=<device>`` through the coordinator's API,
watched until ``ITERATIONS`` metrics rows arrived, then stopped; an entry whose later entries need its artefacts
(a supervised run whose Hugging Face export a GRPO example starts from) runs to its end instead. A warm-started
example also runs once through ``rlfabric train``, so that its stages (vision, demonstrations, the supervised
algorithm) run on the device too.

What the examples' headers make by hand first (data sets, an SFT checkpoint) is made here small, on the CPU, in a
work directory shared by the entries (``PREPARE``). Examples that start from a checkpoint an earlier stage writes
start from random weights instead (``SETS``): the device path is the same.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 2  # metrics rows an entry must produce
RLFABRIC = [sys.executable, "-m", "rlfabric.services.cli"]

# The data sets the examples' headers make by hand, at a size that takes seconds (paths as the specs name them).
PREPARE = [
    [sys.executable, "-m", "rlfabric.services.env.tasks.sft_data", "runs/arith_sft.npz", "--task", "arith", "--level", "2",
     "--rows", "256"],
    [sys.executable, str(ROOT / "bench" / "reasoning_data.py"), "runs/reasoning", "--train", "256", "--held-out",
     "32"],
    [*RLFABRIC, "collect", "examples/pendulum_sac.yaml", "--random", "--episodes", "4", "--out",
     "runs/pendulum-mixed.npz"],
    [*RLFABRIC, "collect", "examples/pendulum_sac.yaml", "--random", "--episodes", "4", "--out",
     "runs/pendulum-demos.npz"],  # pendulum_rlpd's demos (random ones: the code path, not the result)
    [*RLFABRIC, "collect", "examples/arm_reach_flow_sft.yaml", "--expert", "--episodes", "4", "--out",
     "runs/arm-reach-demos.npz"],  # the flow policy arm_reach_dsrl steers learns from these
]
# A supervised run that ends quickly, so that the next entry starts from its export (checkpoints/hf).
SHORT_SFT = ["algorithm.total_updates=4", "algorithm.updates_per_iteration=2", "train.eval_every_iterations=0"]
SETS: dict[str, list[str]] = {
    "arith_grpo": ["policy.init_checkpoint=''"],
    "tool_grpo": ["policy.init_checkpoint=''"],
    "sums_sft": SHORT_SFT,
    "arith_sft": SHORT_SFT,
    "arith_opd": ["policy.init_checkpoint=''", "algorithm.expert_checkpoint=runs/arith-sft/checkpoints/final.pt"],
    "reasoning_sft": SHORT_SFT,
    "sums_grpo": ["policy.lm.path=runs/sums-sft/checkpoints/hf"],
    "reasoning_grpo": ["policy.lm.path=runs/reasoning-sft/checkpoints/hf"],
    "pendulum_crossq": ["train.total_env_steps=1000"],  # to its end, short: its final.pt is the dagger variant's expert
}
RUN_DIRS = {"sums_sft": "sums-sft", "reasoning_sft": "reasoning-sft", "arith_sft": "arith-sft",  # read back
            "pendulum_crossq": "pendulum-crossq",  # (and the dagger variant's expert)
            "arm_reach_flow_sft": "arm-reach-flow-sft"}  # (arm_reach_dsrl's base)
FINISH = {"sums_sft", "reasoning_sft", "pendulum_crossq", "arith_sft", "arm_reach_flow_sft"}  # run to the end (their exports and checkpoints feed
# the entries after them)
NEEDS_GATEWAY = {"robot_reach_ppo", "robot_reach_hg_dagger"}
SKIP = {"cartpole_ppo_compose"}  # cartpole_ppo's spec for the compose stack (Redis, MinIO): same code on the device
# Algorithms no example trains as its own run: each on an example whose data fits it.
VARIANTS = {
    "dapo": ("arith_grpo", ["algorithm.name=dapo", "policy.init_checkpoint=''"]),
    "reinforce_pp": ("arith_grpo", ["algorithm.name=reinforce_pp", "policy.init_checkpoint=''"]),
    "gspo": ("arith_grpo", ["algorithm.name=gspo", "policy.init_checkpoint=''"]),
    "cispo": ("arith_grpo", ["algorithm.name=cispo", "policy.init_checkpoint=''"]),
    "ppo_lm": ("arith_grpo", ["algorithm.name=ppo_lm", "policy.init_checkpoint=''"]),
    "bc": ("pendulum_iql", ["algorithm={name: bc}"]),
    # an expert: a checkpoint of CrossQ's example (it must have run to its end into runs/pendulum-crossq first)
    "dagger": ("pendulum_crossq", ["algorithm={name: dagger, expert_checkpoint: runs/pendulum-crossq/checkpoints/final.pt}"]),
}
# Warm-started examples through `rlfabric train`: their stages at the smallest sizes, then one iteration of RL.
WARM_SETS = ["warm_start.vision.scenes=64", "warm_start.vision.updates=2", "warm_start.demos=2",
             "warm_start.supervised.total_updates=2", "warm_start.supervised.updates_per_iteration=1",
             "train.total_env_steps=1", "train.eval_every_iterations=0"]
WARM = ("arm_reach_pi0", "arm_reach_vla_tokens")


@dataclass
class Entry:
    name: str
    spec: str  # an example's stem
    sets: list[str] = field(default_factory=list)
    finish: bool = False
    cli: bool = False  # through `rlfabric train` (its warm-start stages), not the coordinator's API

    @property
    def path(self) -> Path:
        return ROOT / "examples" / f"{self.spec}.yaml"


def entries() -> list[Entry]:
    """Every example (supervised runs before the GRPO runs that start from them), the algorithms no example trains,
    and the warm-started examples' stages."""
    stems = sorted(p.stem for p in (ROOT / "examples").glob("*.yaml") if p.stem not in SKIP)
    stems.sort(key=lambda s: s not in FINISH)  # exports first
    out = [Entry(s, s, SETS.get(s, []), finish=s in FINISH) for s in stems]
    out += [Entry(f"{spec}+{name}", spec, sets) for name, (spec, sets) in VARIANTS.items()]
    out += [Entry(f"{spec}+warm_start", spec, WARM_SETS, finish=True, cli=True) for spec in WARM]
    return out


def by_name() -> dict[str, Entry]:
    return {e.name: e for e in entries()}


def budget_s(name: str) -> float:
    """An entry's ceiling: a stack's start (~10 s), model builds, then its iterations. Not yet measured on a GPU:
    set from CPU runs of the same entries, which are slower."""
    entry = by_name()[name]
    if entry.cli:
        return 150.0
    return 75.0 if any(k in entry.spec for k in ("pi0", "vla", "reasoning")) else 45.0


def prepare(work: Path) -> None:
    """The work directory the entries share: the repository's examples (their data files), and the data sets the
    examples' headers make by hand, made small."""
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (work / "examples").symlink_to(ROOT / "examples")
    (work / "runs").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for cmd in PREPARE:
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"preparing the examples' data failed: {' '.join(cmd)}\n{done.stderr[-1500:]}")


@contextlib.contextmanager
def _gateway(work: Path, token: str):
    """A robot gateway (sim arms) for the robot examples, on the stack's secret, and the scripted teleop expert
    the HG-DAgger example asks for; yields the gateway's address."""
    env = {**os.environ, "RLFABRIC_TOKEN": token}
    port_file = work / "runs" / f"gateway-{os.getpid()}.addr"
    procs = [subprocess.Popen([*RLFABRIC, "serve", "robot_gateway", "--port-file", str(port_file)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError("the robot gateway did not start")
            time.sleep(0.2)
        address = port_file.read_text().strip()
        procs.append(subprocess.Popen([*RLFABRIC, "teleop", "--gateway", address, "--expert-goal", "0.35,0.15,0.25",
                                       "--start", "0,-0.3,0.6", "--start-tolerance", "0.2"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield address
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()


def run(name: str, device: str, work: Path) -> dict:
    """One entry on ``device``, in ``work`` (prepared); its figures, or an exception naming what failed."""
    from rlfabric.services.core.config import load_config
    from rlfabric.services.launcher import LocalStack, roles_for

    entry = by_name()[name]
    os.chdir(work)  # the specs' relative paths (runs/..., examples/data/...) are the work directory's
    sets = [*entry.sets, f"runtime.device={device}"]
    if entry.cli:
        started = time.monotonic()
        done = subprocess.run([*RLFABRIC, "train", str(entry.path), "--quiet", "--run-dir", f"runs/{name}",
                               *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"rlfabric train exited {done.returncode}: {(done.stderr or done.stdout)[-800:]}")
        return {"seconds": round(time.monotonic() - started, 1), "via": "rlfabric train (warm-start stages)"}
    config = load_config(entry.path, sets)  # (a bad entry fails here, naming the field)
    from rlfabric.services.coordinator.client import CoordinatorClient
    from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2

    with LocalStack(log_dir=work / "runs" / f"logs-{name}", runs_root=work / "runs", roles=roles_for(config)) as stack:
        with _gateway(work, stack.token) if entry.spec in NEEDS_GATEWAY else contextlib.nullcontext() as gateway:
            if gateway:
                sets.append(f"env.options.gateway={gateway}")
            client = CoordinatorClient(stack.address)
            client.wait_ready(60)
            started = time.monotonic()
            status = client.submit(entry.path, overrides=sets, run_dir=RUN_DIRS.get(name, name))
            rows, first = 0, None
            for event in client.watch(status.run_id):
                if event.HasField("metrics"):
                    rows += 1
                    first = first or time.monotonic()
                    if rows == ITERATIONS and not entry.finish:
                        client.stop(status.run_id)
            final = client.status(status.run_id)
            client.close()
    state = coordinator_pb2.RunState.Name(final.state)
    if state == "FAILED" or rows < (1 if entry.finish else ITERATIONS):
        raise RuntimeError(f"{state} after {rows} metrics rows: {final.reason[:800]}")
    return {"seconds_to_first_row": round((first or time.monotonic()) - started, 1), "rows": rows, "state": state,
            "algorithm": config.algorithm.name, "policy": config.policy_name}
