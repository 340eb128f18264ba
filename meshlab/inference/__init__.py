"""Inference on the plans training uses: a paged KV cache and continuous batching.

``InferenceEngine(model, tokenizer, InferenceConfig(...)).generate(prompts=[...])`` serves a
transformers causal LM, on one process or parallelized by meshlab (``shard`` for tensor
parallelism, ``zero_shard``, ``lora``). Its attention is routed to ``meshlab::paged_attention``
over a cache of ``block_size``-token blocks; requests of any length join and leave the
running batch as they come and finish (``add_request`` / ``step``). Decoding is greedy,
sampled, speculative with a draft model, or a beam search (``beam_width``) that gives
transformers' ``generate(num_beams=...)`` tokens. ``model.generate()``
(transformers' own) works too on a model parallelized with ``shard``: the vocabulary-split
head gathers the whole logits inside it.

>>> import torch, transformers
>>> from meshlab.inference import InferenceConfig, InferenceEngine
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.LlamaForCausalLM(cfg)
>>> engine = InferenceEngine(model, inference_config=InferenceConfig(
...     dtype=torch.float32, max_batch_size=2, max_input_len=16, max_output_len=8,
...     block_size=4, ignore_eos=True))
>>> [len(o) for o in engine.generate(prompts=[[1, 5, 9], [2, 7], [3, 4, 5, 6, 8]],
...                                   max_new_tokens=5)]
[5, 5, 5]
"""

from ._config import InferenceConfig as InferenceConfig
from ._engine import InferenceEngine as InferenceEngine, Request as Request
from ._paged import NAME as ATTENTION_NAME

__all__ = ["InferenceConfig", "InferenceEngine", "Request", "ATTENTION_NAME"]
