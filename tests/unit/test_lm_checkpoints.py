"""Hugging Face checkpoint directories as LM policies (``policy.lm.path``): a Qwen2/Qwen3/Llama with its own BPE
tokenizer, chat template and generation config loads, the codec's special ids are the checkpoint's, chat prompts go
through its template, generation stops at its eos, and ``save_pretrained`` writes a directory plain transformers
opens to the same greedy outputs. A built model's BPE tokenizer is the same in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.lm_checkpoints import make_checkpoint
from tests.lm_support import SPEC, lm_run, perturb

ARCHS = ("qwen2", "qwen3", "llama")
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 plus 3?"}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root / arch, arch) for arch in ARCHS}


def _run(path, backend: str = "hf", lora: int = 0):
    run = lm_run(backend, lora=lora, positions=128)
    run.policy.lm.path = str(path)
    return run


def _policy(path, lora: int = 0):
    from rlfabric.services.core.models import build_policy

    return build_policy("causal_lm", SPEC, _run(path, lora=lora).policy)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_checkpoint_loads_with_its_own_special_tokens_and_chat_template(checkpoints, arch):
    from transformers import AutoTokenizer, GenerationConfig

    from rlfabric.services.core.textdata import chat_text

    path = checkpoints[arch]
    policy = _policy(path)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    gen = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    codec = policy.codec
    assert type(policy.model).__name__.lower().startswith(arch)
    assert set(codec.eos_ids) == set(gen.eos_token_id) and codec.eos_ids[0] == tok.eos_token_id
    if arch == "llama":
        assert codec.bos_id == tok.convert_tokens_to_ids("<|begin_of_text|>")
        assert codec.pad_id == codec.eos_ids[0]  # no pad token: the first eos pads
    else:
        assert codec.bos_id is None  # Qwen adds no bos
        assert codec.pad_id == tok.convert_tokens_to_ids("<|endoftext|>")
        assert tok.eos_token == "<|im_end|>"
    ids = codec.prompt_ids(chat_text(CHAT))
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert codec.prompt_ids("2 plus 3") == ([codec.bos_id] if codec.bos_id is not None else []) + tok.encode(
        "2 plus 3", add_special_tokens=False)
    assert codec.response_ids("5.")[-1] == codec.eos_ids[0]
    assert codec.decode(codec.response_ids("The answer is 5.")) == "The answer is 5."


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_generation_stops_at_the_checkpoints_eos(checkpoints, arch):
    from rlfabric.services.core.models.lm import bias_end_token
    from rlfabric.services.core.textdata import chat_text
    from rlfabric.services.rollout.backends.hf import HFBackend

    backend = HFBackend(_run(checkpoints[arch]), SPEC, "cpu")
    eos = backend.codec.eos_ids[0]  # <|im_end|> / <|eot_id|>: not the char tokenizer's id 2
    assert eos >= 256 and eos == backend.tokenizer.convert_tokens_to_ids("<|im_end|>" if arch != "llama" else
                                                                         "<|eot_id|>")
    state = bias_end_token(backend.policy.model.state_dict(), 4.0, eos=eos)
    backend.load(1, {f"model.{k}": v for k, v in state.items()})
    prompts = [backend.prompt_ids(chat_text(CHAT)), backend.prompt_ids("What is 1 plus 1?")]
    gens = backend.generate(prompts, 24, sample=True)
    assert all(g.finished and g.tokens[-1] == eos and len(g.tokens) < 24 for g in gens), \
        [g.tokens.tolist() for g in gens]
    assert all(eos not in g.tokens[:-1] for g in gens)


def test_stop_strings_end_a_sample_where_its_text_ends_with_one():
    from rlfabric.services.core.models.tokenizer import TextCodec, build_tokenizer

    tok = build_tokenizer()
    codec = TextCodec(tok, SimpleNamespace(eos_token_id=2, stop_strings=["</answer>"], pad_token_id=None))
    ids = codec.encode("<answer>5</answer> and more")
    n, finished = codec.end(ids)
    assert finished and codec.decode(ids[:n]) == "<answer>5</answer>"
    assert codec.end(codec.encode("no stop here")) == (len("no stop here"), False)
    assert codec.end([*codec.encode("ab"), 2, *codec.encode("c")]) == (3, True)


@pytest.mark.parametrize("arch, lora", [("qwen2", 0), ("qwen3", 2), ("llama", 0)])
def test_save_pretrained_round_trips_to_the_same_greedy_tokens_in_plain_transformers(checkpoints, tmp_path, arch,
                                                                                     lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfabric.services.core.textdata import chat_text

    policy = _policy(checkpoints[arch], lora=lora)
    perturb(policy.model, 1, scale=0.2)  # with LoRA: adapters and base both move, the export must merge them
    policy.save_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tok.chat_template == policy.tokenizer.chat_template and "lora" not in json.dumps(
        list(model.state_dict()))
    assert model.generation_config.eos_token_id == policy.model.generation_config.eos_token_id
    ids = torch.tensor([policy.codec.prompt_ids(chat_text(CHAT))])
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": policy.codec.pad_id}
    with torch.no_grad():
        ours = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    assert ours.tolist() == theirs.tolist() and ours.shape[1] > ids.shape[1]


BPE_SCRIPT = """
import hashlib, sys
from rlfabric.services.core.config import parse_config
from rlfabric.services.core.models.tokenizer import load_tokenizer
cfg = parse_config(open(sys.argv[1]).read())
tok = load_tokenizer(cfg.policy.lm)
print(len(tok), hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest())
"""


def test_a_built_models_bpe_tokenizer_is_the_same_in_every_process(tmp_path):
    from rlfabric.services.core.models.tokenizer import load_tokenizer

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"What is {a} times {b}?", "answer": str(a * b)} for a in range(30) for b in range(12)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    spec = f"""
name: t
env: {{adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {{group_size: 2}}}}
policy: {{lm: {{hidden_size: 64, intermediate_size: 128, heads: 1, tokenizer_corpus: {data}, vocab_size: 300}}}}
algorithm: {{name: grpo}}
"""
    (tmp_path / "run.yaml").write_text(spec)
    outs = [subprocess.run([sys.executable, "-c", BPE_SCRIPT, str(tmp_path / "run.yaml")], capture_output=True,
                           text=True, check=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": str(seed)}
                           ).stdout.split() for seed in (1, 2)]
    assert outs[0] == outs[1] and 256 + 3 < int(outs[0][0]) <= 300  # bytes, specials, then learned merges
    from rlfabric.services.core.config import parse_config

    tok = load_tokenizer(parse_config((tmp_path / "run.yaml").read_text()).policy.lm)
    pieces = tok.tokenize("What is 12 times 7?")  # words merged, numbers digit by digit (as Qwen2 splits them)
    assert "Ġtimes" in pieces and "1" in pieces and "2" in pieces and len(pieces) < len("What is 12 times 7?") // 2 + 1
    assert tok.decode(tok.encode("naïve — ok", add_special_tokens=False)) == "naïve — ok"  # bytes: nothing unknown


def test_a_dataset_task_run_trains_its_tokenizer_on_its_data_file():
    from rlfabric.services.core.config import RunConfig

    base = {"env": {"adapter": "text", "id": "dataset", "options": {"path": "data/qa.jsonl", "group_size": 2}},
            "algorithm": {"name": "grpo"}}
    try:
        cfg = RunConfig.model_validate(base)
    except ValueError as exc:  # the dataset task's own option checks may refuse this minimal spec
        pytest.skip(f"the dataset task rejects a minimal spec here: {str(exc)[:200]}")
    assert cfg.policy.lm.tokenizer_corpus == "data/qa.jsonl"
    assert "data/qa.jsonl" in cfg.model_dump_json()
    with_path = RunConfig.model_validate({**base, "policy": {"lm": {"path": "some/checkpoint"}}})
    assert with_path.policy.lm.tokenizer_corpus == ""  # a checkpoint brings its own tokenizer


class _Env:
    """Answers one turn: reward 1, and reward_failed on the odd samples."""

    def __init__(self, n: int):
        self.n = n

    def request(self, op, batch):
        from rlfabric.services.core.batch import Ragged, TensorBatch

        if op == "reset":
            return None, TensorBatch({"obs": Ragged.from_texts(["Q: 1+1= A:"] * self.n)})
        return None, TensorBatch({"obs": Ragged.from_texts([""] * self.n), "reward": np.ones(self.n, np.float32),
                                  "terminated": np.ones(self.n, bool), "truncated": np.zeros(self.n, bool),
                                  "reward_failed": (np.arange(self.n) % 2).astype(np.float32)})


def test_episodes_start_from_the_backends_prompt_ids_and_count_reward_failures():
    from rlfabric.services.rollout.backends.hf import HFBackend
    from rlfabric.services.rollout.collectors.llm import LLMCollector

    run = lm_run("hf")
    backend = HFBackend(run, SPEC, "cpu")
    collector = LLMCollector(run, backend, _Env(4), 4, 1, "train")
    out = collector.collect(0, 0, None)
    prompt = backend.prompt_ids("Q: 1+1= A:")
    assert prompt[0] == backend.codec.bos_id and len(prompt) == len("Q: 1+1= A:") + 1
    for row, mask in zip(out.batch["tokens"].rows(), out.batch["loss_mask"].rows(), strict=True):
        assert list(row[:len(prompt)]) == prompt and not mask[:len(prompt)].any() and mask[len(prompt):].all()
    assert out.stats["reward_failures"] == 2.0


def test_a_generation_config_stop_string_ends_hf_generation(checkpoints, tmp_path):
    import shutil

    from rlfabric.services.rollout.backends.hf import HFBackend

    path = tmp_path / "qwen2"
    shutil.copytree(checkpoints["qwen2"], path)
    plain = HFBackend(_run(path), SPEC, "cpu")
    prompt = [plain.prompt_ids("What is 4 plus 4?")]
    free = plain.generate(prompt, 10, sample=False)[0].tokens.tolist()
    stop = plain.decode(free[:3])
    assert stop and plain.decode(free[:2]) != stop
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "stop_strings": [stop]}))
    backend = HFBackend(_run(path), SPEC, "cpu")
    assert backend.codec.stop_strings == [stop]
    g = backend.generate(prompt, 10, sample=False)[0]
    assert g.finished and g.tokens.tolist() == free[:3] and backend.decode(g.tokens).endswith(stop)


def test_the_tokenizer_corpus_is_confined_to_the_data_roots(tmp_path):
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.paths import DataRoots, PathRefused, confine_model
    from rlfabric.services.replay.datasets import DatasetError, load_dataset

    inside, outside = tmp_path / "data", tmp_path / "elsewhere"
    for d in (inside, outside):
        d.mkdir()
        (d / "c.jsonl").write_text('{"prompt": "a b c", "completion": "d"}\n')
    roots = DataRoots.parse(str(inside))

    def run(corpus):
        return parse_config(f"""
