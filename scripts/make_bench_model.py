"""Builds a Qwen3-30B-A3B-shaped test model with few layers and random weights
(for `epserve bench serve` tables; not committed: ~1.2 GB per layer in bf16).

Usage: python scripts/make_bench_model.py OUT_DIR [--layers 2]
Shapes of Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, expert width 768,
32 query heads, 4 KV heads, head_dim 128. The vocabulary and tokenizer are the
bundled tiny fixture's (384 tokens), so prompts stay cheap to embed.
"""

import argparse
import shutil
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3_moe_a" / "bf16"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=384, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=381, pad_token_id=381,
    )
    with torch.device("cpu"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    out = Path(a.out)
    model.save_pretrained(out)
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:
        if (FIXTURE / f).exists():
            shutil.copy(FIXTURE / f, out / f)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
