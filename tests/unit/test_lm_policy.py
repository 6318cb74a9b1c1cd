"""Language-model policies: the hf backend's samples and log-probs against the learner's, greedy generation,
weight versions loaded in place, and LoRA adapters whose merged weights act exactly like the adapted model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.lm_support import SPEC, lm_run, perturb


def _run(lora: int = 0):
    return lm_run("hf", lora)


def _perturb(module: torch.nn.Module, seed: int) -> None:
    perturb(module, seed)


@pytest.fixture(scope="module")
def backend():
    from rlfabric.services.rollout.backends.hf import HFBackend

    return HFBackend(_run(), SPEC, "cpu")


def test_engine_log_probs_are_the_learners_under_the_same_weights(backend):
    from rlfabric.services.core.models import build_policy

    run = _run()
    learner = build_policy("causal_lm", SPEC, run.policy)
    _perturb(learner, 0)
    backend.load(5, learner.state_dict())
    assert backend.version == 5
    prompts = [[1, *backend.encode(p)] for p in ("Q: 1+2= A:", "Q: 33-4= A:", "Q: 7+70= A:")]
    gens = backend.generate(prompts, 8, sample=True)
    for prompt, g in zip(prompts, gens, strict=True):
        seq = torch.tensor([prompt + g.tokens.tolist()])
        lp = learner.token_logprobs(seq, torch.ones_like(seq))[0, len(prompt) - 1:]
        assert np.abs(lp.detach().numpy() - g.logp).max() < 1e-4
        assert g.finished == (g.tokens[-1] == 2)


def test_greedy_generation_follows_the_argmax_and_a_new_version_changes_it(backend):
    from rlfabric.services.core.models import build_policy

    learner = build_policy("causal_lm", SPEC, _run().policy)
    prompt = [1, *backend.encode("Q: 12+30= A:")]

    def greedy(model) -> list[int]:
        seq = list(prompt)
        for _ in range(8):
            with torch.no_grad():
                nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt == 2:
                break
        return seq[len(prompt):]

    outputs = []
    for seed in (1, 2):
        _perturb(learner, seed)
        backend.load(seed, learner.state_dict())
        out = backend.generate([prompt], 8, sample=False)[0].tokens.tolist()
        assert out == greedy(learner.model)
        outputs.append(out)
    assert outputs[0] != outputs[1]


def test_lora_trains_only_adapters_and_merged_weights_act_the_same():
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.core.models.lm import merged_state_dict

    adapted = build_policy("causal_lm", SPEC, _run(lora=4).policy)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # adapters start as a no-op (B = 0): give them something to say
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    plain = build_policy("causal_lm", SPEC, _run().policy)
    base_before = {k: v.clone() for k, v in plain.model.state_dict().items()}
    plain.model.load_state_dict(merged_state_dict(adapted.model))
    seq = torch.tensor([[1, 55, 80, 97, 4, 75, 5, 83, 97, 39, 80, 97, 6]])
    a = adapted.token_logprobs(seq, torch.ones_like(seq))
    m = plain.token_logprobs(seq, torch.ones_like(seq))
    assert torch.allclose(a, m, atol=1e-5)
    assert any(not torch.equal(base_before[k], v) for k, v in plain.model.state_dict().items())
    assert any("lora_" in n for n, _ in adapted.model.named_parameters())  # merging left the adapted model as is


def test_init_checkpoint_that_does_not_exist_names_the_field(tmp_path):
    from rlfabric.services.learner.server import _read_checkpoint

    with pytest.raises(ValueError, match="policy.init_checkpoint"):
        _read_checkpoint(str(tmp_path / "nope.pt"), "policy.init_checkpoint")
