"""HFBackend: batched ``generate`` of a transformers causal LM (the ``causal_lm`` policy), with the log-probability
of every sampled token, and weight versions loaded in place through a state-dict receiver.

Prompts of different lengths are left-padded into one batch with the checkpoint's pad id; a sample ends at any of
its eos ids (generation_config's and the tokenizer's) or, where the generation config names stop strings, once its
text ends with one (``policy.codec``, services/core/models/tokenizer.py, knows these). Log-probs are those of the distribution sampled from
(logits over the sampling temperature, no top-k/top-p), which is what the learner recomputes: the difference
between the two is the logprob-mismatch metric. Sampling draws from a torch RNG stream forked per call and seeded
from this backend's generator, so a worker's samples are reproducible and nothing else's random state moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfabric.services.core.models import build_policy
from rlfabric.services.rollout.backends.receivers import StateDictReceiver


@dataclass
class Generation:
    """One sample's new tokens (ending with eos or a stop string unless cut at ``max_new_tokens``) and their
    log-probs."""

    tokens: np.ndarray  # int64 [n]
    logp: np.ndarray  # float32 [n]
    finished: bool  # ended with eos or a stop string (False: cut by the length limit)


class LMBackend:
    """What every language-model backend shares: the run's tokenizer and its codec (special tokens, prompt
    rendering), and weight versions through a receiver (``self.receiver``) with the version it serves."""

    receiver: Any

    def __init__(self, config: Any, env_spec: dict, device: torch.device | str, policy_device: str | None = None):
        """The run's policy (on ``policy_device``, default the backend's device), its tokenizer, the sampling
        temperature and this worker's seeded generator."""
        self.device = torch.device(device)
        self.policy = build_policy(config.policy_name, env_spec, config.policy).to(policy_device or self.device)
        self.policy.eval()
        self.tokenizer = self.policy.tokenizer
        self.codec = self.policy.codec
        self.has_value = False
        self.temperature = config.rollout.temperature
        self.generator = torch.Generator().manual_seed(config.seed + 1)
        self.version = -1

    def load(self, version: int, tensors: dict[str, Any]) -> None:
        self.receiver.load(version, tensors)
        self.version = version

    def prompt_ids(self, text: str) -> list[int]:
        """The context an episode starts from (a chat prompt through the chat template; see TextCodec)."""
        return self.codec.prompt_ids(text)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, tokens: Any) -> str:
        return self.codec.decode(tokens)


def engine_dtype(dtype: str, device: torch.device) -> str:
    """``rollout.dtype`` as an engine's dtype argument: auto is float32 on CPUs (the numbers the learner
    recomputes) and the checkpoint's own dtype on GPUs."""
    if dtype == "auto":
        return "float32" if device.type == "cpu" else "auto"
    return dtype


class HFBackend(LMBackend):
    def __init__(self, config: Any, env_spec: dict, device: torch.device | str = "cpu"):
        super().__init__(config, env_spec, device)
        if config.rollout.dtype == "bfloat16":  # weight versions arrive in fp32; load_state_dict casts them
            self.policy.to(torch.bfloat16)
        self.receiver = StateDictReceiver(self.policy)

    def generate(self, contexts: list[list[int]], max_new_tokens: int, sample: bool = True,
                 enough: Any = None) -> list[Generation | None]:
        """Continue every context by up to ``max_new_tokens`` tokens (sampled, or greedy when ``sample`` is
        False). ``enough`` (a streaming engine's early cut) does not apply: a batched generate returns every row
        at once."""
        if not contexts:
            return []
        longest = max(len(c) for c in contexts)
        codec = self.codec
        ids = torch.full((len(contexts), longest), codec.pad_id, dtype=torch.long, device="cpu")  # (moved below)
        mask = torch.zeros((len(contexts), longest), dtype=torch.long, device="cpu")
        for i, c in enumerate(contexts):  # left padding: every prompt ends where generation starts
            ids[i, longest - len(c):] = torch.tensor(c, dtype=torch.long, device="cpu")
            mask[i, longest - len(c):] = 1
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))
        kwargs = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0} if sample else \
            {"do_sample": False}
        if codec.stop_strings:  # matched on text: generate needs the tokenizer
            kwargs |= {"stop_strings": codec.stop_strings, "tokenizer": self.tokenizer}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.policy.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_new_tokens,
                eos_token_id=codec.eos_ids, pad_token_id=codec.pad_id, output_logits=True, return_dict_in_generate=True, **kwargs)
        new = out.sequences[:, longest:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, new, vocab], before any processing
        if sample:
            logits = logits / self.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, new[..., None]).squeeze(-1)
        result = []
        for i in range(len(contexts)):
            row = new[i].numpy()
            n, finished = codec.end(row)
            result.append(Generation(row[:n].astype(np.int64), logp[i, :n].numpy().astype(np.float32), finished))
        return result
