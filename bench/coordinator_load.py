"""Load on the coordinator's API while a CartPole run trains: 50 concurrent WatchRun streams, 100 status calls/s
(GetRun), and other runs submitted and stopped over and over. The figure is the training run's env steps/s under
that load against the same run without it, measured in this run on this machine, plus the latency of the status
calls under load.

The two sides, "quiet" and "loaded", run in ``--repeats`` rounds (default 3; ``--quick``: one) on one stack of
services started once, alternating (quiet loaded quiet loaded ...). The ratio is the ratio of their medians; each
side's median, min and max are printed and written ("sides"), and a side whose spread (max - min) exceeds 20% of
its median is flagged NOISY with the ratio.

The load clients run in this process on the same 2 cores, as a notebook beside a training run would.

    python bench/coordinator_load.py --out bench/results/coordinator_load.json [--repeats 3 | --quick] [--steps 40000]
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import add_repeat_args, interleave, ratio_of_medians, repeat_count, report  # noqa: E402

from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "examples" / "cartpole_ppo.yaml").read_text()


class Load:
    """The API load: watchers, a paced status caller and a submit/stop loop, until ``stop()``."""

    def __init__(self, client, watchers: int, status_hz: float):
        self.client, self.watchers, self.status_hz = client, watchers, status_hz
        self.done = threading.Event()
        self.latencies: list[float] = []
        self.stop_latencies: list[float] = []
        self.events = 0
        self.cycles = 0
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, run_id: str) -> None:
        for _ in range(self.watchers):
            self.threads.append(threading.Thread(target=self._watch, args=(run_id,), daemon=True))
        self.threads.append(threading.Thread(target=self._status, args=(run_id,), daemon=True))
        self.threads.append(threading.Thread(target=self._submit_stop, daemon=True))
        for t in self.threads:
            t.start()

    def _watch(self, run_id: str) -> None:
        n = 0
        try:
            for _ in self.client.watch(run_id):
                n += 1
        except Exception as exc:  # noqa: BLE001 — counted and reported, the bench goes on
            self.errors.append(f"watch: {exc}")
        with self._lock:
            self.events += n

    def _status(self, run_id: str) -> None:
        period = 1.0 / self.status_hz
        next_at = time.perf_counter()
        while not self.done.is_set():
            t0 = time.perf_counter()
            try:
                self.client.status(run_id)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"status: {exc}")
            self.latencies.append(time.perf_counter() - t0)
            next_at += period
            time.sleep(max(0.0, next_at - time.perf_counter()))

    def _submit_stop(self) -> None:
        while not self.done.wait(0.2):
            try:
                other = self.client.submit(SPEC, ["name=other", "train.total_env_steps=2048"])
                time.sleep(0.3)
                t0 = time.perf_counter()
                self.client.stop(other.run_id)
                self.stop_latencies.append(time.perf_counter() - t0)
                self.cycles += 1
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"submit/stop: {exc}")

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(30)


def fps(run_dir: str) -> float:
    """Env steps per second of wall-clock over the run's iterations (start-up excluded)."""
    rows = list(csv.DictReader(open(Path(run_dir) / "metrics.csv")))
    first, last = rows[0], rows[-1]
    return (float(last["env_steps"]) - float(first["env_steps"])) / (float(last["wall_time_s"]) -
                                                                     float(first["wall_time_s"]))


def idle(client, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len([w for w in client.workers() if w.alive and not w.run_id]) < n:
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not come back idle")
        time.sleep(0.1)


def measure(client, steps: int, load: Load | None) -> float:
    status = client.submit(SPEC, ["train.stop_at_eval_return=null", f"train.total_env_steps={steps}"])
    if load is not None:
        load.start(status.run_id)
    final = client.wait(status.run_id)
    if load is not None:
        load.stop()
    if final.state != coordinator_pb2.SUCCEEDED:
        raise RuntimeError(f"the training run did not succeed: {final.reason}")
    return fps(final.run_dir)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    add_repeat_args(ap)
    ap.add_argument("--steps", type=int, default=40_000)
    ap.add_argument("--watchers", type=int, default=50)
    ap.add_argument("--status-hz", type=float, default=100.0)
    args = ap.parse_args()
    repeats = repeat_count(args)

    from rlfabric.services.coordinator.client import CoordinatorClient
    from rlfabric.services.core import auth
    from rlfabric.services.launcher import LocalStack

    work = Path(tempfile.mkdtemp(prefix="coordinator-load-"))
    stack = LocalStack(log_dir=work / "logs", runs_root=work)
    stack.start()
    auth.configure(stack.token)
    client = CoordinatorClient(stack.address)
    client.wait_ready(60)
    loads: list[Load] = []

    def quiet() -> float:
        idle(client, 4)
        return measure(client, args.steps, None)

    def loaded() -> float:
        idle(client, 4)
        load = Load(client, args.watchers, args.status_hz)
        value = measure(client, args.steps, load)
        loads.append(load)
        print(f"  under load: {len(load.latencies)} status calls, {load.events} watch events, {load.cycles} "
              f"submit/stop cycles, {len(load.errors)} errors", flush=True)
        for run in client.stub.ListRuns(common_pb2.Empty()).runs:
            if run.state in (coordinator_pb2.PENDING, coordinator_pb2.RUNNING):  # an other run outlived the load
                client.stop(run.run_id)
        return value

    try:
        print("env steps/s of the training run, quiet and under load", flush=True)
        samples = interleave({"quiet": quiet, "loaded": loaded}, repeats)
        idle(client, 4)
    finally:
        client.close()
        stack.stop()
    lat = [x for load in loads for x in load.latencies]
    stops = [x for load in loads for x in load.stop_latencies]
    metrics = {
        "steps_per_run": args.steps, "repeats": repeats, "watchers": args.watchers, "status_hz": args.status_hz,
        "fps_quiet": samples["quiet"], "fps_loaded": samples["loaded"],
        "status_calls": len(lat), "status_p50_ms": 1e3 * percentile(lat, 0.5),
        "status_p99_ms": 1e3 * percentile(lat, 0.99), "status_max_ms": 1e3 * max(lat),
        "watch_events": sum(load.events for load in loads), "submit_stop_cycles": sum(load.cycles for load in loads),
        "stop_p99_ms": 1e3 * percentile(stops, 0.99), "errors": [e for load in loads for e in load.errors][:20],
    }
    print(f"status calls under load: p50 {metrics['status_p50_ms']:.1f} ms, p99 {metrics['status_p99_ms']:.1f} ms, "
          f"max {metrics['status_max_ms']:.1f} ms")
    key = "loaded_vs_quiet_env_steps_per_s"
    report("coordinator_load", metrics, {key: ratio_of_medians(samples, "loaded", "quiet")}, {key: ">=0.9"}, args.out,
           sides=samples, compares={key: ["loaded", "quiet"]}, repeats=repeats)


if __name__ == "__main__":
    main()
