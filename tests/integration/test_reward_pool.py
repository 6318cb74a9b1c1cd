"""The reward pool isolates a user's reward: one that sleeps forever, raises, exits its process or allocates past
the memory limit costs only its own sample (the failure reward, a count by kind, a log line naming the sample),
the others score right, and the pool goes on working, through the pool itself and through the text env."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from rlfabric.services.core.batch import Ragged
from rlfabric.services.env.reward_pool import RewardCall, RewardPool

REWARD = "rlf_hostile_reward:judge"
HOSTILE = """
    import os
    import socket
    import subprocess
    import time

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no message for you")

    def judge(prompt, completion, answer, **fields):
        if completion == "interrupt":
            raise KeyboardInterrupt
        if completion == "unprintable":
            raise Unprintable()
        if completion in ("spawn", "spawn_hang"):  # a child left behind: returning, or hung past the timeout
            child = subprocess.Popen(["sleep", "1000"])
            with open(os.environ["RLF_CHILDREN"], "a") as f:
                f.write(f"{child.pid}\\n")
            if completion == "spawn_hang":
                time.sleep(10_000)
            return 0.5
        if completion == "daemon":  # a grandchild whose parent exits at once: no longer the worker's child
            out = subprocess.run(["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
            with open(os.environ["RLF_CHILDREN"], "a") as f:
                f.write(out.stdout)
            return 0.5
        if completion == "socket":
            socket.create_connection(("127.0.0.1", int(os.environ["RLF_PORT"])), timeout=2).close()
            return 1.0
        if completion == "sleep":
            time.sleep(10_000)
        if completion == "raise":
            raise RuntimeError("the judge is confused")
        if completion == "exit":
            os._exit(1)
        if completion == "hog":
            hoard = bytearray(3 << 30)  # over the workers' 1 GiB address-space limit
            return float(len(hoard))
        return 1.0 if completion.strip() == answer else 0.0
"""


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """The user's reward module, importable by the workers (they start with this process's sys.path)."""
    (tmp_path / "rlf_hostile_reward.py").write_text(textwrap.dedent(HOSTILE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("rlf_hostile_reward", None)


def _failures(kind: str) -> float:
    return REGISTRY.get_sample_value("rlfabric_env_reward_failures_total", {"kind": kind}) or 0.0


def _calls(completions: list[str]) -> list[RewardCall]:
    return [RewardCall(f"env {i}, row {10 + i}", REWARD, "What is 6 times 7?", c, "42", json.dumps({"i": i}))
            for i, c in enumerate(completions)]


def test_each_hostile_reward_costs_only_its_sample_and_the_pool_keeps_working(hostile, caplog):
    pool = RewardPool(workers=2, memory_mb=1024)
    before = {k: _failures(k) for k in ("raised", "timeout", "died")}
    try:
        pool.resolve(REWARD, REWARD)  # starts the workers
        completions = ["42", "sleep", "raise", "41", "exit", "hog", "42"]
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlfabric.services.env.reward_pool"):
            scored = pool.score(_calls(completions), timeout_s=1.5, failure_reward=-1.0)
        took = time.monotonic() - t0
        assert [s.value for s in scored] == [1.0, -1.0, -1.0, 0.0, -1.0, -1.0, 1.0]
        assert [s.failure for s in scored] == [None, "timeout", "raised", None, "died", "raised", None]
        assert dict(pool.failures) == {"timeout": 1, "raised": 2, "died": 1}
        assert {k: _failures(k) - before[k] for k in before} == {"raised": 2.0, "timeout": 1.0, "died": 1.0}
        lines = [r.getMessage() for r in caplog.records]
        for sample, kind, why in (("env 1, row 11", "timeout", "reward_timeout_s=1.5"),
                                  ("env 2, row 12", "raised", "RuntimeError: the judge is confused"),
                                  ("env 4, row 14", "died", "exit code 1"),
                                  ("env 5, row 15", "raised", "MemoryError")):
            assert sum(sample in line and f"({kind})" in line and why in line for line in lines) == 1, lines
        assert len(lines) == 4
        assert took < 15, f"one step took {took:.1f} s"
        # the dead and the timed-out workers were replaced: the next step scores normally, concurrently
        again = pool.score(_calls(["42", "0"] * 4), timeout_s=1.5, failure_reward=-1.0)
        assert [s.value for s in again] == [1.0, 0.0] * 4 and not any(s.failure for s in again)
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(_calls(["42"]), 1.0, 0.0)


def test_an_unimportable_reward_is_a_spec_error_when_the_env_is_built(hostile):
    pool = RewardPool(workers=1, memory_mb=0)
    try:
        with pytest.raises(ValueError, match=r"env.options.reward 'rlf_hostile_reward:nope'.*does not resolve"):
            pool.resolve("rlf_hostile_reward:nope", "rlf_hostile_reward:nope")
    finally:
        pool.close()


def test_the_text_env_reports_failed_rewards_in_its_step_reply_and_goes_on(hostile, tmp_path):
    from rlfabric.services.env.pool import EnvPool

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} times 7?", "answer": str(7 * i)}) + "\n"
                            for i in range(50)))
    env = SimpleNamespace(id="dataset", adapter="text", num_envs=4, action_chunk=1, eval_envs=4, kwargs={},
                          options={"path": str(data), "reward": REWARD, "reward_timeout_s": 1.0,
                                   "failure_reward": -0.5, "reward_memory_mb": 1024},
                          eval_options={})
    pool = EnvPool(env, 4, chunks=2)
    try:
        prompts = [t for chunk in pool.reset(0) for t in chunk.texts()]
        right = [str(7 * int(p.split("What is ")[1].split()[0])) for p in prompts]
        out = pool.step(0, Ragged.from_texts(["exit", right[1]]))
        assert out["reward"].tolist() == [-0.5, 1.0] and out["terminated"].all()
        assert out["reward_failed"].dtype.name == "float32" and out["reward_failed"].tolist() == [1.0, 0.0]
        out = pool.step(1, Ragged.from_texts(["sleep", "raise"]))
        assert out["reward"].tolist() == [-0.5, -0.5] and out["reward_failed"].tolist() == [1.0, 1.0]
        prompts = [t for t in out["obs"].texts()]  # the next episodes' prompts (same-step reset)
        right = [str(7 * int(p.split("What is ")[1].split()[0])) for p in prompts]
        out = pool.step(1, Ragged.from_texts(right))
        assert out["reward"].tolist() == [1.0, 1.0] and "reward_failed" not in out
    finally:
        pool.close()


def test_built_in_rewards_score_in_the_workers_with_their_fields():
    """math (math-verify, which times itself with SIGALRM in the worker's main thread) and gsm8k by target."""
    from rlfabric.services.env.tasks.rewards import REWARDS

    pool = RewardPool(workers=2, memory_mb=2048)
    math, gsm8k = REWARDS.target("math"), REWARDS.target("gsm8k")
    calls = [RewardCall("env 0, row 0", math, "Half of one?", r"so $\boxed{\frac{1}{2}}$", "0.5"),
             RewardCall("env 1, row 1", math, "Half of one?", r"\boxed{\frac{1}{3}}", "0.5"),
             RewardCall("env 2, row 2", gsm8k, "q", "The total is 1,234.", "#### 1234"),
             RewardCall("env 3, row 3", gsm8k, "q", "#### 12", "#### 1234")]
    try:
        for target, name in ((math, "math"), (gsm8k, "gsm8k")):
            pool.resolve(target, name)
        scored = pool.score(calls, timeout_s=30.0, failure_reward=-1.0)
    finally:
        pool.close()
    assert [(s.value, s.failure) for s in scored] == [(1.0, None), (0.0, None), (1.0, None), (0.0, None)]


@pytest.mark.serial  # a well-behaved reward must score within a 2 s step deadline: never beside another test
def test_a_step_of_hung_rewards_ends_by_its_step_deadline(hostile, caplog):
    """Hung calls queued behind each other would hold a step for their number x the call timeout (past the
    rollout's data-plane timeout): the step's deadline cuts them, and the pool still works afterwards."""
    pool = RewardPool(workers=1, memory_mb=0)
    try:
        pool.resolve(REWARD, REWARD)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlfabric.services.env.reward_pool"):
            scored = pool.score(_calls(["sleep", "sleep", "sleep", "42"]), timeout_s=1.0, failure_reward=0.0,
                                step_timeout_s=2.0)
        took = time.monotonic() - t0
        assert [s.failure for s in scored] == ["timeout"] * 4 and took < 4.0, took
        lines = [r.getMessage() for r in caplog.records]
        assert "reward_timeout_s=1" in lines[0] and all("reward_step_timeout_s=2" in line for line in lines[2:])
        assert [s.value for s in pool.score(_calls(["42"]), 1.0, 0.0, 2.0)] == [1.0]
    finally:
        pool.close()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_no_process_a_reward_starts_outlives_its_call_and_nothing_it_raises_escapes(hostile, tmp_path, monkeypatch,
                                                                                       caplog):
    """KeyboardInterrupt, an exception whose message raises, a child left behind, a grandchild of a shell that
    exited, and a child of a call that hangs past its timeout: each call ends with everything it started."""
    children = tmp_path / "children"
    monkeypatch.setenv("RLF_CHILDREN", str(children))
    pool = RewardPool(workers=2, memory_mb=1024)
    try:
        pool.resolve(REWARD, REWARD)
        with caplog.at_level(logging.WARNING, logger="rlfabric.services.env.reward_pool"):
            scored = pool.score(_calls(["interrupt", "unprintable", "spawn", "daemon", "spawn_hang", "42"]),
                                timeout_s=2.0, failure_reward=-1.0)
        assert [(s.value, s.failure) for s in scored] == [
            (-1.0, "raised"), (-1.0, "raised"), (0.5, None), (0.5, None), (-1.0, "timeout"), (1.0, None)]
        lines = " ".join(r.getMessage() for r in caplog.records)
        assert "KeyboardInterrupt" in lines and "Unprintable (its message could not be read)" in lines
        pids = [int(p) for p in children.read_text().split()]
        assert len(pids) == 3
        deadline = time.monotonic() + 5
        while any(_running(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if _running(p)]
            time.sleep(0.05)
        assert [s.value for s in pool.score(_calls(["42", "41"]), 2.0, -1.0)] == [1.0, 0.0]  # still working
    finally:
        pool.close()


def test_a_reward_reaches_no_host_where_the_kernel_gives_it_a_network_namespace(hostile, monkeypatch):
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    monkeypatch.setenv("RLF_PORT", str(listener.getsockname()[1]))
    pool = RewardPool(workers=1, memory_mb=1024)
    try:
        pool.resolve(REWARD, REWARD)
        [scored] = pool.score(_calls(["socket"]), timeout_s=5.0, failure_reward=-1.0)
        why = next((w for w in pool.network().values() if w), "")
    finally:
        pool.close()
    if why:
        pytest.skip(f"this kernel gives the reward workers no network namespace ({why}): run as root or with "
                    f"unprivileged user namespaces (docs/deployment.md)")
    assert scored.failure == "raised" and scored.value == -1.0
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing connected
    listener.close()
