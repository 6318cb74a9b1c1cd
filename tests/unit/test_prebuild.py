"""The slow tier's artefacts built ahead (tests/prebuild.py): built where the tests look, stopped with everything
they started before a parallel phase takes the cores, and never kept from a run that recovered."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import artefacts, prebuild


def test_outside_a_session_artefacts_go_where_pytest_keeps_them(request):
    assert Path(request.config.cache.mkdir("artefacts")) == artefacts.ARTEFACTS


def test_stop_ends_the_build_and_every_process_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(prebuild, "PIDFILE", tmp_path / "prebuild.pid")
    monkeypatch.setattr(prebuild, "LOG", tmp_path / "prebuild.log")
    assert prebuild.stop() is False  # none running
    # a build that ignores SIGTERM and has started a grandchild (as `rlfabric train` starts services)
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    prebuild.PIDFILE.write_text(str(proc.pid))
    deadline = time.monotonic() + 10
    while len(prebuild._group(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(prebuild._group(proc.pid)) == 2
    with monkeypatch.context() as m:  # a second serial phase finds it running: starts no other
        m.setattr(subprocess, "Popen", None)
        prebuild.start()
    assert prebuild.stop(grace_s=0.5) is True
    proc.wait(timeout=5)
    assert prebuild._group(proc.pid) == [] and not prebuild.PIDFILE.exists()
    assert "stopped" in prebuild.LOG.read_text()


def test_a_run_that_recovered_is_not_kept_as_an_artefact(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    artefacts.undisturbed(run)  # no recovery: kept
    (run / "recoveries.csv").write_text("iteration,role,cause\n3,learner,lost\n")
    with pytest.raises(RuntimeError, match="recovered from a lost worker"):
        artefacts.undisturbed(run)


def test_the_idle_class_is_what_a_build_runs_in():
    """SCHED_IDLE can be taken by any user, and the processes a build starts inherit it."""
    code = ("import os, subprocess, sys; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
            "print(subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'], "
            "capture_output=True, text=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=os.environ)
    assert out.stdout.strip() == str(os.SCHED_IDLE), out.stderr
