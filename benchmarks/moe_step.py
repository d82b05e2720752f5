"""One process of our SFT trainer's MoE step against transformers' own model on the same tokens (the `moe` block of
`make bench`, and `make bench-gpu` at real widths).

Ours: `SFTTrainer.train_step` on a Qwen3-MoE directory (the `HFCausalLM` wrapper, the fused LM head and
cross-entropy, the router losses as heads of the loss core (`moe.balance` micro-batch), the global grad-norm clip,
AdamW). Theirs: the same directory loaded by `AutoModelForCausalLM` (its default experts implementation,
`grouped_mm`), `model(input_ids, position_ids, labels, output_router_logits=True)`, whose loss is its cross-entropy
plus `router_aux_loss_coef` x its `load_balancing_loss_func`, backward, `clip_grad_norm_` and AdamW: what a
transformers training loop runs. Both take the micro-batches our loader builds (one packed row of `tokens` tokens a
step, samples of `length` tokens, positions restarting per sample, which transformers' own masking reads as packed
sequences), `theirs` its labels unshifted. Equal work: both sides' first-step losses from equal weights
(`loss_rel_diff`). Timed steps alternate between the sides (order rotated each repetition) after warm-up steps;
`sequential` (a GPU at real widths, where both models and their AdamW states would not fit at once) times one side
after the other instead, each freed before the next is built. `--profile N`: then N steps a side under torch's
profiler, the ops of most self CPU time printed (where a slower side spends it, on the whole step). On a GPU our
trainer runs under torchrun (one rank: FSDP2's bf16 compute); in one plain process it has no FSDP2 and computes in
float32.

    [python -m veomni_lite.torchrun --standalone --nproc_per_node 1] benchmarks/moe_step.py --shape quick
        --work-dir DIR --out FILE [--steps N] [--warmup N] [--sequential] [--ours-only] [--profile N]
        [our trainer's config overrides: --optim.implementation ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMALL = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 0, "model_type": "qwen3_moe"}
MOE = {"model_type": "qwen3_moe", "norm_topk_prob": True, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False}
# Each: the transformers config's fields (`vocab_size` 0: the tokenizer's), `tokens` per step in one packed row of
# `length`-token samples.
SHAPES: dict[str, dict[str, Any]] = {
    "quick": {**MOE, **SMALL, "hidden_size": 128, "intermediate_size": 512, "moe_intermediate_size": 128,
              "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 2, "tokens": 512, "length": 128},
    "full": {**MOE, **SMALL, "hidden_size": 256, "intermediate_size": 1024, "moe_intermediate_size": 256,
             "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 2, "tokens": 2048, "length": 256},
    # Qwen3-30B-A3B's config.json, 2 of its 48 layers
    "qwen3_30b_a3b": {**MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 2,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151_936,
                      "router_aux_loss_coef": 0.001, "rope_theta": 1_000_000.0, "tokens": 4096, "length": 1024},
    # Qwen3-1.7B's config.json (dense, tied embeddings), every layer
    "qwen3_1_7b": {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
                   "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "tokens": 4096, "length": 1024},
    # the CPU dry run of `make bench-gpu`: the same code on tiny models
    "dry_run": {**MOE, **SMALL, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "tokens": 256, "length": 64},
    "dry_run_dense": {**SMALL, "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "tie_word_embeddings": True, "tokens": 256, "length": 64},
}  # fmt: skip
SIZE_KEYS = ("tokens", "length")


def write_inputs(work_dir: Path, name: str, shape: dict[str, Any], dtype: str = "float32") -> tuple[Path, Path]:
    """(model directory, data file) under `work_dir` (kept where they exist): a randomly initialized model of `shape`
    with the arithmetic demo's tokenizer, saved in `dtype` (built on the GPU where there is one: a real-width model
    initializes in seconds there); `text` rows longer than `shape["length"]` tokens (cut there), 256 of them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from examples.rl_math import MODEL, write_demo

    data = write_demo(work_dir / "data", sft_rows=64, rl_rows=16, eval_rows=16)
    tokenizer = AutoTokenizer.from_pretrained(str(data / MODEL))
    directory = work_dir / f"model_{name}"
    if not (directory / "config.json").is_file():
        fields = {k: v for k, v in shape.items() if k not in SIZE_KEYS}
        fields["vocab_size"] = fields["vocab_size"] or len(tokenizer)
        fields |= {"max_position_embeddings": max(4096, shape["length"]), "eos_token_id": tokenizer.eos_token_id}
        config = AutoConfig.for_model(fields.pop("model_type"), pad_token_id=0, **fields)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
        model.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
        del model
    rows = data / f"text_{shape['length']}.jsonl"
    if not rows.is_file():
        rng = random.Random(0)
        words = [json.loads(line)["messages"][-1]["content"] for line in (data / "train.jsonl").read_text().split("\n")
                 if line]  # fmt: skip
        per_row = shape["length"] // 2  # each answer is several tokens: a row is longer than `length`
        texts = [" ".join(rng.choice(words) for _ in range(per_row)) for _ in range(256)]
        rows.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return directory, rows


