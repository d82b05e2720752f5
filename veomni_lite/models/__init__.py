"""transformers architectures behind the trainer's model contract (`veomni_lite.models.contract.TrainableModel`).

- `contract`: the model contract (`TrainableModel`, `HostInput`, `on_host`) every model keeps.
- `registry`: the model families, the one place an architecture is named.
- `heads`: the loss heads' local mean (exact 0 without targets) and the FLOPs estimate every model shares.
- `hf_attention`: Ulysses attention registered in transformers' `AttentionInterface` (no model code edited).
- `hf_causal_lm`: a causal LM (Qwen2 / Llama family) built from a config dict or a local `from_pretrained` directory.
- `qwen2_vl`: Qwen2-VL with a second head (image codes) on the backbone's hidden states, shard-able under SP.

transformers is imported when a model is built, not when this package is imported.
"""
