"""make bench: peak memory and tokens/s of a training step, the LM head fused with its cross-entropy
(`model.fused_lm_head`) against the plain head (whole logits), at Qwen's vocabulary and a tiny decoder (Qwen2, hidden
64, two layers, untied embeddings) so the head dominates.

Each (vocabulary, tokens, head) runs in a fresh process on one thread: AdamW's state is made by a 16-token step, then
the peak RSS is reset (`/proc/self/clear_refs`) and one step of one packed row (samples of 512 tokens) is timed and its
peak read (`VmHWM`; on the CPU activations are part of the resident set). Growth: the step's peak over the same head's
vocabulary-1,024 step, in units of one float32 [tokens, vocabulary] tensor (target <= 0.25 fused). Where the plain
head's logits alone would not fit in this machine's memory the row says so instead of swapping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VOCAB, BASE_VOCAB, SAMPLE = 151_936, 1_024, 512
TARGET_GROWTH, TARGET_SPEED = 0.25, 0.9  # fused growth / one [tokens, vocab] float32 tensor; fused / plain tokens/s


def one_step(vocab: int, tokens: int, fused: bool) -> dict[str, float]:
    """This process: build, warm up, time one step; its seconds and peak RSS in MiB."""
    import torch

    from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict

    torch.manual_seed(0)
    settings = {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 176}
    settings |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = HFCausalLM.from_config(hf_config_from_dict(settings | {"max_position_embeddings": SAMPLE}))
    model.fused_lm_head = fused
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(n: int) -> None:
        positions = torch.arange(n)
        batch = {"input_ids": torch.randint(0, vocab, (1, n)), "labels": torch.randint(0, vocab, (1, n))}
        batch |= {"position_ids": (positions % SAMPLE)[None], "attention_sequence_ids": (positions // SAMPLE)[None]}
        model(**batch)["foundation_loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(16)
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    step(tokens)
    seconds = time.perf_counter() - start
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))
    return {"seconds": seconds, "peak_rss_mib": peak}


def _run(vocab: int, tokens: int, fused: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", str(vocab), str(tokens), str(int(fused))]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode:
        raise RuntimeError(f"lm_head bench {vocab} x {tokens}, fused={fused}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _available_mib() -> float:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    return next(int(line.split()[1]) / 1024 for line in meminfo if line.startswith("MemAvailable:"))


def measure(token_sizes: tuple[int, ...] = (4096, 32768)) -> dict[str, Any]:
    """Per token size and head: the step's seconds, tokens/s, peak RSS at both vocabularies, growth."""
    rows = []
    for tokens in token_sizes:
        logits_mib = tokens * VOCAB * 4 / 2**20
        for fused in (True, False):
            row: dict[str, Any] = {"tokens": tokens, "fused": fused, "logits_mib": logits_mib}
            if not fused and 3 * logits_mib > _available_mib():  # the plain head holds about three of them
                row["skipped"] = f"needs about {3 * logits_mib / 1024:.0f} GiB, {_available_mib() / 1024:.0f} free"
                rows.append(row)
                continue
            base, big = _run(BASE_VOCAB, tokens, fused), _run(VOCAB, tokens, fused)
            growth = big["peak_rss_mib"] - base["peak_rss_mib"]
            row |= {"base_peak_mib": base["peak_rss_mib"], "peak_mib": big["peak_rss_mib"], "growth_mib": growth}
            row |= {"growth_per_logits": growth / logits_mib, "tokens_per_s": tokens / big["seconds"]}
            print(f"[bench] lm head: {tokens} tokens, fused={fused}: {row}", flush=True)
            rows.append(row)
    return {"vocab": VOCAB, "base_vocab": BASE_VOCAB, "rows": rows, "targets": [TARGET_GROWTH, TARGET_SPEED]}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        vocab, tokens, fused = (int(value) for value in sys.argv[2:5])
        print(json.dumps(one_step(vocab, tokens, bool(fused))))
    else:
        print(json.dumps(measure(), indent=1))
