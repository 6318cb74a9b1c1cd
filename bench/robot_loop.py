"""The robot gateway's control loop against the peers' method, in one run: lateness and jitter (p50, p99, max) of
the gateway's deadline loop (services/robot_gateway/loop.py: tick k due at start + k * period) in its arm process
(services/robot_gateway/arm_process.py, as Connect starts it), of the same loop as a thread of the commanding
process (how the gateway ran it before), and of a sleep-after-work loop (do the tick, then sleep what is left of the
period: what RLinf, SERL and LeRobot do), at 100 Hz and 500 Hz, on the sim arm, alone and while a training run
(MuJoCo HalfCheetah PPO through every service) shares the 2 cores. Then 8 arm processes at 500 Hz: how soon an
EStop latches in its arm's process and holds the arm, and how long stopping an arm stalls the others.

All loops do the same work per tick (read the arm, filter the command, step the arm) with the same priority and
CPU pinning, so the figures compare the methods. Lateness is how late a tick woke after its scheduled time
(start + k * period); jitter is |tick-to-tick period - nominal period|.

Every measurement runs in ``--repeats`` rounds (default 3; ``--quick``: one): in each condition (the training load
started once and shared by its rounds) each round runs every rate's deadline loop and sleep-after-work loop in turn,
and the CPU cost of the spin alternates with and without it the same way. A loop's p99 jitter and p99 lateness in a
round are its sides' samples; the ratios are ratios of the sides' medians over the rounds, each side's median, min
and max are printed and written ("sides"), and a side whose spread (max - min) exceeds 20% of its median is flagged
NOISY with every ratio that uses it. The per-round tick statistics are kept in the JSON.

    python bench/robot_loop.py --out bench/results/robot_loop.json [--seconds 60] [--repeats 3 | --quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import add_repeat_args, interleave, median_of, ratio_of_medians, repeat_count, report  # noqa: E402

START = "0,-0.3,0.6"


def _drive(loop, seconds: float) -> tuple[np.ndarray, np.ndarray, str]:
    """Command ``loop`` (an ArmProcess or a ControlLoop: one interface) every 5 ms for ``seconds``; its ticks'
    lateness and jitter, and the priority it got."""
    lateness, jitter = [], []
    loop.listeners.append(lambda t: (lateness.append(t.lateness_s), jitter.append(t.jitter_s)))
    loop.start()
    end, seq = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        seq += 1
        loop.submit(np.array([0.1 * np.sin(seq / 50), -0.3, 0.6]), seq)
        time.sleep(0.005)
    loop.stop()
    return np.array(lateness[1:]), np.array(jitter[1:]), loop.realtime


def deadline_loop(hz: float, seconds: float) -> tuple[np.ndarray, np.ndarray, str]:
    """The gateway's loop as the gateway runs it: in an arm process of its own (ArmProcess), commanded at its rate
    from this process."""
    from rlfabric.services.robot_gateway.arm_process import ArmProcess

    return _drive(ArmProcess("bench", "sim", {"start": START}, hz, watchdog_s=1.0, spin_s=0.001), seconds)


def deadline_in_thread(hz: float, seconds: float) -> tuple[np.ndarray, np.ndarray, str]:
    """The same loop as a thread of the commanding process (how the gateway ran it before arm processes): its tick
    waits for the GIL behind the process's other threads."""
    from rlfabric.services.robot_gateway.drivers import build_driver
    from rlfabric.services.robot_gateway.loop import ControlLoop

    return _drive(ControlLoop("bench-thread", build_driver("sim", {"start": START}), hz, watchdog_s=1.0), seconds)


ARMS, ARMS_HZ, ESTOPS = 8, 500.0, 40


