"""The learner's Adam is torch.optim.Adam(fused=True) bit for bit, state_dict included, without importing
torch._dynamo (the reason it exists)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from rlfabric.services.learner.optim import Adam


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_matches_torch_adam_bit_for_bit():
    ours, ref = _model(), _model()
    opt = Adam(ours.parameters(), lr=1e-3, eps=1e-5)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, eps=1e-5, fused=True)
    for step in range(5):
        for o in (opt, ref_opt):  # the learner's linear schedule sets lr every update
            o.param_groups[0]["lr"] = 1e-3 * (1 - step / 10)
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad(set_to_none=True)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    ours_sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert ours_sd["param_groups"] == ref_sd["param_groups"]
    assert ours_sd["state"].keys() == ref_sd["state"].keys()
    for i, s in ref_sd["state"].items():
        assert s.keys() == ours_sd["state"][i].keys()
        for k, v in s.items():
            assert torch.equal(v, ours_sd["state"][i][k]) and v.dtype == ours_sd["state"][i][k].dtype



def test_two_groups_at_their_own_rates_match_torch_adam_and_round_trip():
    """PPO's value_learning_rate: the critic's weights in a second group with its own step size."""
    ours, ref = _model(), _model()
    groups = lambda m: [{"params": list(m[0].parameters()), "scale": 1.0},  # noqa: E731
                        {"params": list(m[2].parameters()), "scale": 100.0}]
    opt = Adam(groups(ours), lr=1e-5, eps=1e-5)
    ref_opt = torch.optim.Adam(groups(ref), lr=1e-5, eps=1e-5, fused=True)
    for step in range(3):
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = 1e-5 * group["scale"] * (1 - step / 10)
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    start = _model()
    assert (ours[2].weight - start[2].weight).abs().max() > 50 * (ours[0].weight - start[0].weight).abs().max()
    assert opt.state_dict()["param_groups"] == ref_opt.state_dict()["param_groups"]
    again = Adam(groups(_model()), lr=1.0)
    again.load_state_dict(ref_opt.state_dict())
    assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    with pytest.raises(ValueError, match="value_learning_rate"):
        Adam(_model().parameters(), lr=1.0).load_state_dict(ref_opt.state_dict())

def test_state_dict_round_trips_with_torch_adam():
    """A checkpoint written with torch.optim.Adam resumes into ours and continues identically (and back)."""
    ours, ref = _model(1), _model(1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, eps=1e-5, fused=True)
    for step in range(3):
        _grads(ref, step)
        ref_opt.step()
    ours.load_state_dict(ref.state_dict())
    opt = Adam(ours.parameters(), lr=5.0, eps=1e-5)
    opt.load_state_dict(ref_opt.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3
    _grads(ours, 9)
    _grads(ref, 9)
    opt.step()
    ref_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    back = torch.optim.Adam(_model(2).parameters(), lr=1e-3, eps=1e-5, fused=True)
    back.load_state_dict(opt.state_dict())
    assert float(back.state_dict()["state"][0]["step"]) == 4.0


def test_skips_parameters_without_gradients():
    ours, ref = _model(), _model()
    opt = Adam(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    for model in (ours, ref):
        _grads(model, 0)
        model[2].bias.grad = None
    opt.step()
    ref_opt.step()
    assert sorted(opt.state_dict()["state"]) == sorted(ref_opt.state_dict()["state"]) == [0, 1, 2]
    for model in (ours, ref):
        _grads(model, 1)
    opt.step()
    ref_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [2.0, 2.0, 2.0, 1.0]


def test_state_of_another_architecture_is_a_clear_error():
    opt = Adam(_model().parameters(), lr=1e-3)
    other = torch.optim.Adam(nn.Linear(2, 2).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="another policy architecture"):
        opt.load_state_dict(other.state_dict())


def test_building_and_stepping_does_not_import_dynamo():
    code = ("import sys, torch\nfrom rlfabric.services.learner.optim import Adam\n"
            "p = torch.nn.Parameter(torch.ones(3)); o = Adam([p], lr=0.1); p.grad = torch.ones(3); o.step()\n"
            "o.load_state_dict(o.state_dict())\n"
            "assert p.detach().lt(1).all(), p\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
