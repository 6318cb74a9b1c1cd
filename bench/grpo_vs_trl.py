"""rlfabric GRPO against Hugging Face TRL's GRPOTrainer, side by side in one run, on this machine.

Both start from the same supervised warm start (examples/arith_sft.yaml on generated data, made here), train the
same tiny Llama on the same task (arithmetic level 2, exact-match reward) with the same settings:

    group size 8, 8 prompts per update, at most 6 new tokens, temperature 1, learning rate 2e-4 (constant),
    AdamW, grad-norm clip 1, eps 0.2 both sides, no KL, per-response mean loss (TRL loss_type "grpo"),
    group-scaled advantages, one optimiser step per batch, ``--updates`` updates

and are scored the same way: greedy exact match on the same ``--eval`` held-out problems, by one function.

Reported: the training wall-clock of each (TRL: ``trainer.train()``; rlfabric: first to last iteration), the
whole command's wall-clock (start-up included), held-out accuracy before and after. rlfabric runs in several
configurations (backend x plan); the headline ``wall_vs_trl`` is the fastest one whose accuracy is at least TRL's.

    python bench/grpo_vs_trl.py --out bench/results/grpo_vs_trl.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import report  # noqa: E402

GROUP, PROMPTS, NEW_TOKENS, LR, LEVEL = 8, 8, 6, 2e-4, 2
# generation of batch i+1 overlaps update i (one core each); the clipped ratio is against the sampling policy
PIPELINED = ["scheduling.mode=hybrid", "scheduling.staleness=1", "scheduling.placement={env: a, rollout: a, learner: b}"]
CONFIGS = {  # rlfabric variants: name -> --set overrides of examples/arith_grpo.yaml
    "hf collocated": ["rollout.backend=hf", "runtime.torch_threads=2"],  # stages take turns: each gets both cores
    "hf pipelined": ["rollout.backend=hf", *PIPELINED],
    "vllm collocated": ["rollout.backend=vllm", "runtime.torch_threads=2"],
    "vllm pipelined": ["rollout.backend=vllm", *PIPELINED],
}


def cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"rlfabric {' '.join(args[:2])} failed:\n{proc.stderr[-3000:]}")
    return proc, time.perf_counter() - t0


def warm_start(tmp: Path, updates: int) -> Path:
    import numpy as np

    from services.env.tasks.sft_data import build

    data = tmp / "arith_sft.npz"
    np.savez(data, **build("arith", 4000, seed=0))
    cli("train", "examples/arith_sft.yaml", "--run-dir", str(tmp / "sft"), "--quiet",
        "--set", f"replay.datasets.offline={data}", "--set", f"algorithm.total_updates={updates}")
    return tmp / "sft" / "checkpoints" / "final.pt"


def held_out_accuracy(state: dict, n: int) -> float:
    """Greedy exact match on ``n`` held-out problems: one function for every model of the comparison."""
    import torch

    from services.core.config import load_config
    from services.env.tasks.arith import ArithTask
    from services.rollout.backends.hf import HFBackend

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


def ours(name: str, sets: list[str], checkpoint: Path, tmp: Path, updates: int) -> dict:
    from services.learner import checkpoint as ckpt

    run = tmp / name.replace(" ", "-")
    overrides = [f"policy.init_checkpoint={checkpoint}", f"train.total_env_steps={GROUP * PROMPTS * updates}",
                 "train.eval_every_iterations=0", "checkpoint.every_iterations=0", *sets]
    _, wall = cli("train", "examples/arith_grpo.yaml", "--run-dir", str(run), "--quiet",
                  *[a for s in overrides for a in ("--set", s)])
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert int(rows[-1]["optimizer_steps"]) == updates, rows[-1]["optimizer_steps"]
    first, last = rows[0], rows[-1]
    train = float(last["wall_time_s"]) - float(first["wall_time_s"]) + float(first["iteration_seconds"])
    state = ckpt.unpack((run / "checkpoints" / "final.pt").read_bytes())["policy"]
    return {"train_wall_s": train, "command_wall_s": wall, "updates": updates, "state": state}


def trl_child(checkpoint: str, updates: int, out: str) -> None:
    """TRL's side, in its own process (its imports and threads do not touch ours)."""
    t_start = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from tokenizers import processors
    from trl import GRPOConfig, GRPOTrainer

    from services.core.config import load_config
    from services.core.models import build_policy
    from services.core.models.lm import BOS
    from services.env.tasks.arith import ArithTask
    from services.learner import checkpoint as ckpt

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 512}
    policy = build_policy("causal_lm", {"observation_space": text, "action_space": text},
                          load_config(ROOT / "examples" / "arith_grpo.yaml").policy)
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
        from services.env.tasks.arith import Problem

        return [1.0 if task.correct(Problem(q, a), c) else 0.0
                for c, q, a in zip(completions, question, answer, strict=True)]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), num_generations=GROUP,
        per_device_train_batch_size=GROUP * PROMPTS, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="grpo", scale_rewards="group", max_steps=updates,
        logging_steps=10, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, dataloader_num_workers=0, shuffle_dataset=True)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    t0 = time.perf_counter()
    trainer.train()
    train = time.perf_counter() - t0
    save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, out + ".safetensors")
    Path(out).write_text(json.dumps({"train_wall_s": train, "command_wall_s": time.perf_counter() - t_start,
                                     "updates": trainer.state.global_step}))


