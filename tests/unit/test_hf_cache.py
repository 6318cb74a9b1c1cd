"""The KV cache goes into and out of a transformers forward under the name the installed version uses (5.24 renamed
past_key_values to cache): the decoded step extends the prefix's cache, nothing warns, and peft is looked through."""

from __future__ import annotations

import warnings

import torch

from rlfabric.services.core.models.hf_cache import cache_arg, cache_of


def test_a_decoded_token_extends_the_prefix_cache_without_a_deprecation_warning():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(0, 32, (2, 5))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        cache = cache_of(model(input_ids=ids[:, :4], use_cache=True))
        assert cache is not None and cache.get_seq_length() == 4
        step = model(input_ids=ids[:, 4:], use_cache=True, **{cache_arg(model): cache}).logits[:, -1]
        full = model(input_ids=ids).logits[:, -1]
    assert cache.get_seq_length() == 5
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)  # the cache was read, not dropped
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_arg(wrapped) == cache_arg(model)
