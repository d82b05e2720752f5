"""Tiny models: a Llama-style causal LM and a VLM built on it (see each module's contract)."""

from veomni_lite.models.attention import AttentionFn, causal_attention
from veomni_lite.models.llm import TinyCausalLM, TinyLMConfig, set_attention_fn
from veomni_lite.models.vlm import TinyVLM, TinyVLMConfig

__all__ = [
    "AttentionFn",
    "TinyCausalLM",
    "TinyLMConfig",
    "TinyVLM",
    "TinyVLMConfig",
    "causal_attention",
    "set_attention_fn",
]
