"""SFT from JSONL/Parquet on a Hugging Face checkpoint: rows are tokenized with the checkpoint's tokenizer and chat
template (the prompt as an RL rollout renders it), the loss covers only the response (+ eos), training lowers it,
and a run through every service exports its final policy as a Hugging Face directory (checkpoints/hf) that plain
transformers loads to the same greedy tokens."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.lm_checkpoints import make_checkpoint

pytestmark = pytest.mark.minutes(0.5)  # on CI's 2 cores: the tiers start long files first

ROWS = [{"prompt": f"What is {a} plus {b}?", "completion": f"{a + b}"} for a in range(12) for b in range(8)]
SYSTEM = "Answer with the number."


def _spec(ckpt, data, positions: int = 96, system: bool = True) -> str:
    options = f'{{system_prompt: "{SYSTEM}"}}' if system else "{}"  # (the arith task of a real run takes none)
    return f"""
name: sft-jsonl
seed: 0
env: {{adapter: text, id: arith, num_envs: 2, eval_envs: 2, options: {options}}}
policy: {{lm: {{path: {ckpt}, max_positions: {positions}}}}}
rollout: {{backend: hf, max_new_tokens: 4}}
algorithm: {{name: sft, source: offline, batch_size: 16, updates_per_iteration: 10, total_updates: 20,
            learning_rate: 0.003}}
replay: {{datasets: {{offline: {data}}}}}
train: {{eval_every_iterations: 0, eval_episodes: 2}}
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen") / "qwen2", "qwen2")


def _jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _config(ckpt, data, **kw):
    from rlfabric.services.core.config import parse_config

    return parse_config(_spec(ckpt, data, **kw))


def _codec(config):
    from rlfabric.services.core.models import build_policy
    from tests.lm_support import SPEC

    policy = build_policy("causal_lm", SPEC, config.policy)
    return policy, policy.codec


def test_jsonl_rows_are_rendered_as_in_rl_and_only_responses_carry_loss(ckpt, tmp_path):
    from rlfabric.services.core.textdata import chat_text
    from rlfabric.services.replay.datasets import load_dataset

    data = _jsonl(tmp_path / "sft.jsonl", ROWS)
    config = _config(ckpt, data)
    batch = load_dataset(data, max_rows=1000, config=config)
    policy, codec = _codec(config)
    tokens, lengths, mask = batch["tokens"], batch["lengths"], batch["loss_mask"]
    assert tokens.shape[0] == len(ROWS) == batch.rows and mask.dtype == np.uint8
    for i in (0, 37, len(ROWS) - 1):
        prompt = codec.prompt_ids(chat_text([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": ROWS[i]["prompt"]}]))
        response = codec.response_ids(ROWS[i]["completion"])
        n = len(prompt) + len(response)
        assert lengths[i] == n and tokens[i, :n].tolist() == prompt + response
        assert not mask[i, :len(prompt)].any() and mask[i, len(prompt):n].all() and not mask[i, n:].any()
        assert (tokens[i, n:] == codec.pad_id).all()
        assert "<|im_start|>system" in policy.tokenizer.decode(prompt)  # the checkpoint's chat template
        assert tokens[i, n - 1] == policy.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_sft_on_a_jsonl_file_lowers_the_loss(ckpt, tmp_path):
    from rlfabric.services.learner.algorithms.sft import SFT
    from rlfabric.services.replay.datasets import load_dataset

    data = _jsonl(tmp_path / "sft.jsonl", ROWS)
    config = _config(ckpt, data)
    batch = load_dataset(data, max_rows=1000, config=config)
    policy, _ = _codec(config)
    torch.manual_seed(0)
    algo = SFT(policy, config, torch.Generator().manual_seed(0))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(30):
        idx = rng.choice(batch.rows, 16, replace=False)
        losses.append(algo.update({k: torch.from_numpy(np.asarray(v)[idx])[None] for k, v in
                                   batch.tensors.items()})["sft_loss"])
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses


def test_parquet_chat_rows_train_every_assistant_turn(ckpt, tmp_path):
    import datasets

    from rlfabric.services.replay.datasets import load_dataset

    rows = [{"messages": [{"role": "user", "content": f"{a} plus 1?"}, {"role": "assistant", "content": str(a + 1)},
                          {"role": "user", "content": "and plus 2?"}, {"role": "assistant", "content": str(a + 3)}]}
            for a in range(10)]
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    config = _config(ckpt, str(path))
    batch = load_dataset(path, max_rows=100, config=config)
    policy, codec = _codec(config)
    for i, row in enumerate(rows):
        n = int(batch["lengths"][i])
        ids, mask = batch["tokens"][i, :n].tolist(), batch["loss_mask"][i, :n]
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        assert trained == codec.response_ids(row["messages"][1]["content"]) + codec.response_ids(
            row["messages"][3]["content"])
        text = policy.tokenizer.decode(ids)
        assert text.startswith("<|im_start|>user\n") and text.count("<|im_start|>assistant\n") == 2


def test_a_row_longer_than_the_context_is_an_error_naming_it(ckpt, tmp_path):
    from rlfabric.services.replay.datasets import DatasetError, load_dataset

    rows = ROWS[:3] + [{"prompt": "What is " + " plus ".join(["1"] * 80) + "?", "completion": "80"}]
    data = _jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DatasetError, match=r"row 3: .* exceeds policy.lm.max_positions=96.*Fix: raise"):
        load_dataset(data, max_rows=100, config=_config(ckpt, data))
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "x", "solution": "y"}])
    with pytest.raises(DatasetError, match="row 0: needs a 'prompt' prompt and a 'completion' .*prompt_field"):
        load_dataset(bad, max_rows=100, config=_config(ckpt, bad))


