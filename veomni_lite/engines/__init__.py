"""Rollout engines (docs/rl.md, docs/vllm.md): `base` (the interface: `RolloutEngine`, `RolloutRequest`,
`SamplingSettings`, `Rollout`), `embedded` (`TransformersEngine`: transformers' `generate` on each rank), `vllm` (a
vLLM server: launched or reached by URL, weight sync and its check), `weights` (the policy's whole weights for an
engine).
"""