def trl(checkpoint: Path, tmp: Path, updates: int) -> dict:
    from safetensors.torch import load_file

    out = tmp / "trl.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-child", str(checkpoint), "--updates", str(updates),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - t0
    result["state"] = load_file(str(out) + ".safetensors")
    assert result["updates"] == updates, result["updates"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--sft-updates", type=int, default=500)
    ap.add_argument("--eval", type=int, default=512, help="held-out problems scored")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="rlfabric configurations to run")
    ap.add_argument("--out", default="bench/results/grpo_vs_trl.json")
    ap.add_argument("--trl-child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        return trl_child(args.trl_child, args.updates, args.out)

    from services.learner import checkpoint as ckpt

    tmp = Path(tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    checkpoint = warm_start(tmp, args.sft_updates)
    before = held_out_accuracy(ckpt.unpack(checkpoint.read_bytes())["policy"], args.eval)
    print(f"warm start: held-out accuracy {before:.3f}")
    results = {"trl": trl(checkpoint, tmp, args.updates)}
    for name in args.configs.split(","):
        results[name] = ours(name, CONFIGS[name], checkpoint, tmp, args.updates)
    metrics: dict = {"updates": args.updates, "group_size": GROUP, "prompts_per_update": PROMPTS,
                     "max_new_tokens": NEW_TOKENS, "learning_rate": LR, "eval_problems": args.eval,
                     "warm_start_accuracy": before}
    for name, r in results.items():
        r["accuracy"] = held_out_accuracy(r.pop("state"), args.eval)
        metrics[name] = r
        print(f"{name:16s} train {r['train_wall_s']:6.1f} s  command {r['command_wall_s']:6.1f} s  "
              f"held-out accuracy {before:.3f} -> {r['accuracy']:.3f}")
    t = results["trl"]
    ratios = {}
    for name in args.configs.split(","):
        ratios[f"wall_vs_trl[{name}]"] = results[name]["train_wall_s"] / t["train_wall_s"]
        ratios[f"accuracy_minus_trl[{name}]"] = results[name]["accuracy"] - t["accuracy"]
    fair = [n for n in args.configs.split(",") if results[n]["accuracy"] >= t["accuracy"]]
    best = min(fair or args.configs.split(","), key=lambda n: results[n]["train_wall_s"])
    ratios["wall_vs_trl"] = results[best]["train_wall_s"] / t["train_wall_s"]
    ratios["accuracy_minus_trl"] = results[best]["accuracy"] - t["accuracy"]
    metrics["headline_config"] = best
    print(f"headline: {best}")
    report("grpo_vs_trl", metrics, ratios, {"wall_vs_trl": "<=0.5", "accuracy_minus_trl": ">=0"}, args.out)


if __name__ == "__main__":
    main()