def estop_across_arms(seconds: float) -> dict[str, float]:
    """``ARMS`` arm processes at ``ARMS_HZ`` (no spin: they share a core); ``ESTOPS`` EStops, one arm at a time in
    turn, at a random phase of its period, each timed from the request to the latch in the arm's process (from
    then on no new target reaches the arm: targets change only at ticks) and to the first tick that held (then
    cleared). Then the arms stop one by one, and the others' worst lateness meanwhile is the stall a Disconnect
    costs its neighbours."""
    from rlfabric.services.robot_gateway.arm_process import ArmProcess

    rng = np.random.default_rng(0)
    arms = [ArmProcess(f"bench-{i}", "sim", {"start": START}, ARMS_HZ, watchdog_s=1.0, spin_s=0.0)
            for i in range(ARMS)]
    latched: list[float] = []
    held: list[float] = []
    stopping = [False]
    stall = [0.0]
    for arm in arms:
        arm.listeners.append(lambda t: stall.__setitem__(0, max(stall[0], t.lateness_s)) if stopping[0] else None)
    try:
        for arm in arms:
            arm.start()
        time.sleep(min(seconds, 2.0))
        for n in range(ESTOPS):
            arm = arms[n % ARMS]
            time.sleep(rng.uniform(0.02, 0.04))
            t0 = time.monotonic()
            arm.estop("bench")
            while not (arm.last.estopped and arm.last.time > t0) and time.monotonic() - t0 < 1.0:
                time.sleep(0.0002)
            tick = arm.last
            latched.append(tick.estop_at - t0 if tick.estopped else float("inf"))
            held.append(tick.time - t0 if tick.estopped else float("inf"))
            arm.clear()
    finally:
        stopping[0] = True
        for arm in arms:
            arm.stop()
    latched_ms, held_ms = np.array(latched) * 1e3, np.array(held) * 1e3
    return {"estop_latched_p50_ms": float(np.median(latched_ms)), "estop_latched_max_ms": float(latched_ms.max()),
            "estop_held_p50_ms": float(np.median(held_ms)), "estop_held_max_ms": float(held_ms.max()),
            "stop_stall_max_ms": stall[0] * 1e3, "period_ms": 1e3 / ARMS_HZ, "estops": len(latched)}