def our_trainer(work_dir: Path, model_dir: Path, rows: Path, shape: dict[str, Any], extra: list[str]) -> Any:
    """Our `SFTTrainer` on `model_dir` (one process), one packed row of `shape["tokens"]` tokens a step."""
    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFTTrainer

    args = [
        "--model.arch", "auto", "--model.pretrained_dir", str(model_dir), "--data.format", "text",
        "--data.train_path", str(rows), "--data.max_seq_len", str(shape["length"]), "--data.packing", "true",
        "--data.shared_prefix", "false", "--data.max_tokens_per_micro_batch", str(shape["tokens"]),
        "--train.global_batch_size", str(shape["tokens"] // shape["length"]), "--train.max_steps", "1000",
        "--train.eval_interval", "0", "--train.output_dir", str(work_dir / f"run_{model_dir.name}"),
        "--checkpoint.save_interval", "0", "--logging.log_interval", "1000", "--logging.progress_bar", "false",
        "--logging.tensorboard", "false", "--logging.plot", "false", "--optim.warmup_steps", "0",
        "--moe.balance", "micro-batch", *extra,
    ]  # fmt: skip
    return SFTTrainer(load_config(None, args, world_size=1))


class Ours:
    """Our trainer's whole step on given micro-batches; `loss()` the loss its last step logged."""

    def __init__(self, work_dir: Path, model_dir: Path, rows: Path, shape: dict[str, Any], extra: list[str]) -> None:
        self.trainer = our_trainer(work_dir, model_dir, rows, shape, extra)

    def batches(self, steps: int) -> list[list[dict[str, Any]]]:
        """`steps` steps of this trainer's loader's micro-batches (sharded as the trainer's loop does)."""
        return [[self.trainer.shard(mb) for mb in self.trainer.loader.next_step()] for _ in range(steps)]

    def step(self, micro_batches: list[dict[str, Any]]) -> None:
        self.trainer.train_step(micro_batches)

    def loss(self) -> float:
        self.trainer.metrics.end_step(self.trainer.step, 0, force=True)
        self.trainer.metrics.wait_bookkeeping()
        return float(self.trainer.metrics.last_logged["train/loss"])

    def close(self) -> None:
        self.trainer.metrics.finish(self.trainer.step, 0)
        self.trainer.close()


class Theirs:
    """transformers' own model and loss (bf16 autocast over float32 weights on CUDA, as its Trainer's `bf16`),
    `clip_grad_norm_` and our AdamW (`build_optimizer`: the same groups, rate and kernels)."""

    def __init__(self, model_dir: Path, device: Any, bf16: bool, optim: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from veomni_lite.trainer.base import build_optimizer

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
        self.model.train()
        self.device, self.bf16, self.max_norm = device, bf16, optim.max_grad_norm
        self.optimizer = build_optimizer(self.model, optim)
        self.last_loss = torch.zeros(())

    def step(self, micro_batches: list[dict[str, Any]]) -> None:
        import contextlib

        import torch

        losses = []
        for mb in micro_batches:
            labels = mb["labels"].to(self.device)  # ours, shifted once: transformers' `shift_labels`
            autocast = torch.autocast("cuda", torch.bfloat16) if self.bf16 else contextlib.nullcontext()
            with autocast:
                out = self.model(
                    input_ids=mb["input_ids"].to(self.device), position_ids=mb["position_ids"].to(self.device),
                    labels=labels, shift_labels=labels, output_router_logits=True, use_cache=False,
                )  # fmt: skip
            (out.loss / len(micro_batches)).backward()
            losses.append(out.loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = torch.stack(losses).mean()

    def loss(self) -> float:
        return float(self.last_loss)

    def close(self) -> None:
        del self.model, self.optimizer


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def profile_sides(sides: dict[str, Any], batches: list[list], steps: int, rows: int = 15) -> dict[str, list]:
    """Per side, `steps` more steps under torch's profiler: its `rows` ops of most self CPU time, [name, self CPU ms
    per step, calls per step], and the whole step's self CPU ms per step."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, side in sides.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for index in range(steps):
                side.step(batches[index % len(batches)])
        ops = sorted(prof.key_averages(), key=lambda op: op.self_cpu_time_total, reverse=True)
        total = sum(op.self_cpu_time_total for op in ops) / 1e3 / steps
        out[name] = [["step", total, 1]] + [
            [op.key, op.self_cpu_time_total / 1e3 / steps, op.count / steps] for op in ops[:rows]
        ]
    return out


def measure(
    work_dir: Path,
    shape_name: str,
    steps: int,
    warmup: int,
    sequential: bool,
    extra: list[str],
    theirs: bool = True,
    profile_steps: int = 0,
) -> dict:
    """Our step, and transformers' where `theirs`, on the same micro-batches (see the module doc): {"seconds":
    {side: [per timed step]}, "cpu_seconds" (this process's CPU time, steadier on a shared machine), "step_tokens",
    "flops_per_token" (ours: active parameters), "peak_flops" (None off a known GPU), "first_loss": {side: loss},
    "loss_rel_diff", the shape}."""
    import torch

    from veomni_lite.metrics.logger import peak_flops

    shape = SHAPES[shape_name]
    on_gpu = torch.cuda.is_available()
    model_dir, rows = write_inputs(work_dir, shape_name, shape, "bfloat16" if on_gpu else "float32")
    sides: dict[str, Any] = {"ours": Ours(work_dir, model_dir, rows, shape, extra)}
    trainer = sides["ours"].trainer
    device, optim, bf16 = trainer.device, trainer.config.optim, trainer.device.type == "cuda"
    batches = sides["ours"].batches(warmup + steps)
    flops = trainer.flops_per_token(shape["length"])
    del trainer  # sequential: nothing but `sides` may keep our model alive once it is closed
    build = lambda: Theirs(model_dir, device, bf16, optim)  # noqa: E731
    names = ("ours", "theirs") if theirs else ("ours",)
    if theirs and not sequential:
        sides["theirs"] = build()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in names}
    first_loss: dict[str, float] = {}
    order = [(i, name) for i in range(warmup + steps) for name in (names[i % 2 :] + names[: i % 2])]  # rotated
    if sequential:
        order.sort(key=lambda item: item[1] == "theirs")  # every step of ours, then every step of theirs
    for index, name in order:
        if name not in sides:  # sequential: ours is done; free it before transformers' model is built
            sides.pop("ours").close()
            gc.collect()
            torch.cuda.empty_cache() if on_gpu else None
            sides["theirs"] = build()
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        sides[name].step(batches[index])
        _sync(device)
        if index >= warmup:
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - cpu_start)
        if index == 0:
            first_loss[name] = sides[name].loss()
    peak_memory = torch.cuda.max_memory_allocated() if on_gpu else None
    profiled = profile_sides(sides, batches, profile_steps) if profile_steps and not sequential else None
    for side in sides.values():
        side.close()
    step_tokens = [sum(int(mb["input_ids"].numel()) for mb in step) for step in batches[warmup:]]
    differ = abs(first_loss["ours"] - first_loss["theirs"]) / abs(first_loss["theirs"]) if theirs else None
    return {
        "shape": shape_name, **shape, "device": str(device), "device_name": torch.cuda.get_device_name() if on_gpu
        else "cpu", "bf16": bf16, "warmup": warmup, "sequential": sequential, "seconds": seconds,
        "cpu_seconds": cpu_seconds, "step_tokens": step_tokens, "flops_per_token": flops,
        "peak_flops": peak_flops(device), "peak_memory_bytes": peak_memory, "first_loss": first_loss,
        "loss_rel_diff": differ, "profile": profiled,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="quick")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sequential", action="store_true", help="one side after the other (see the module doc)")
    parser.add_argument("--ours-only", action="store_true", help="our step alone (the dense MFU step)")
    parser.add_argument("--profile", type=int, default=0, help="then this many steps a side under torch's profiler")
    args, extra = parser.parse_known_args()  # the rest: our trainer's config overrides (`--optim.implementation ...`)
    result = measure(
        args.work_dir, args.shape, args.steps, args.warmup, args.sequential, extra, not args.ours_only, args.profile
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result))
    for what in ("seconds", "cpu_seconds"):
        medians = {side: statistics.median(values) for side, values in result[what].items()}
        print(f"{what}: " + ", ".join(f"{side} {value:.4f}" for side, value in medians.items()))
    for side, ops in (result["profile"] or {}).items():
        print(f"{side}, self CPU ms and calls a step:")
        print("\n".join(f"  {ms:9.2f} {calls:6.0f}  {name}" for name, ms, calls in ops))


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    main()
