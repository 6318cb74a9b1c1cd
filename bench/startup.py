"""Service start-up: seconds from process start to SERVING on the gRPC health service, and resident memory then, of
every service started alone as ``rlfabric serve`` starts it on its own host (``python -m rlfabric.services.X.server``).

    python bench/startup.py [--before DIR] [--repeats 3] [--services coordinator,replay,...] [--out FILE]

``--before DIR``: a checkout of an earlier commit (``git worktree add --detach DIR COMMIT``), measured in the same
run with the same interpreter, alternating with this checkout service by service. Ratios (this / before, lower is
better): ``startup_vs_before[<service>]`` and ``rss_vs_before[<service>]``. Each start also reports whether the
process mapped libtorch (``torch``): the coordinator, replay, env and the robot gateway should not, since none of
them trains. Medians over ``--repeats`` starts; the first start of each tree is a warm-up (page cache), not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import python, report  # noqa: E402

from rlfabric.services.core.healthcheck import check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("coordinator", "replay", "env", "robot_gateway", "rollout", "learner")
NO_TRAINING = ("coordinator", "replay", "env", "robot_gateway")  # targets: no slower, no larger; the rest inform


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def start_once(tree: Path, service: str, scratch: Path, timeout_s: float = 120.0) -> dict:
    """Start ``service`` from the checkout ``tree``, wait until it answers SERVING, measure it, stop it."""
    port_file = scratch / f"{service}.address"
    port_file.unlink(missing_ok=True)
    args = ["--host", "127.0.0.1", "--port-file", str(port_file), "--log-file", str(scratch / f"{service}.log")]
    if service == "coordinator":
        args += ["--runs-root", str(scratch / "runs")]
    if service == "robot_gateway":
        args += ["--storage-root", str(scratch / "recordings")]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    env.pop("RLFABRIC_COORDINATOR", None)
    t0 = time.perf_counter()
    with open(scratch / f"{service}.stderr", "w") as stderr:
        proc = subprocess.Popen([python(), "-m", f"rlfabric.services.{service}.server", *args], cwd=tree, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = t0 + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{service} from {tree} exited with {proc.returncode}; see "
                                   f"{scratch / (service + '.stderr')}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{service} from {tree} was not SERVING within {timeout_s:.0f}s")
            if port_file.exists() and port_file.read_text().strip():
                ok, _ = check(port_file.read_text().strip(), timeout_s=1.0)
                if ok:
                    break
            time.sleep(0.005)
        startup = time.perf_counter() - t0
        return {"startup_s": startup, "rss_mb": _rss_mb(proc.pid), "torch": _maps_torch(proc.pid)}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="", help="a checkout of the commit to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--services", default=",".join(SERVICES))
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    services = [s for s in args.services.split(",") if s]
    unknown = sorted(set(services) - set(SERVICES))
    if unknown:
        parser.error(f"--services: unknown {unknown}; available: {', '.join(SERVICES)}")
    trees = {"after": ROOT, **({"before": Path(args.before).resolve()} if args.before else {})}
    samples: dict[str, dict[str, list[dict]]] = {label: {s: [] for s in services} for label in trees}
    with tempfile.TemporaryDirectory(prefix="rlfabric-startup-") as tmp:
        for tree in trees.values():  # warm-up: the page cache holds both trees' imports afterwards
            for service in services:
                start_once(tree, service, Path(tmp))
        for _ in range(args.repeats):
            for service in services:
                for label, tree in trees.items():
                    samples[label][service].append(start_once(tree, service, Path(tmp)))
    metrics: dict[str, float | bool] = {}
    ratios: dict[str, float] = {}
    targets: dict[str, str] = {}
    print(f"{'service':<14}" + "".join(f"{label + ' start s':>16}{label + ' RSS MB':>16}{label + ' torch':>14}"
                                      for label in trees))
    for service in services:
        row = f"{service:<14}"
        for label in trees:
            runs = samples[label][service]
            startup = statistics.median(r["startup_s"] for r in runs)
            rss = statistics.median(r["rss_mb"] for r in runs)
            torch = any(r["torch"] for r in runs)
            metrics |= {f"startup_s[{service}][{label}]": startup, f"rss_mb[{service}][{label}]": rss,
                        f"torch[{service}][{label}]": torch}
            row += f"{startup:>16.2f}{rss:>16.0f}{str(torch):>14}"
        print(row)
        if "before" in trees:
            ratios[f"startup_vs_before[{service}]"] = (metrics[f"startup_s[{service}][after]"]
                                                       / metrics[f"startup_s[{service}][before]"])
            ratios[f"rss_vs_before[{service}]"] = (metrics[f"rss_mb[{service}][after]"]
                                                   / metrics[f"rss_mb[{service}][before]"])
            if service in NO_TRAINING:
                targets[f"startup_vs_before[{service}]"] = "<=1.0"
                targets[f"rss_vs_before[{service}]"] = "<=1.0"
    doc = report("startup", metrics, ratios, targets, None)
    doc["trees"] = {label: {"path": str(tree), "commit": _commit(tree)} for label, tree in trees.items()}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    return doc


def _commit(tree: Path) -> str:
    """The checkout's commit, with ``+changes`` when its work tree differs from it."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return head + ("+changes" if dirty else "")


if __name__ == "__main__":
    main()