def sleep_after_work_loop(hz: float, seconds: float) -> tuple[np.ndarray, np.ndarray, str]:
    """The peers' loop: the same tick, then sleep(period - elapsed); measured against the same ideal schedule."""
    from rlfabric.services.robot_gateway.drivers import build_driver
    from rlfabric.services.robot_gateway.loop import ControlLoop

    probe = ControlLoop("bench-saw", build_driver("sim", {"start": START}), hz, watchdog_s=1.0)  # same privileges
    driver, period = probe.driver, 1.0 / hz
    lateness, jitter, info = [], [], {}

    def run() -> None:
        info["realtime"] = probe._claim_realtime()
        start = last = time.monotonic()
        target = driver.read()[0]
        k = 0
        while time.monotonic() - start < seconds:
            t0 = time.monotonic()
            k += 1
            lateness.append(t0 - (start + k * period))
            jitter.append(abs((t0 - last) - period))
            last = t0
            position, _ = driver.read()
            command = np.array([0.1 * np.sin(k / 50), -0.3, 0.6])
            target = probe.safety.apply(command, position, target, period).target
            driver.command(target, period)
            time.sleep(max(0.0, period - (time.monotonic() - t0)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return np.array(lateness[1:]), np.array(jitter[1:]), info["realtime"]


SPINS = (0.002, 0.0)


def spin_cpu(hz: float, seconds: float, spin: float) -> float:
    """CPU seconds per second of the deadline loop with a spin of ``spin`` s (the default 2 ms: the last 2 ms before a
    deadline busy-wait; 0: sleep to the deadline): what ``spin_s`` saves on a host with many arms."""
    from rlfabric.services.robot_gateway.drivers import build_driver
    from rlfabric.services.robot_gateway.loop import ControlLoop

    loop = ControlLoop("bench-spin", build_driver("sim", {"start": START}), hz, watchdog_s=1.0, spin_s=spin)
    c0, t0 = time.process_time(), time.monotonic()
    loop.start()
    time.sleep(seconds)
    loop.stop()
    return (time.process_time() - c0) / (time.monotonic() - t0)


def stats(values: np.ndarray) -> dict[str, float]:
    return {"p50_ms": float(np.percentile(values, 50) * 1e3), "p99_ms": float(np.percentile(values, 99) * 1e3),
            "max_ms": float(values.max() * 1e3), "ticks": int(len(values))}


class TrainingLoad:
    """A real training run sharing the machine (HalfCheetah PPO through every service), long enough to outlast
    the measurements."""

    def __enter__(self) -> TrainingLoad:
        self.tmp = tempfile.mkdtemp(prefix="robot-loop-load-")
        self.proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "train", "examples/halfcheetah_ppo.yaml",
                                      "--run-dir", self.tmp, "--quiet", "--set", "train.eval_every_iterations=0"],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
        metrics = Path(self.tmp) / "metrics.csv"
        deadline = time.monotonic() + 120
        while not metrics.exists() and time.monotonic() < deadline:  # training, not starting up
            time.sleep(0.5)
        if self.proc.poll() is not None or not metrics.exists():
            raise SystemExit("the training load did not start (run examples/halfcheetah_ppo.yaml by hand to see why)")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="per measurement")
    ap.add_argument("--rates", default="100,500")
    ap.add_argument("--conditions", default="alone,under_training_load",
                    help="comma-separated: alone, under_training_load (the headline ratios are the latter's)")
    ap.add_argument("--out", default="bench/results/robot_loop.json")
    add_repeat_args(ap)
    args = ap.parse_args()
    repeats = repeat_count(args)
    conditions = [c for c in args.conditions.split(",") if c]
    for c in conditions:
        if c not in ("alone", "under_training_load"):
            ap.error(f"--conditions: unknown {c!r}")
    metrics: dict = {"seconds": args.seconds}
    samples: dict[str, list[float]] = {}

    def loop_side(condition: str, hz: float, method: str, fn):
        name = f"{condition}/{int(hz)}hz/{method}"

        def measure() -> dict[str, float]:
            late, jit, realtime = fn(hz, args.seconds)
            m = {"lateness": stats(late), "jitter": stats(jit), "realtime": realtime}
            metrics.setdefault(name, {"rounds": []})["rounds"].append(m)
            print(f"{condition:20s} {int(hz):4d} Hz {method:16s} jitter p50 {m['jitter']['p50_ms']:.3f} "
                  f"p99 {m['jitter']['p99_ms']:.3f} max {m['jitter']['max_ms']:.3f} ms | lateness p99 "
                  f"{m['lateness']['p99_ms']:.3f} max {m['lateness']['max_ms']:.3f} ms", flush=True)
            return {f"{name} jitter_p99_ms": m["jitter"]["p99_ms"], f"{name} lateness_p99_ms": m["lateness"]["p99_ms"],
                    f"{name} lateness_max_ms": m["lateness"]["max_ms"]}
        return measure

    def estop_side(condition: str):
        arms = f"{condition}/{ARMS}_arms_{int(ARMS_HZ)}hz"

        def measure() -> dict[str, float]:
            m = estop_across_arms(args.seconds)
            metrics.setdefault(arms, {"estop_rounds": []})["estop_rounds"].append(m)
            print(f"{arms:30s} EStop latched p50 {m['estop_latched_p50_ms']:.3f} max {m['estop_latched_max_ms']:.3f} "
                  f"ms, held by a tick p50 {m['estop_held_p50_ms']:.3f} max {m['estop_held_max_ms']:.3f} ms (period "
                  f"{m['period_ms']:.1f} ms); a stop stalls the others {m['stop_stall_max_ms']:.3f} ms", flush=True)
            return {f"{arms} {k}": m[k] for k in ("estop_latched_max_ms", "estop_held_max_ms", "stop_stall_max_ms")}
        return arms, measure

    for condition in conditions:
        with TrainingLoad() if condition == "under_training_load" else _Nothing():
            sides = {f"{condition}/{int(hz)}hz/{method}": loop_side(condition, hz, method, fn)
                     for hz in (float(r) for r in args.rates.split(","))
                     for method, fn in (("deadline", deadline_loop), ("deadline_in_thread", deadline_in_thread),
                                        ("sleep_after_work", sleep_after_work_loop))}
            samples |= interleave(dict([*sides.items(), estop_side(condition)]), repeats)
    for m in metrics.values():  # each loop's figures: the median over the rounds of each statistic
        if isinstance(m, dict) and "rounds" in m:
            for what in ("lateness", "jitter"):
                m[what] = {k: median_of([r[what][k] for r in m["rounds"]]) for k in m["rounds"][0][what]}
            m["realtime"] = m["rounds"][-1]["realtime"]
        if isinstance(m, dict) and "estop_rounds" in m:
            m.update({k: median_of([r[k] for r in m["estop_rounds"]]) for k in m["estop_rounds"][0]})
    spin_seconds = min(args.seconds, 10.0)
    samples |= interleave({f"alone/100hz/cpu_per_s_spin_{spin * 1e3:g}ms": (lambda spin=spin: spin_cpu(
        100.0, spin_seconds, spin)) for spin in SPINS}, repeats)
    metrics["alone/100hz/spin_cpu"] = spin = {f"cpu_per_s_spin_{s * 1e3:g}ms": median_of(
        samples[f"alone/100hz/cpu_per_s_spin_{s * 1e3:g}ms"]) for s in SPINS}
    print(f"alone 100 Hz CPU s per s: spin 2 ms {spin['cpu_per_s_spin_2ms']:.3f}, "
          f"no spin {spin['cpu_per_s_spin_0ms']:.3f} (medians)")
    ratios: dict[str, float | None] = {}
    compares: dict[str, list[str]] = {}
    targets: dict[str, str] = {}

    def absolute(key: str, side: str, target: str) -> None:  # a side's own median, against an absolute goal
        if side in samples:
            ratios[key], compares[key], targets[key] = median_of(samples[side]), [side], target

    def relative(key: str, a: str, b: str, target: str | None = None) -> None:
        if a in samples and b in samples:
            ratios[key], compares[key] = ratio_of_medians(samples, a, b), [a, b]
            if target:
                targets[key] = target

    for condition, short in (("under_training_load", "under_load"), ("alone", "alone")):
        for hz in (100, 500):
            side = f"{condition}/{hz}hz"
            absolute(f"p99_jitter_ms_{hz}hz_{short}", f"{side}/deadline jitter_p99_ms", "<=0.05")
            for what in ("jitter", "lateness"):
                relative(f"p99_{what}_arm_process_vs_in_thread_{hz}hz_{short}", f"{side}/deadline {what}_p99_ms",
                         f"{side}/deadline_in_thread {what}_p99_ms")
                relative(f"p99_{what}_deadline_vs_sleep_after_work_{hz}hz_{short}",
                         f"{side}/deadline {what}_p99_ms", f"{side}/sleep_after_work {what}_p99_ms")
        absolute(f"max_lateness_ms_100hz_{short}", f"{condition}/100hz/deadline lateness_max_ms", "<=1"
                 if short == "under_load" else "")
        arms = f"{condition}/{ARMS}_arms_{int(ARMS_HZ)}hz"
        for what in ("latched", "held"):  # in periods: the goal is the EStop applied within one
            if f"{arms} estop_{what}_max_ms" in samples:
                ratios[key := f"estop_{what}_max_periods_{ARMS}_arms_{int(ARMS_HZ)}hz_{short}"] = \
                    median_of(samples[f"{arms} estop_{what}_max_ms"]) * ARMS_HZ / 1e3
                compares[key] = [f"{arms} estop_{what}_max_ms"]
                targets[key] = "<=1" if what == "latched" else ""
        absolute(f"stop_stall_max_ms_{ARMS}_arms_{int(ARMS_HZ)}hz_{short}", f"{arms} stop_stall_max_ms", "")
    targets = {k: v for k, v in targets.items() if v}
    relative("cpu_no_spin_vs_spin_2ms_100hz", "alone/100hz/cpu_per_s_spin_0ms", "alone/100hz/cpu_per_s_spin_2ms",
             "<0.7")
    report("robot_loop", metrics, ratios, targets, args.out, sides=samples,
           compares=compares, repeats=repeats)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


if __name__ == "__main__":
    main()
