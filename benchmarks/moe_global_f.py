"""Which f `moe.balance: global-batch` should train with outside RL (docs/moe.md, "Which f"): the three ways to get
the step's expert frequencies f before a micro-batch's backward, measured on the MoE demo's SFT run.

    python -m veomni_lite.torchrun --standalone --nproc_per_node 2 benchmarks/moe_global_f.py SOURCE \
        configs/moe_domains.yaml --moe.balance global-batch --train.output_dir outputs/gf_SOURCE [--section.key V ...]
    python benchmarks/moe_global_f.py summary outputs/gf_previous outputs/gf_prepass outputs/gf_buffer

SOURCE:
- `previous`: the trainer as it is (`RouterLosses.step_slots`): the previous optimizer step's global f, its counts in
  this step's one loss all-reduce; step 1 uniform.
- `prepass`: a routing pre-pass: before the step's first forward, a no-grad forward of every micro-batch of the step
  (the trainer's own `forward`, router logits captured) gives this step's local counts, which replace the previous
  step's in the same all-reduce slots: this step's own f, for one more forward per micro-batch.
- `buffer`: Qwen's buffer (Qiu et al. 2025): micro-batch j trains with the f of micro-batches 1..j of the step summed
  over the ranks, one all-reduce of E + 1 int64 per micro-batch (after its forward, before its backward).

Per step, rank 0 appends to OUTPUT_DIR/global_f.jsonl: {step, tv, step_time_s}: `tv` the total-variation distance
between the f a token's loss used and the step's true f (the step's training forwards' counts summed over the ranks:
one extra all-reduce after the step, outside the timed step), as distributions (f / k), averaged over the step's
routed tokens; `step_time_s` rank 0's wall time of the step (`train_step`, the pre-pass included).
`summary` prints, per run: the median step time and the mean and max tv over steps 2..N, tv's mean over the last two
thirds, and the last logged `train/foundation_loss`, `train/router_aux_loss` and `moe/load_imbalance`; given several
runs, also the median step time pooled over them.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

SOURCES = ("previous", "prepass", "buffer")


def trainer_class(source: str) -> type:
    """The SFT trainer with the global-batch f of `source` and the per-step measurement."""
    from veomni_lite.distributed.collectives import all_reduce
    from veomni_lite.models.moe import RouterLosses, _weights, router_outputs, routing_sums
    from veomni_lite.trainer.sft import SFTTrainer

    def local_counts(router: RouterLosses, record: Any, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        weights = _weights(micro_batch).to(record.logits[0].device)
        loads = routing_sums([x.detach() for x in record.logits], router.top_k, weights)[2]
        return torch.cat([loads.sum(0).double(), (weights.sum() * len(record.logits)).double().reshape(1)])

    class Measured(SFTTrainer):
        def _loss_step(self, micro_batches: list[dict[str, torch.Tensor]], train: bool) -> Any:
            router = self.router
            if train and source == "prepass":
                counts = torch.zeros(router.experts + 1, dtype=torch.float64)
                with torch.no_grad(), router_outputs(self.model) as record:
                    for micro_batch in micro_batches:
                        self.forward(micro_batch)
                        counts += local_counts(router, record, micro_batch).cpu()
                router._step_counts = counts.round().long()  # this step's, in place of the previous step's
            step = super()._loss_step(micro_batches, train)
            if train:
                self._used: list[tuple[torch.Tensor, float]] = []  # (f, tokens) per micro-batch
                self._buffer = torch.zeros(router.experts + 1, dtype=torch.float64, device=self.device)
            return step

        def _routed(self, micro_batch: dict[str, torch.Tensor], forward: Any) -> Mapping[str, Any]:
            router = self.router
            if not torch.is_grad_enabled():
                return super()._routed(micro_batch, forward)
            with router_outputs(self.model) as record:
                outputs = forward(micro_batch)
            counts = local_counts(router, record, micro_batch).to(self.device)
            if source == "buffer":  # the micro-batches run so far on every rank
                self._buffer += all_reduce(counts, op="sum", group=self.parallel.world_group)
                router.set_global_counts(self._buffer)
            self._used.append((router.global_f.detach().cpu().clone(), float(counts[-1])))
            return {**outputs, **router.heads(record, micro_batch)}

        def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
            start = time.perf_counter()
            super().train_step(micro_batches)
            step_time = time.perf_counter() - start
            router = self.router
            counts = router._step_counts.double().to(self.device)  # the step's own: read, left for the next step
            totals = all_reduce(counts, op="sum", group=self.parallel.world_group).cpu()
            true_f = totals[:-1] / totals[-1]
            tokens = sum(t for _, t in self._used)
            tv = sum(t * 0.5 * float((f - true_f).abs().sum()) / router.top_k for f, t in self._used) / tokens
            if self.is_main:
                with open(self.output_dir / "global_f.jsonl", "a") as f:
                    f.write(json.dumps({"step": self.step, "tv": tv, "step_time_s": step_time}) + "\n")

    return Measured


def summary(runs: list[str]) -> None:
    """Per run: the median step time and tv over steps 2..N (step 1 is a warm-up whose `previous` f is uniform), tv's
    mean over the last two thirds of the run, and the last logged metrics."""
    for run in runs:
        rows = _rows(run)
        metrics = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        later = [r for r in rows if r["step"] > 1]
        tvs = [r["tv"] for r in later]
        late = [r["tv"] for r in rows if r["step"] > len(rows) // 3]
        last = {k: v for m in metrics for k, v in m.items()}
        print(
            f"{run}: steps {len(rows)}, median step_time_s {statistics.median(r['step_time_s'] for r in later):.3f}, "
            f"tv (steps 2..N) mean {statistics.mean(tvs):.4f} max {max(tvs):.4f}, "
            f"tv (last two thirds) mean {statistics.mean(late):.4f}, "
            f"last foundation_loss {last.get('train/foundation_loss'):.4f}, "
            f"router_aux_loss {last.get('train/router_aux_loss'):.5f}, "
            f"load_imbalance {last.get('moe/load_imbalance'):.3f}"
        )
    if len(runs) > 1:
        pooled = [r["step_time_s"] for run in runs for r in _rows(run) if r["step"] > 1]
        print(f"pooled over these runs: median step_time_s {statistics.median(pooled):.3f}")


def _rows(run: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run) / "global_f.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "summary":
        summary(sys.argv[2:])
        sys.exit(0)
    if len(sys.argv) < 3 or sys.argv[1] not in SOURCES:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(SOURCES)}}} CONFIG.yaml [--section.key VALUE ...] | summary RUN...")
    from veomni_lite.trainer.launch import main
    from veomni_lite.trainer.sft import SFT_DEFAULTS

    cls = trainer_class(sys.argv[1])
    sys.exit(main({"auto": cls, "*": cls}, sys.argv[2:], defaults=SFT_DEFAULTS))
