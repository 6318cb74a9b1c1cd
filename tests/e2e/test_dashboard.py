"""The coordinator's web dashboard in headless Chromium: `rlfabric up` prints a one-time login URL; a browser that
opens it sees the runs, a CartPole PPO run's return curve rising as it trains, and the recovery after a SIGKILLed
rollout worker in the recoveries timeline. Strangers and a spent login token get 401.

Chromium is Debian's (`apt-get install chromium`, as .ci/run does), driven by Playwright (`pip install playwright`):
never `playwright install`, whose download comes from a CDN. RLFABRIC_DASHBOARD_SCREENSHOT=FILE saves the page as it
shows the recovery (docs/dashboard.png is one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from rlfabric.services.coordinator.client import CoordinatorClient
from rlfabric.services.core.runtime import ROLE_NAMES

pytestmark = [pytest.mark.slow, pytest.mark.minutes(1.5)]  # its waits are long: it may share the machine

CHROMIUM = next((p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "") if p and
                 os.access(p, os.X_OK)), "")  # the binary itself: Debian's /usr/bin/chromium is a shell wrapper
RUN = ["scheduling.mode=disaggregated",  # env and rollout in processes of their own: one can be killed
       "train.total_env_steps=60000", "train.eval_every_iterations=0", "checkpoint.every_iterations=5",
       "data_plane.timeout_s=10", "runtime.worker_wait_s=60"]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _wait(what: str, check, timeout_s: float, up: subprocess.Popen, state=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert up.poll() is None, f"rlfabric up exited while waiting for {what}: {up.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s; {state()}"
        time.sleep(0.5)
    return result


def test_the_dashboard_shows_a_run_learning_and_recovering_in_chromium(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install "
                                                                 "playwright (the dev extra has it)")
    if not CHROMIUM:
        pytest.skip("Debian's chromium is not installed: apt-get install chromium (.ci/run installs it)")
    runs = tmp_path / "runs"
    up = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "up", "--runs-root", str(runs)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        address = up.stdout.readline().strip()
        line = up.stdout.readline().strip()
        assert line.startswith("dashboard: http://"), (address, line, up.stderr.read()[-2000:] if up.poll() else "")
        login = line.removeprefix("dashboard: ")
        base = login.split("/login?", 1)[0]
        assert _status(base + "/") == _status(base + "/api/overview") == 401  # no login token, no cookie
        token_file = runs / ".rlfabric" / "token"
        client = CoordinatorClient(address, token_file=str(token_file))
        for holder, secret in (("operator", str(token_file)), ("stranger", str(tmp_path / "stranger"))):
            (tmp_path / "stranger").write_text("not-the-secret-of-this-stack")
            fresh = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "dashboard", "--coordinator",
                                    address], capture_output=True, text=True, timeout=60,
                                   env={**os.environ, "RLFABRIC_TOKEN_FILE": secret})
            if holder == "operator":  # a fresh login URL for whoever holds the deployment's secret
                assert fresh.returncode == 0 and fresh.stdout.startswith(base + "/login?token="), fresh.stderr
                assert _status(fresh.stdout.strip()) == 200 and _status(fresh.stdout.strip()) == 401
            else:
                assert fresh.returncode == 2 and "UNAUTHENTICATED" in fresh.stderr, fresh.stderr
        client.wait_ready(30)
        _wait("4 registered workers", lambda: len([w for w in client.workers() if w.alive]) >= 4, 60, up)
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(login)
            page.wait_for_url(base + "/", timeout=15000)  # the login page moves on, the token out of the address
            assert _status(login) == 401  # spent: the login token works once
            page.wait_for_selector("#workers tbody tr >> text=rlfabric-rollout", timeout=15000)
            run_id = client.submit("examples/cartpole_ppo.yaml", RUN).run_id
            page.wait_for_selector(f'#runs tbody tr[data-run-id="{run_id}"]', timeout=15000)

            def train_curve() -> list:
                return json.loads(page.get_attribute("#returns", "data-train") or "[]")

            def state() -> str:  # what a timeout reports
                return (f"run: {client.status(run_id)}; page error: {page.text_content('#error')!r}; "
                        f"curve: {train_curve()}; recoveries: {page.text_content('#recoveries')!r}")

            first = _wait("a first stretch of the return curve", lambda: len(train_curve()) >= 3 and train_curve(),
                          120, up, state)

            def risen():
                curve = train_curve()
                head, tail = [y for _, y in curve[:3]], [y for _, y in curve[-3:]]
                return len(curve) >= 12 and sum(tail) / 3 > sum(head) / 3 + 20 and curve

            curve = _wait("a rising return curve", risen, 180, up, state)
            assert len(curve) > len(first) and curve[:len(first)] == first  # the page's series grew in place
            assert all(b[0] > a[0] for a, b in zip(curve, curve[1:], strict=False))  # along env steps
            row = page.locator(f'#runs tbody tr[data-run-id="{run_id}"]')
            assert "RUNNING" in row.inner_text()
            placement = page.locator("#placement tbody").inner_text()
            assert "rollout" in placement and "learner" in placement and re.search(r"\bv\d+\b", placement)
            assert f"rlfabric-rollout run={run_id}" in page.locator("#workers tbody").inner_text()

            [rollout] = [w for w in client.workers() if ROLE_NAMES[w.role] == "rollout" and w.run_id == run_id]
            os.kill(rollout.pid, signal.SIGKILL)
            _wait("a recovery in the timeline", lambda: page.get_attribute("#recoveries", "data-count") == "1", 60,
                  up, state)
            entry = page.locator("#recoveries li").first.inner_text()
            assert f"lost rollout {rollout.worker_id}" in entry, entry
            _wait("training again after the recovery", lambda: len(train_curve()) > len(curve) + 2, 60, up, state)
            if os.environ.get("RLFABRIC_DASHBOARD_SCREENSHOT"):
                page.screenshot(path=os.environ["RLFABRIC_DASHBOARD_SCREENSHOT"], full_page=True)
            browser.close()
        client.close()
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    finally:
        if up.poll() is None:
            up.kill()
