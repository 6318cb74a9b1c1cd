"""The CPU stand-in for a GPU (tests/device_guard.py): a tensor that GPU-path code creates without a device is a
meta tensor under the guard, so the mixes that fail on CUDA fail here. Every in-process test with torch loaded runs
under it (tests/conftest.py); these check the guard itself, on the two mixes issue 40 found on an H200."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.learner.algorithms.grpo import group_advantages
from rlfabric.services.learner.algorithms.sft import model_token_mask
from tests.device_guard import ROOT, guard

# the two functions as they were before the fix (sft.py:35 and grpo.py:112 of issue 40), compiled as if they lived
# in the learner's package, where the guard looks
BEFORE = '''
def model_token_mask(lengths, loss_mask):
    longest = int(lengths.max())
    attn = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    return attn, loss_mask[:, 1:longest].float() * attn[:, 1:]


def group_advantages(rewards, group, scale, eps=1e-6):
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    return rewards - (sums / counts)[inverse]
'''


def _before(filename: str) -> dict:
    scope = {"torch": torch}
    exec(compile(BEFORE, filename, "exec"), scope)  # noqa: S102 — the test's own source, for its file name
    return scope


LENGTHS, LOSS_MASK = torch.tensor([3, 5]), torch.ones(2, 5, dtype=torch.long)
REWARDS, GROUP = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])


def test_the_mixes_issue_40_found_on_a_gpu_fail_on_the_cpu_under_the_guard():
    old = _before(str(ROOT / "services/learner/algorithms/_before_issue_40.py"))
    with guard() as mode:
        with pytest.raises(RuntimeError, match="device"):
            old["model_token_mask"](LENGTHS, LOSS_MASK)
        with pytest.raises(RuntimeError, match="device"):
            old["group_advantages"](REWARDS, GROUP, scale=False)
    assert len(mode.moved) == 2 and all("_before_issue_40.py" in where for where in mode.moved)


def test_the_fixed_functions_give_real_values_under_the_guard():
    with guard() as mode:
        attn, mask = model_token_mask(LENGTHS, LOSS_MASK)
        adv = group_advantages(REWARDS, GROUP, scale=False)
    assert attn.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]] and mask.sum().item() == 6
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0] and mode.moved == []


def test_code_outside_the_gpu_path_keeps_the_default_device():
    old = _before(__file__)  # a test's own tensors, torch's internals: left alone
    with guard() as mode:
        assert old["group_advantages"](REWARDS, GROUP, scale=False).device.type == "cpu"
        assert torch.zeros(2).device.type == "cpu"
    assert mode.moved == []
