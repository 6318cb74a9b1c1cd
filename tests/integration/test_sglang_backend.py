"""The sglang backend needs a CUDA GPU and SGLang (no CPU build exists): on the project's CPU machines it must
refuse clearly; where both exist, it generates and reloads weight versions like the vllm backend."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import parse_config

TEXT = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
SPEC = {"observation_space": TEXT, "action_space": TEXT}
RUN = """
name: t
seed: 3
env: {adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {group_size: 2}}
policy: {lm: {hidden_size: 128, intermediate_size: 256, layers: 2, heads: 2, max_positions: 64}}
rollout: {backend: sglang, max_new_tokens: 8}
algorithm: {name: grpo}
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: the refusal applies to CPU hosts")
def test_without_a_gpu_the_backend_refuses_with_the_fix():
    from rlfabric.services.rollout.backends import build_backend

    with pytest.raises(ValueError, match="CUDA GPUs only.*vllm"):
        build_backend("sglang", parse_config(RUN), SPEC, "cpu")


def test_on_a_gpu_a_weight_version_changes_greedy_outputs_like_hf():
    if not torch.cuda.is_available():
        pytest.skip("SGLang runs on CUDA GPUs only: no CUDA device on this host")
    pytest.importorskip("sglang", reason="SGLang is not installed on this GPU host")
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.rollout.backends import build_backend
    from rlfabric.services.rollout.backends.hf import HFBackend

    run = parse_config(RUN)
    engine = build_backend("sglang", run, SPEC, "cuda")
    hf = HFBackend(run, SPEC, "cpu")
    policy = build_policy("causal_lm", SPEC, run.policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.load(1, policy.state_dict())
    hf.load(1, policy.state_dict())
    prompts = [[1, *hf.encode("Q: 12+30= A:")]]
    try:
        assert engine.version == 1
        assert [g.tokens.tolist() for g in engine.generate(prompts, 8, False)] == \
            [g.tokens.tolist() for g in hf.generate(prompts, 8, False)]
    finally:
        engine.close()
