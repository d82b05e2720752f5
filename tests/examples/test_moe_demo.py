"""The MoE demo's analysis (`examples.moe_demo`): the specialization and imbalance numbers docs/moe.md quotes, and the
expert shares counted from transformers' own router logits."""

import torch

from examples.moe_demo import expert_shares, summarize


def test_summary_of_identical_disjoint_and_skewed_distributions() -> None:
    even = torch.full((2, 4), 0.25, dtype=torch.float64)
    assert summarize({"help": even, "math": even}) == {"specialization": 0.0, "imbalance": 1.0}
    first, last = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)
    first[:, :2], last[:, 2:] = 0.5, 0.5
    disjoint = summarize({"help": first, "math": last})
    assert disjoint == {"specialization": 1.0, "imbalance": 1.0}  # each domain on its own experts, the sum balanced
    one = torch.zeros(2, 4, dtype=torch.float64)
    one[:, 0] = 1.0
    assert summarize({"help": one, "math": one})["imbalance"] == 4.0  # every slot on one expert: 4x the mean


def test_expert_shares_count_each_tokens_top_k_per_layer() -> None:
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from examples.pydoc_text import train_bpe
    from examples.rl_math import TEMPLATE

    texts = ["user", "assistant", "two plus two is four", "help me"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(texts, 300, ("<|endoftext|>", "<|im_start|>", "<|im_end|>")),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE,
    )  # fmt: skip
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    rows = [{"messages": [{"role": "user", "content": t}]} for t in ("two plus two is four", "help me")]
    shares = expert_shares(model, tokenizer, rows)
    counts = torch.zeros(2, 4, dtype=torch.float64)
    for row in rows:  # by hand: every token's two largest router logits per layer
        ids = torch.tensor([tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)])
        for layer, logits in enumerate(model(input_ids=ids, output_router_logits=True).router_logits):
            for token in logits:
                for expert in sorted(range(4), key=lambda e: -float(token[e]))[:2]:
                    counts[layer, expert] += 1
    torch.testing.assert_close(shares, counts / counts.sum(dim=-1, keepdim=True), rtol=0, atol=1e-12)
