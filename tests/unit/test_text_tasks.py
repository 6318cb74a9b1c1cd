"""Text tasks for LM policies: the arithmetic split and verifier, the tool protocol, and the text env adapter
through the env service's request protocol (text as UTF-8 bytes in Ragged fields)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from rlfabric.services.core.batch import Ragged, TensorBatch
from rlfabric.services.env.pool import EnvPool
from rlfabric.services.env.tasks.arith import ArithTask, held_out, parse_int
from rlfabric.services.env.tasks.tools import FACTS, ToolError, calc, run_turn, search


def _env(task="arith", num_envs=4, **options):
    return SimpleNamespace(id=task, adapter="text", num_envs=num_envs, action_chunk=1, eval_envs=num_envs, kwargs={},
                           options=options, eval_options={})


def test_train_and_held_out_never_share_a_problem():
    train = {p.question for p in ArithTask(2, "train").problems(3000, 0)}
    held = {p.question for p in ArithTask(2, "held_out").problems(1000, 1)}
    assert train and held and not train & held
    assert all(held_out(q, 0.2) for q in held) and not any(held_out(q, 0.2) for q in train)


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_answers_are_the_arithmetic_of_the_question(level):
    for p in ArithTask(level).problems(200, level):
        assert re.fullmatch(r"[0-9+\-*]+", p.question)
        assert int(p.answer) == calc(p.question)


def test_the_verifier_takes_exact_integers_only():
    task = ArithTask(2)
    p = task.problems(1, 0)[0]
    assert task.correct(p, p.answer) and task.correct(p, f"  {p.answer} ")
    assert not task.correct(p, str(int(p.answer) + 1))
    for junk in ("", "-", "1 2", "12a", "١٢", "9" * 40, "+5"):
        assert parse_int(junk) is None, junk


def test_calculator_walks_the_syntax_tree_and_refuses_everything_else():
    assert calc("8*(7+3)-2") == 78 and calc("-4+1") == -3
    for bad in ("__import__('os')", "2**10", "1/2", "a+1", "(1", "9" * 70, "10000000*10000000*10000000"):
        with pytest.raises(ToolError):
            calc(bad)


def test_search_finds_the_fact_and_refuses_unknown_queries():
    assert search("how many legs does a spider have") == FACTS["legs of a spider"]
    with pytest.raises(ToolError):
        search("zebra velocity")


def test_one_turn_parses_the_first_complete_tag():
    assert run_turn("<calc>2+3</calc><answer>9</answer>").reply == "<result>5</result>"
    assert run_turn("think <answer>12</answer>").answer == "12"
    assert run_turn("<calc>2+3").malformed and not run_turn("<calc>2+3").done


def test_groups_answer_the_same_prompt_and_problems_change_per_reset():
    pool = EnvPool(_env(num_envs=8, group_size=4), 8)
    first = pool.reset(100)[0].texts()
    assert len(set(first[:4])) == 1 and len(set(first[4:])) == 1 and first[0] != first[4]
    assert pool.reset(100)[0].texts() == first and pool.reset(7)[0].texts() != first


def test_single_turn_rewards_exact_answers():
    pool = EnvPool(_env(num_envs=2), 2)
    prompts = pool.reset(3)[0].texts()
    answers = [str(calc(re.match(r"Q: (.*)= A:", p).group(1))) for p in prompts]
    out = pool.step(0, Ragged.from_texts([answers[0], answers[1] + "0"]))
    assert out["reward"].tolist() == [1.0, 0.0] and out["terminated"].all()


def _scripted(prompt: str, reply: str) -> str:
    """A policy that uses the tools correctly: search the fact, compute, answer."""
    fact, b, c = re.match(r"Q: (.*)\*(\d+)\+(\d+)= A:", prompt).groups()
    if not reply:
        return f"<search>{fact}</search>"
    value = int(re.search(r"<result>(-?\d+)</result>", reply).group(1))
    if "calc" not in reply and value == FACTS[fact]:
        return f"<calc>{value}*{b}+{c}</calc>"
    return f"<answer>{value}</answer>"


def test_a_scripted_tool_user_gets_the_reward_and_malformed_calls_cost_a_penalty():
    pool = EnvPool(_env("arith_tool", num_envs=2, max_turns=5, parse_penalty=0.25), 2)
    prompts = pool.reset(11)[0].texts()
    replies, total, done = ["", ""], np.zeros(2), np.zeros(2, bool)
    broken = ["<calc>2+</calc>", "no tags at all"]  # env 1 opens with two malformed turns, then plays well
    for turn in range(5):
        actions = ["" if done[i] else broken[turn] if i == 1 and turn < 2 else _scripted(prompts[i], replies[i])
                   for i in range(2)]
        out = pool.step(0, Ragged.from_texts(actions))
        for i in np.flatnonzero(~done):
            total[i] += out["reward"][i]
            done[i] = out["terminated"][i] or out["truncated"][i]
            replies[i] = out["obs"].texts()[i]
        if turn < 2:  # the malformed turn was answered with an error and a penalty; the episode goes on
            assert replies[1].startswith("<error>") and out["reward"][1] == -0.25 and not done[1]
            replies[1] = ""
    assert done.all()
    assert total[0] == 1.0 and total[1] == pytest.approx(0.5)


def test_text_actions_are_checked_before_the_env_sees_them():
    pool = EnvPool(_env(num_envs=2, max_chars=32), 2)
    pool.reset(0)
    with pytest.raises(ValueError, match="2 cells"):
        pool.step(0, Ragged.from_texts(["1"]))
    with pytest.raises(ValueError, match="max_chars=32"):
        pool.step(0, Ragged.from_texts(["1", "9" * 33]))
    with pytest.raises(ValueError, match="not UTF-8"):
        pool.step(0, Ragged(np.array([0xFF, 0xFE], np.uint8), np.array([1, 1])))
    with pytest.raises(ValueError, match="text actions"):
        pool.step(0, np.zeros(2, np.int64))


@pytest.mark.parametrize("options, message", [
    ({"group_size": 3}, "multiple of env.options.group_size"),
    ({"level": 9}, "arithmetic levels"),
    ({"reward": "vibes"}, "not a registered reward"),
    ({"colour": "red"}, "not text-task options"),
])
def test_bad_task_options_name_the_field(options, message):
    from rlfabric.services.env.adapters import text

    with pytest.raises(ValueError, match=message):
        text.check(_env(num_envs=4, **options))


def test_the_tokenizer_round_trips_task_text():
    from rlfabric.services.core.models.lm import EOS, build_tokenizer

    tok = build_tokenizer()
    text = "Q: legs of a spider*7+3= A: <calc>8*7+3</calc>"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_token_id == EOS and build_tokenizer().get_vocab() == tok.get_vocab()


def test_text_crosses_the_codec_as_bytes():
    from rlfabric.services.core.codec import decode, encode

    texts = ["Q: 1+2= A:", "", "é ✓"]
    frames = encode("obs", TensorBatch({"obs": Ragged.from_texts(texts)}))
    _, batch = decode([bytes(f) for f in frames], 1 << 20)
    assert batch["obs"].texts() == texts and batch["obs"].values.dtype == np.uint8