def test_an_sft_run_exports_a_hugging_face_directory_with_the_final_weights(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfabric.services.core.models import build_policy
    from rlfabric.services.learner import checkpoint as ckpt_io
    from rlfabric.services.replay.datasets import load_dataset, save_dataset
    from tests.lm_support import SPEC

    data = _jsonl(tmp_path / "sft.jsonl", ROWS)
    config = _config(ckpt, data)
    npz = save_dataset(tmp_path / "sft.npz", load_dataset(data, max_rows=1000, config=config))
    (tmp_path / "run.yaml").write_text(_spec(ckpt, npz, system=False))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(tmp_path / "run.yaml"), "--run-dir",
                           str(run), "--quiet"], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = run / "checkpoints" / "hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in hf.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    state = ckpt_io.unpack((run / "checkpoints" / "final.pt").read_bytes(), "final.pt")
    policy = build_policy("causal_lm", SPEC, config.policy)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    policy.load_state_dict(state["policy"])
    assert any(not torch.equal(start[k], v) for k, v in policy.state_dict().items())  # it trained
    assert tok.chat_template == policy.tokenizer.chat_template
    ids = torch.tensor([policy.codec.prompt_ids("What is 3 plus 4?")])
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": policy.codec.pad_id}
    with torch.no_grad():
        ours = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    assert ours.tolist() == theirs.tolist()


def test_an_sft_run_reads_the_jsonl_file_itself(ckpt, tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", ROWS)
    (tmp_path / "run.yaml").write_text(_spec(ckpt, data, system=False))
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(tmp_path / "run.yaml"), "--run-dir",
                           str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.csv") as f:
        losses = [float(r["sft_loss"]) for r in csv.DictReader(f) if r.get("sft_loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0]


def test_sft_prompts_are_the_dataset_tasks_prompts(ckpt, tmp_path):
    """The env's dataset task and the SFT loader turn a row into the same prompt text (system prompt, chat list,
    template), so a warm start trains on the contexts RL samples from."""
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.env.tasks.dataset import DatasetTask
    from rlfabric.services.replay.datasets import load_dataset

    rows = [{"prompt": "What is 2 plus 2?", "completion": "4", "answer": "4"},
            {"prompt": [{"role": "user", "content": "What is 3 plus 3?"}], "completion": "6", "answer": "6"}]
    data = _jsonl(tmp_path / "rows.jsonl", rows)
    for options in ({"system_prompt": SYSTEM}, {"template": "Q: {prompt}\\nA:"}, {}):
        spec = _spec(ckpt, data).replace(f'{{system_prompt: "{SYSTEM}"}}', json.dumps(options))
        batch = load_dataset(data, max_rows=10, config=parse_config(spec))
        task = DatasetTask(path=data, eval_path=data, **options)  # (every row in the train split)
        policy, codec = _codec(parse_config(spec))
        prompts = {r.answer: r.prompt for r in task.rows}
        for i, row in enumerate(rows):
            want = codec.prompt_ids(prompts[row["answer"]])
            assert batch["tokens"][i, :len(want)].tolist() == want, options
            assert not batch["loss_mask"][i, :len(want)].any() and batch["loss_mask"][i, len(want)]
