"""Inference backends. ``torch`` serves MLP actor-critics; LLM backends (hf, vllm, sglang) join by config."""
