"""The robot gateway's control loop against the peers' method, in one run: lateness and jitter (p50, p99, max) of
a deadline loop (services/robot_gateway/loop.py: tick k due at start + k * period) and of a sleep-after-work loop
(do the tick, then sleep what is left of the period: what RLinf, SERL and LeRobot do), at 100 Hz and 500 Hz, on the
sim arm, alone and while a training run (MuJoCo HalfCheetah PPO through every service) shares the 2 cores.

Both loops do the same work per tick (read the arm, filter the command, step the arm) with the same priority and
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


def deadline_loop(hz: float, seconds: float) -> tuple[np.ndarray, np.ndarray, str]:
    """The gateway's own loop, commanded at its rate; its ticks' lateness and jitter."""
    from services.robot_gateway.drivers import build_driver
    from services.robot_gateway.loop import ControlLoop

    loop = ControlLoop("bench", build_driver("sim", {"start": START}), hz, watchdog_s=1.0)
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


def sleep_after_work_loop(hz: float, seconds: float) -> tuple[np.ndarray, np.ndarray, str]:
    """The peers' loop: the same tick, then sleep(period - elapsed); measured against the same ideal schedule."""
    from services.robot_gateway.drivers import build_driver
    from services.robot_gateway.loop import ControlLoop

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
    from services.robot_gateway.drivers import build_driver
    from services.robot_gateway.loop import ControlLoop

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
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "train", "examples/halfcheetah_ppo.yaml",
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
            return {f"{name} jitter_p99_ms": m["jitter"]["p99_ms"], f"{name} lateness_p99_ms": m["lateness"]["p99_ms"]}
        return measure

    for condition in conditions:
        with TrainingLoad() if condition == "under_training_load" else _Nothing():
            samples |= interleave({f"{condition}/{int(hz)}hz/{method}": loop_side(condition, hz, method, fn)
                                   for hz in (float(r) for r in args.rates.split(","))
                                   for method, fn in (("deadline", deadline_loop),
                                                      ("sleep_after_work", sleep_after_work_loop))}, repeats)
    for m in metrics.values():  # each loop's figures: the median over the rounds of each statistic
        if isinstance(m, dict) and "rounds" in m:
            for what in ("lateness", "jitter"):
                m[what] = {k: median_of([r[what][k] for r in m["rounds"]]) for k in m["rounds"][0][what]}
            m["realtime"] = m["rounds"][-1]["realtime"]
    spin_seconds = min(args.seconds, 10.0)
    samples |= interleave({f"alone/100hz/cpu_per_s_spin_{spin * 1e3:g}ms": (lambda spin=spin: spin_cpu(
        100.0, spin_seconds, spin)) for spin in SPINS}, repeats)
    metrics["alone/100hz/spin_cpu"] = spin = {f"cpu_per_s_spin_{s * 1e3:g}ms": median_of(
        samples[f"alone/100hz/cpu_per_s_spin_{s * 1e3:g}ms"]) for s in SPINS}
    print(f"alone 100 Hz CPU s per s: spin 2 ms {spin['cpu_per_s_spin_2ms']:.3f}, "
          f"no spin {spin['cpu_per_s_spin_0ms']:.3f} (medians)")
    ratios: dict[str, float | None] = {}
    compares: dict[str, list[str]] = {}
    load = "under_training_load/100hz"
    if f"{load}/deadline jitter_p99_ms" in samples:
        deadline, saw = f"{load}/deadline", f"{load}/sleep_after_work"
        ratios["p99_jitter_ms_100hz_under_load"] = median_of(samples[f"{deadline} jitter_p99_ms"])
        compares["p99_jitter_ms_100hz_under_load"] = [f"{deadline} jitter_p99_ms"]
        for what in ("jitter", "lateness"):
            key = f"p99_{what}_deadline_vs_sleep_after_work_100hz_under_load"
            compares[key] = [f"{deadline} {what}_p99_ms", f"{saw} {what}_p99_ms"]
            ratios[key] = ratio_of_medians(samples, *compares[key])
    else:
        print(f"no {load} measurement (--conditions): its ratios are left out", flush=True)
    compares["cpu_no_spin_vs_spin_2ms_100hz"] = ["alone/100hz/cpu_per_s_spin_0ms", "alone/100hz/cpu_per_s_spin_2ms"]
    ratios["cpu_no_spin_vs_spin_2ms_100hz"] = ratio_of_medians(samples, *compares["cpu_no_spin_vs_spin_2ms_100hz"])
    targets = {"p99_jitter_ms_100hz_under_load": "<=1", "p99_jitter_deadline_vs_sleep_after_work_100hz_under_load": "<=1",
               "cpu_no_spin_vs_spin_2ms_100hz": "<0.7"}
    report("robot_loop", metrics, ratios, {k: v for k, v in targets.items() if k in ratios}, args.out, sides=samples,
           compares=compares, repeats=repeats)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


if __name__ == "__main__":
    main()
