"""The parallel phases' shared artefacts (tests/artefacts.py), built ahead of them on a core nobody else wants.

The serial phases run one timed test at a time, mostly on one of CI's two cores; the parallel phases then built
their artefacts (the arithmetic SFT checkpoint; the VLA recipes' vision and demonstration stages, the CrossQ expert,
the offline data set and its behaviour cloning, PPO's CartPole run: ~4 minutes of one core) on both cores' busiest
stretch. Each tier now runs its serial phase first, and when ``RLFABRIC_PREBUILD=1`` (.ci/run sets it),
tests/conftest.py starts this module as a serial phase starts. It builds them in the idle scheduling class
(SCHED_IDLE: it runs only on a core that would otherwise idle, and any test's process takes the core from it at
once, so the timed tests keep theirs). A parallel phase stops it as it starts: what it finished, the tests find
built; what it was building, the test that needs it builds again (a killed build leaves nothing:
tests/artefacts.py), or the next serial phase's build does. A run that recovered from a lost worker on the starved
core is not kept (``undisturbed``).

    python -m tests.prebuild          # build them (the log: .pytest_cache/d/artefacts/prebuild.log)
    python -m tests.prebuild --stop   # stop a running one and everything it started
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.artefacts import ARTEFACTS, ROOT

PIDFILE = ARTEFACTS / "prebuild.pid"
LOG = ARTEFACTS / "prebuild.log"


def _plan() -> list[tuple[str, Callable[[], object]]]:
    """What the parallel phases build: the fast tier's (the arithmetic SFT checkpoint, also the slow tier's) first,
    then the slow tier's, the files it starts first first (the VLA recipes)."""
    def vla(name: str):
        def build():
            from tests.e2e.test_cautious_demonstrator import warm_stage
            return warm_stage(None, "pi0", name)
        return build

    def crossq():
        from tests.e2e.test_crossq import crossq_expert
        return crossq_expert(None)

    def offline():
        from tests.e2e.test_offline_iql import bc_return_on, mixed_data_set
        return bc_return_on(None, mixed_data_set(None))

    def cartpole():
        from tests.e2e.test_async_ppo import cartpole_ppo
        return cartpole_ppo(None)

    def arith():
        from tests.e2e.test_arith_grpo import arith_sft
        return arith_sft(None)

    return [("arith-sft", arith), ("vla-vision", vla("vision")), ("vla-demos", vla("demos")),
            ("pendulum-crossq", crossq), ("pendulum-mixed and its behaviour cloning", offline),
            ("cartpole-ppo-steps", cartpole)]


def build_all() -> int:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # inherited by every process it starts
    if os.getpgrp() != os.getpid():  # started by hand: a process group of its own, for ``stop``
        os.setpgid(0, 0)
    PIDFILE.write_text(str(os.getpid()))
    try:
        for name, build in _plan():
            started = time.monotonic()
            try:
                build()
            except Exception as exc:  # noqa: BLE001 — said, and the test that needs it builds it
                print(f"{name}: not built ({type(exc).__name__}: {str(exc)[-500:]})", flush=True)
                continue
            print(f"{name}: ready after {time.monotonic() - started:.0f} s", flush=True)
    finally:
        if PIDFILE.is_file() and PIDFILE.read_text() == str(os.getpid()):
            PIDFILE.unlink()
    return 0


def _pgid() -> int | None:
    """The process group of the build PIDFILE names (its first process's pid), if any."""
    try:
        return int(PIDFILE.read_text())
    except (OSError, ValueError):
        return None


def running() -> bool:
    pgid = _pgid()
    return pgid is not None and bool(_group(pgid))


def start() -> None:
    """Start building in the background, in a process group of its own (so ``stop`` reaches all it starts),
    unless a build runs already."""
    if running():
        return
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    with open(LOG, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.prebuild"], cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    PIDFILE.write_text(str(proc.pid))  # now, not when it has started: a stop right after finds it


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(entry.name))
    return alive


def stop(grace_s: float = 10.0) -> bool:
    """Stop a running build and everything it started; returns once none of them is left (True if one ran)."""
    pgid = _pgid()
    if pgid is None:
        return False
    if not _group(pgid):
        PIDFILE.unlink(missing_ok=True)
        return False
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while _group(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _group(pgid):
            break
    PIDFILE.unlink(missing_ok=True)
    with open(LOG, "a") as log:
        log.write("stopped\n")
    return True


if __name__ == "__main__":
    if sys.argv[1:] == ["--stop"]:
        stop()
        raise SystemExit(0)
    raise SystemExit(build_all())