name: t
env: {{adapter: text, id: arith, num_envs: 2, eval_envs: 2}}
policy: {{lm: {{hidden_size: 64, intermediate_size: 128, heads: 1, tokenizer_corpus: {corpus}, vocab_size: 270}}}}
algorithm: {{name: sft, source: offline}}
replay: {{datasets: {{offline: {inside / "c.jsonl"}}}}}
""")

    assert confine_model(run(inside / "c.jsonl"), roots).policy.lm.tokenizer_corpus == str(inside / "c.jsonl")
    with pytest.raises(PathRefused, match="policy.lm.tokenizer_corpus"):
        confine_model(run(outside / "c.jsonl"), roots)
    with pytest.raises(DatasetError, match="policy.lm.tokenizer_corpus"):  # replay refuses it too
        load_dataset(inside / "c.jsonl", 10, roots=roots, config=run(outside / "c.jsonl"))
    batch = load_dataset(inside / "c.jsonl", 10, roots=roots, config=run(inside / "c.jsonl"))
    assert batch["loss_mask"].sum() == 2  # "d" and the eos


def test_a_checkpoints_own_context_bounds_episodes_and_a_prompt_that_cannot_start_is_an_error(checkpoints):
    """policy.lm.path: the context is the checkpoint's max_position_embeddings unless the spec sets max_positions
    (lower); a prompt that leaves no room for its first turn fails loudly instead of scoring 0 silently."""
    from rlfabric.services.core.config import RunConfig
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.rollout.backends.hf import HFBackend
    from rlfabric.services.rollout.collectors.llm import LLMCollector

    base = lm_run("hf").model_dump()
    base["policy"]["lm"] = {"path": str(checkpoints["qwen2"])}  # max_positions left unset
    own = build_policy("causal_lm", SPEC, RunConfig.model_validate(base).policy)
    assert own.context == own.model.config.max_position_embeddings == 256
    base["policy"]["lm"]["max_positions"] = 100
    assert build_policy("causal_lm", SPEC, RunConfig.model_validate(base).policy).context == 100
    base["policy"]["lm"]["max_positions"] = 16  # shorter than the prompt plus max_new_tokens
    base["rollout"]["max_new_tokens"] = 12
    run = RunConfig.model_validate(base)
    collector = LLMCollector(run, HFBackend(run, SPEC, "cpu"), _Env(4), 4, 1, "train")
    with pytest.raises(ValueError, match=r"exceeds the model's context of 16 tokens.*rollout.max_new_tokens"):
        collector.collect(0, 0, None)
