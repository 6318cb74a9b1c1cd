"""The dataset text task: rows of a JSONL or Parquet file become prompts (chat or template) with reference
answers and fields, split into train and held-out rows (a held-out file, or a hash of the prompt), with errors
that name the option, the row and the fix; and a BM25 search tool over a user's corpus."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from rlfabric.services.core.batch import Ragged
from rlfabric.services.core.textdata import chat_messages
from rlfabric.services.env.tasks.dataset import Corpus, DatasetTask
from rlfabric.services.env.tasks.tools import ToolError, run_turn

ROWS = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}", "level": i % 3}
        for i in range(200)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _env(num_envs=4, **options):
    return SimpleNamespace(id="dataset", adapter="text", num_envs=num_envs, action_chunk=1, eval_envs=num_envs,
                           kwargs={}, options=options, eval_options={})


@pytest.fixture
def data(tmp_path):
    return _jsonl(tmp_path / "train.jsonl", ROWS)


def test_a_string_prompt_becomes_a_chat_with_the_system_prompt_and_the_row_keeps_its_fields(data):
    task = DatasetTask(data, prompt_field="question", system_prompt="Think, then answer after ####.")
    row = task.problems(1, 0)[0]
    source = ROWS[row.index]
    assert chat_messages(task.prompt(row)) == [
        {"role": "system", "content": "Think, then answer after ####."},
        {"role": "user", "content": source["question"]}]
    assert row.answer == source["answer"] and row.fields == {"level": source["level"]}
    assert task.transcript(row) == [(task.prompt(row), False), (source["answer"], True)]
    assert row.id == f"path row {row.index}"


def test_a_template_makes_plain_text_and_parquet_reads_like_jsonl(tmp_path):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    task = DatasetTask(str(path), prompt_field="question", template="Question: {prompt}\nAnswer:")
    rows = task.problems(50, 1)
    assert {r.prompt for r in rows} <= {f"Question: {r['question']}\nAnswer:" for r in ROWS}
    assert all(chat_messages(task.prompt(r)) is None for r in rows)
    assert all(r.answer == ROWS[r.index]["answer"] for r in rows)


def test_a_messages_prompt_is_used_as_is_with_the_system_prompt_first(tmp_path):
    chats = [{"prompt": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": "OK."},
                         {"role": "user", "content": "Now."}], "answer": i} for i in range(20)]
    task = DatasetTask(_jsonl(tmp_path / "chat.jsonl", chats), system_prompt="Be brief.")
    row = task.problems(1, 3)[0]
    assert chat_messages(row.prompt) == [{"role": "system", "content": "Be brief."}, *chats[row.index]["prompt"]]
    assert row.answer == str(row.index)  # a number answer becomes its text
    plain = DatasetTask(_jsonl(tmp_path / "chat.jsonl", chats), template="{prompt} ->").problems(1, 3)[0]
    assert plain.prompt == f"Say {plain.index}.\n\nOK.\n\nNow. ->"


def test_the_hash_split_and_an_eval_file_give_disjoint_prompts(data, tmp_path):
    train = {r.prompt for r in DatasetTask(data, prompt_field="question").rows}
    held = {r.prompt for r in DatasetTask(data, split="held_out", prompt_field="question").rows}
    assert train and held and not train & held and len(train) + len(held) == len(ROWS)
    assert 0.1 < len(held) / len(ROWS) < 0.3  # held_out_fraction 0.2
    evals = _jsonl(tmp_path / "eval.jsonl", [{"question": "What is 1000 plus 1?", "answer": "1001"}])
    task = DatasetTask(data, split="held_out", prompt_field="question", eval_path=evals)
    assert [r.answer for r in task.rows] == ["1001"] and task.rows[0].source == "eval_path"
    assert len(DatasetTask(data, prompt_field="question", eval_path=evals).rows) == len(ROWS)  # train: all of path


@pytest.mark.parametrize("options, message", [
    ({"path": "missing.jsonl"}, r"env.options.path='missing.jsonl': no such file"),
    ({"path": "DATA"}, r"env.options.path='.*' row 0 has no 'prompt' field .*Fix: set env.options.prompt_field"),
    ({"path": "DATA", "prompt_field": "question", "answer_field": "solution"},
     r"row 0 has no 'solution' field .*env.options.answer_field"),
    ({"path": "DATA", "prompt_field": "level"}, r"row 0: the prompt field 'level' holds a int"),
    ({"path": "DATA", "prompt_field": "question", "template": "Q: {question}"}, r"env.options.template=.*name only"),
    ({"path": "DATA", "prompt_field": "question", "tools": ["search"]}, r"env.options.corpus is not set"),
    ({"path": "DATA", "prompt_field": "question", "tools": ["browse"]}, r"offers \['search'\]"),
    ({"prompt_field": "question"}, r"env.options.path is required for env.id 'dataset'"),
    ({"path": "DATA", "level": 2}, r"env.options.level does not apply to env.id 'dataset'"),
    ({"path": "DATA", "tools": "search"}, r"env.options.tools='search': expected a list of names"),
    ({"path": "DATA", "reward_timeout_s": 0}, r"env.options.reward_timeout_s=0"),
    ({"path": "DATA", "reward_timeout_s": 30}, r"env.options.reward_step_timeout_s=20.0: seconds in \[reward_timeout"),
])
def test_bad_options_and_rows_name_the_option_the_row_and_the_fix(data, options, message):
    from rlfabric.services.env.adapters import text

    options = {k: (data if v == "DATA" else v) for k, v in options.items()}
    with pytest.raises(ValueError, match=message):
        text.check(_env(**options))


def test_a_spec_may_lower_the_operators_reward_limits_never_lift_them(data):
    from rlfabric.services.env import reward_pool
    from rlfabric.services.env.adapters import text

    reward_pool.set_operator_limits(reward_pool.OperatorLimits(memory_mb=1024, timeout_s=5.0))
    try:
        for options, message in (({"reward_memory_mb": 0}, r"reward_memory_mb=0: MiB in \[256, 1024\].*--reward-memory-mb"),
                                 ({"reward_memory_mb": 4096}, r"reward_memory_mb=4096.*never lift it"),
                                 ({"reward_timeout_s": 10.0}, r"reward_timeout_s=10.0: seconds in \(0, 5\].*"
                                                              r"--reward-timeout-s")):
            with pytest.raises(ValueError, match=message):
                text.check(_env(path=data, prompt_field="question", **options))
        opts, _ = text._options(_env(path=data, prompt_field="question", reward_timeout_s=2.0))
        assert opts["reward_memory_mb"] == 1024  # the operator's limit, unless the spec asks less
        opts, _ = text._options(_env(path=data, prompt_field="question", reward_memory_mb=512, reward_timeout_s=2.0))
        assert opts["reward_memory_mb"] == 512
        # a spec's 0 ("no limit") only where the operator set no limit either (--reward-memory-mb 0)
        reward_pool.set_operator_limits(reward_pool.OperatorLimits(memory_mb=0, timeout_s=5.0))
        opts, _ = text._options(_env(path=data, prompt_field="question", reward_memory_mb=0, reward_timeout_s=2.0))
        assert opts["reward_memory_mb"] == 0
    finally:
        reward_pool.set_operator_limits(reward_pool.OperatorLimits())


def test_a_row_missing_its_answer_is_named_by_number(tmp_path):
    path = _jsonl(tmp_path / "gap.jsonl", [*ROWS[:5], {"question": "What?"}, *ROWS[5:10]])
    with pytest.raises(ValueError, match=r"row 5 has no 'answer' field"):
        DatasetTask(path, prompt_field="question")


def test_the_text_adapter_scores_data_set_answers_with_the_gsm8k_reward(data):
    from rlfabric.services.env.pool import EnvPool

    pool = EnvPool(_env(num_envs=4, path=data, prompt_field="question", reward="gsm8k", group_size=2), 4)
    try:
        prompts = pool.reset(5)[0].texts()
        assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
        questions = [chat_messages(p)[-1]["content"] for p in prompts]
        right = [str(2 * int(q.split()[2])) for q in questions]
        out = pool.step(0, Ragged.from_texts([f"#### {right[0]}", "#### 0", f"it is {right[2]}", "no idea"]))
        assert out["reward"].tolist() == [1.0, 0.0, 1.0, 0.0] and out["terminated"].all()
        assert "reward_failed" not in out  # sent only when a reward failed
    finally:
        pool.close()


CORPUS = [{"title": "Spiders", "text": "A spider has eight legs and spins silk."},
          {"title": "Octopus", "text": "An octopus has three hearts and blue blood."},
          {"title": "Paris", "text": "Paris is the capital of France."}]


def test_bm25_search_finds_the_passage_and_refuses_a_query_that_matches_none(tmp_path):
    corpus = Corpus(CORPUS)
    assert corpus.search("how many hearts does an octopus have") == "Octopus\n" + CORPUS[1]["text"]
    assert corpus.search("capital of France") == "Paris\n" + CORPUS[2]["text"]
    for query in ("zebra velocity", "the of a"):
        with pytest.raises(ToolError):
            corpus.search(query)
    with pytest.raises(ValueError, match="row 1 has no 'text' string"):
        Corpus([CORPUS[0], {"title": "x"}])


def test_a_search_task_answers_search_turns_and_ends_on_an_answer(tmp_path):
    from rlfabric.services.env.pool import EnvPool

    corpus = _jsonl(tmp_path / "corpus.jsonl", CORPUS)
    rows = _jsonl(tmp_path / "qa.jsonl", [{"prompt": "How many hearts does an octopus have?", "answer": "3"}] * 4)
    task = DatasetTask(rows, tools=["search"], corpus=corpus, held_out_fraction=0.01)
    assert task.multi_turn and "<search>" in chat_messages(task.rows[0].prompt)[0]["content"]  # default system
    assert run_turn("<search>octopus hearts</search>", task.tools).reply == f"<result>Octopus\n{CORPUS[1]['text']}</result>"
    pool = EnvPool(_env(num_envs=2, path=rows, tools=["search"], corpus=corpus, held_out_fraction=0.01,
                        parse_penalty=0.25), 2)
    try:
        pool.reset(0)
        first = pool.step(0, Ragged.from_texts(["<search>octopus hearts</search>", "hmm"]))
        assert first["obs"].texts() == [f"<result>Octopus\n{CORPUS[1]['text']}</result>",
                                        "<error>no complete <search> or <answer> tag</error>"]
        assert first["reward"].tolist() == [0.0, -0.25] and not first["terminated"].any()
        last = pool.step(0, Ragged.from_texts(["<answer>3</answer>", "<answer>2</answer>"]))
        assert last["reward"].tolist() == [1.0, 0.0] and last["terminated"].all()
    finally:
        pool.close()
    assert np.isclose(pool.finished_returns, [1.0, -0.25]).all()


def test_the_search_example_builds_and_every_answer_is_in_the_passage_its_question_finds(monkeypatch):
    """examples/search_grpo.yaml: the spec's env checks out, and a policy that searches the question itself finds
    the passage holding the answer for every row of the shipped data (the task is solvable by searching)."""
    from pathlib import Path

    from rlfabric.services.core.config import load_config
    from rlfabric.services.env.adapters import text

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    config = load_config("examples/search_grpo.yaml")
    text.check(config.env)
    options = dict(config.env.options)
    train = DatasetTask(options["path"], prompt_field="question", template=options["template"],
                        tools=["search"], corpus=options["corpus"])
    held = DatasetTask(options["path"], split="held_out", prompt_field="question", template=options["template"],
                       tools=["search"], corpus=options["corpus"])
    for row in train.rows + held.rows:
        question = row.prompt.split("Q: ")[1].split(" Search with")[0]
        reply = run_turn(f"<search>{question}</search>", train.tools).reply
        assert reply.startswith("<result>") and f" {row.answer}" in reply, (question, reply)
    assert len(train.rows) + len(held.rows) == 60 and held.rows


def test_the_example_user_reward_scores_gsm8k_answers(monkeypatch):
    from pathlib import Path

    from rlfabric.services.env.tasks.rewards import REWARDS, call_reward

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    monkeypatch.setattr(REWARDS, "_loaded", {})
    reward = REWARDS.load("user_reward:gsm8k_shaped")
    ref = "8 - 1 = 7\n#### 7"
    assert [call_reward(reward, "q", c, ref, {"level": 1}) for c in ("so #### 7", "#### 8", "7")] == [1.0, 0.1, 0.0]
    monkeypatch.delitem(sys.modules, "user_reward")
