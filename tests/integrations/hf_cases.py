"""The models and datasets the Hugging Face Trainer tests train, built from configs (nothing downloaded), a user's
`compute_loss_func`, and the hand-written one-process reference of a step's exact loss.

Cases (`kind`): `vl` Qwen2-VL, `vl25` Qwen2.5-VL (opts out of loss kwargs), `text` a Qwen2 LM with a tagging head,
`moe` a Mixtral with its router loss, `func` Qwen2.5-VL trained through `z_loss_func`, `dft` TRL's SFTTrainer with
`loss_type="dft"` on Qwen2.5-VL, `pf` TRL's SFTTrainer on the Mixtral with its padding-free collator."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, IMAGE_TOKEN, VISION_START, VISION_END, PAD = 64, 60, 61, 62, 0
TAGS = 5  # classes of the second head of the causal LM
ROUTER_COEF, Z_COEF = 0.5, 0.1  # the Mixtral's router_aux_loss_coef; z_loss_func's weight of logsumexp^2
MODEL = {"func": "vl25", "dft": "vl25", "pf": "moe"}  # the cases that train another case's model
DATA = {"vl": "vl", "vl25": "vl", "text": "text", "moe": "lm"}  # each model's samples


def tiny_vlm(kind: str) -> nn.Module:
    """`vl`: Qwen2-VL; `vl25`: Qwen2.5-VL, which declares `accepts_loss_kwargs = False` (the stock Trainer then
    averages micro-batch means)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    text = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 256, "pad_token_id": PAD,
        "bos_token_id": 1, "eos_token_id": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
    }  # fmt: skip
    vision = {"depth": 1, "embed_dim": 16, "num_heads": 2, "mlp_ratio": 2, "in_channels": 3, "patch_size": 2}
    vision |= {"temporal_patch_size": 1, "spatial_merge_size": 2, "hidden_size": 32}
    if kind == "vl25":
        vision |= {"hidden_size": 16, "out_hidden_size": 32, "intermediate_size": 32, "fullatt_block_indexes": [0]}
        vision |= {"window_size": 8}
    config_class, model_class = {
        "vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "vl25": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    }[kind]
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(0)
    return model_class(config).double()


class TwoHeadLM(nn.Module):
    """A Qwen2 causal LM plus a per-token tagging head: `tag_loss` is its mean over the valid `tag_labels`; with
    `labels`, `loss` is the LM's own loss plus `tag_loss` (what a stock Trainer trains on)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD,
        )  # fmt: skip
        self.lm = Qwen2ForCausalLM(config).double()
        self.tag_head = nn.Linear(32, TAGS).double()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        tag_labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True)
        result = {"logits": out.logits}
        if tag_labels is not None:
            tags = self.tag_head(out.hidden_states[-1])
            result["tag_loss"] = F.cross_entropy(tags.flatten(0, 1), tag_labels.flatten(), ignore_index=-100)
            if labels is not None:
                result["loss"] = out.loss + result["tag_loss"]
        return result


def tokenizer() -> Any:
    """A word-level tokenizer over the test vocabulary (TRL's SFTTrainer wants a processing class)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0")


def tiny_moe() -> nn.Module:
    """A Mixtral (4 experts, top 2) that returns its router logits, so its forward adds the load-balancing loss
    times `router_aux_loss_coef`; eager experts (the grouped kernel has no float64)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        pad_token_id=PAD, output_router_logits=True, router_aux_loss_coef=ROUTER_COEF, experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return MixtralForCausalLM(config).double()


def build(kind: str) -> nn.Module:
    kind = MODEL.get(kind, kind)
    return TwoHeadLM() if kind == "text" else tiny_moe() if kind == "moe" else tiny_vlm(kind)


def z_loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor) -> torch.Tensor:
    """A user's `compute_loss_func`: next-token cross-entropy plus `Z_COEF` x logsumexp(logits)^2 per target,
    summed over the micro-batch's targets / `num_items_in_batch` (the stock Trainer's contract)."""
    logits, targets = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    valid = targets != -100
    per_token = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    per_token = per_token + Z_COEF * torch.logsumexp(logits, -1).square() * valid
    return per_token.sum() / num_items_in_batch


def samples(kind: str, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Samples of varied length (3 to 20 text tokens); `vl`: one 8x8 image (4 placeholders) in most, none in some;
    `text`: tag labels on about half the tokens."""
    kind = DATA[MODEL.get(kind, kind)]
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(3, 21, (), generator=g))
        ids = torch.randint(1, IMAGE_TOKEN, (n,), generator=g)
        sample: dict[str, torch.Tensor] = {}
        if kind == "vl" and i % 4 != 3:
            ids = torch.cat([torch.tensor([VISION_START] + [IMAGE_TOKEN] * 4 + [VISION_END]), ids])
            sample["pixel_values"] = torch.randn(16, 12, generator=g, dtype=torch.float64)
            sample["image_grid_thw"] = torch.tensor([[1, 4, 4]])
        labels = ids.clone()
        labels[ids >= IMAGE_TOKEN] = -100
        labels[: int(torch.randint(0, n // 2 + 1, (), generator=g))] = -100  # a prompt of varied length
        sample |= {"input_ids": ids, "labels": labels}
        if kind == "text":
            sample["tag_labels"] = torch.where(torch.rand(ids.shape, generator=g) < 0.5, ids % TAGS, -100)
        out.append(sample)
    return out


def collate(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-padded micro-batch in the Trainer's (unshifted `labels`) form, from tensors or a `datasets` row's lists
    (where a row without an image has None)."""
    rows = [{k: torch.as_tensor(v) for k, v in r.items() if v is not None} for r in rows]
    length = max(r["input_ids"].numel() for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), length), PAD),
        "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
        "labels": torch.full((len(rows), length), -100),
    }
    if "tag_labels" in rows[0]:
        batch["tag_labels"] = torch.full((len(rows), length), -100)
    for i, r in enumerate(rows):
        n = r["input_ids"].numel()
        batch["input_ids"][i, :n], batch["attention_mask"][i, :n], batch["labels"][i, :n] = (
            r["input_ids"],
            1,
            r["labels"],
        )
        if "tag_labels" in r:
            batch["tag_labels"][i, :n] = r["tag_labels"]
    images = [r for r in rows if "pixel_values" in r]
    if images:
        batch["mm_token_type_ids"] = (batch["input_ids"] == IMAGE_TOKEN).long()
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in images])
        batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in images])
    return batch


def reference_loss(
    model: nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    mode: str = "token-mean",
    *,
    per_token: str = "nll",
    router_coef: float = 0.0,
) -> torch.Tensor:
    """The step's exact loss in one process, by hand: the per-token loss of the next-token targets summed over every
    micro-batch of every rank / all its targets (`seq-mean-token-mean`: each sample's mean, averaged over the samples
    with a target); plus (two-head LM) the tag cross-entropy summed / all tag targets; plus `router_coef` x
    transformers' load-balancing loss of each micro-batch's forward, averaged over the micro-batches.

    `per_token`: `nll` cross-entropy; `dft` cross-entropy x the target's probability (held constant); `z` what
    `z_loss_func` adds up. A padding-free micro-batch (one row, `position_ids` restarting at each sample, no
    `attention_mask`) runs each sample on its own for the per-token loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    sums: dict[str, Any] = {"lm": 0.0, "tag": 0.0}
    counts = {"lm": 0, "tag": 0}
    router: list[torch.Tensor] = []

    def add(logits: torch.Tensor, labels: torch.Tensor) -> None:
        targets, logits = labels[:, 1:], logits[:, :-1]
        loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        if per_token == "dft":
            loss = loss * torch.exp(-loss).detach()
        elif per_token == "z":
            loss = loss + Z_COEF * torch.logsumexp(logits, -1).square() * (targets != -100)
        if mode == "seq-mean-token-mean":
            n = (targets != -100).sum(1)
            sums["lm"] = sums["lm"] + (loss.sum(1)[n > 0] / n[n > 0]).sum()
            counts["lm"] += int((n > 0).sum())
        else:
            sums["lm"] = sums["lm"] + loss.sum()
            counts["lm"] += int((targets != -100).sum())

    def add_router(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None) -> None:
        experts, top_k = model.config.num_local_experts, model.config.num_experts_per_tok
        router.append(load_balancing_loss_func(router_logits, experts, top_k, attention_mask))

    for batch in micro_batches:
        if isinstance(model, TwoHeadLM):
            hidden = model.lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            add(model.lm.lm_head(hidden.last_hidden_state), batch["labels"])
            tags = model.tag_head(hidden.last_hidden_state)
            sums["tag"] = sums["tag"] + F.cross_entropy(
                tags.flatten(0, 1), batch["tag_labels"].flatten(), ignore_index=-100, reduction="sum"
            )
            counts["tag"] += int((batch["tag_labels"] != -100).sum())
        elif "attention_mask" not in batch:  # padding-free: one packed row
            ids, positions = batch["input_ids"], batch["position_ids"]
            bounds = [*(positions[0] == 0).nonzero().flatten().tolist(), ids.shape[1]]
            for start, end in itertools.pairwise(bounds):
                add(model(input_ids=ids[:, start:end]).logits, batch["labels"][:, start:end])
            if router_coef:
                packed = model(input_ids=ids, position_ids=positions, output_router_logits=True, use_cache=False)
                add_router(packed.router_logits, None)  # without a cache transformers finds the packed samples
        else:
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "tag_labels")}
            outputs = model(**inputs, **({"output_router_logits": True} if router_coef else {}))
            add(outputs.logits, batch["labels"])
            if router_coef:
                add_router(outputs.router_logits, batch["attention_mask"])
    loss = sum(sums[k] / counts[k] for k in sums if counts[k])
    return loss + router_coef * sum(router) / len(router) if router else loss
