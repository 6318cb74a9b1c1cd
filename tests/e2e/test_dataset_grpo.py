"""A config-only GRPO run on a user's JSONL file with a user's ``module:function`` reward that, for some rows,
sleeps forever, raises (KeyboardInterrupt too), or exits its process: ``rlfabric train`` exits 0, the env service that ran the rewards
is still SERVING (and was never restarted), metrics.csv's ``reward_failures`` counts every failed sample, the env
log names each one, and no reward worker outlives the stack."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from rlfabric.services.coordinator.client import CoordinatorClient
from rlfabric.services.core.healthcheck import check
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2

MODES = ["ok", "sleep", "raise", "exit", "interrupt"]
REWARD = """
    import os
    import time

    def judge(prompt, completion, answer, mode, **fields):
        with open(os.environ["RLF_JUDGE_CALLS"], "a") as f:
            f.write(f"{mode} {os.getpid()}\\n")
        if mode == "sleep":
            time.sleep(10_000)
        if mode == "raise":
            raise ValueError("this row confuses the judge")
        if mode == "exit":
            os._exit(3)
        if mode == "interrupt":  # once took the env service's data plane down with it
            raise KeyboardInterrupt
        return 1.0 if completion.strip() == answer else 0.0
"""


def _up(tmp_path, env: dict) -> tuple[subprocess.Popen, str, CoordinatorClient]:
    up = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "up", "--runs-root", str(tmp_path / "runs"),
                           "--allow-import-paths"],  # the spec names its reward as module:function
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env)
    address = up.stdout.readline().strip()
    client = CoordinatorClient(address, token_file=str(tmp_path / "runs" / ".rlfabric" / "token"))
    client.wait_ready(60)
    deadline = time.monotonic() + 90
    while len([w for w in client.workers() if w.alive]) < 4:
        assert time.monotonic() < deadline and up.poll() is None, "the stack did not come up"
        time.sleep(0.2)
    return up, address, client


@pytest.mark.slow
def test_hostile_rewards_cost_their_samples_and_the_env_service_keeps_serving(tmp_path, monkeypatch):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "rlf_e2e_judge.py").write_text(textwrap.dedent(REWARD))
    calls = tmp_path / "calls"
    train = tmp_path / "train.jsonl"  # a row of each mode; every prompt is answered by a group of 4 samples
    train.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "answer": str(2 * i), "mode": m}) + "\n"
                             for i, m in enumerate(MODES)))
    held = tmp_path / "held_out.jsonl"  # evaluation scores only well-behaved rows
    held.write_text("".join(json.dumps({"prompt": f"What is {i} plus 1?", "answer": str(i + 1), "mode": "ok"}) + "\n"
                            for i in range(4)))
    spec = {"name": "dataset-grpo", "seed": 0,
            "env": {"adapter": "text", "id": "dataset", "num_envs": 8, "eval_envs": 4,
                    "options": {"path": str(train), "eval_path": str(held), "reward": "rlf_e2e_judge:judge",
                                "group_size": 4, "reward_timeout_s": 1.0, "failure_reward": 0.0},
                    "eval_options": {"split": "held_out", "group_size": 1}},
            "policy": {"lm": {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "layers": 1, "heads": 2,
                              "max_positions": 128}},
            "rollout": {"backend": "hf", "max_new_tokens": 4},
            "algorithm": {"name": "grpo", "minibatch_size": 8, "epochs": 1},
            "scheduling": {"mode": "disaggregated"},
            "train": {"total_env_steps": 64, "eval_every_iterations": 0, "eval_episodes": 4}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, RLF_JUDGE_CALLS=str(calls),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "code"), os.environ.get("PYTHONPATH", "")]))
    up, address, client = _up(tmp_path, env)
    try:
        [worker] = [w for w in client.workers() if w.role == common_pb2.ENV]
        monkeypatch.setenv("RLFABRIC_TOKEN_FILE", str(tmp_path / "runs" / ".rlfabric" / "token"))
        proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(config), "--coordinator", address,
                               "--quiet", "--run-dir", str(tmp_path / "runs" / "r1")], capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL,
                              env={**env, "RLFABRIC_TOKEN_FILE": str(tmp_path / "runs" / ".rlfabric" / "token")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert client.status("r1").state == coordinator_pb2.SUCCEEDED
        serving, why = check(worker.endpoint.grpc)
        assert serving, why
        [after] = [w for w in client.workers() if w.role == common_pb2.ENV]
        assert after.pid == worker.pid and after.alive  # the same process: never restarted
    finally:
        client.close()
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    seen = [line.split() for line in calls.read_text().splitlines()]
    modes = [m for m, _ in seen]
    assert set(modes) == set(MODES), f"every kind of row should have been drawn: {sorted(set(modes))}"
    failed = sum(m != "ok" for m in modes)
    with open(tmp_path / "runs" / "r1" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert "reward_failures" in rows[0], f"metrics.csv has no reward_failures column: {sorted(rows[0])}"
    assert sum(float(r["reward_failures"] or 0) for r in rows) == failed
    assert int(rows[-1]["env_steps"]) == 64
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "runs" / "logs").glob("env*"))
    for kind in ("timeout", "raised", "died"):
        assert f"({kind}) for env " in logs, f"no {kind} line in the env log"
    assert logs.count("rlf_e2e_judge:judge failed") == failed
    deadline = time.monotonic() + 10  # reward workers die with their env service (they watch their parent)
    pids = {int(p) for _, p in seen}
    while any(subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode == 0 for p in pids):
        assert time.monotonic() < deadline, "reward workers outlived the env service"
        time.sleep(0.2)
