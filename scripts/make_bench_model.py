"""Builds a Qwen3-30B-A3B-shaped test model with few layers and random weights
(for `epserve bench serve` tables and scripts/bench-peer.sh; not committed:
~1.2 GB per layer in bf16).

Usage: python scripts/make_bench_model.py OUT_DIR [--layers 2] [--vocab 384]
Shapes of Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, expert width 768,
32 query heads, 4 KV heads, head_dim 128. With the default --vocab 384 the
vocabulary and tokenizer are the bundled tiny fixture's, so prompts stay cheap
to embed. Any other --vocab N trains a byte-level BPE of N tokens (the last
three: <|endoftext|>, <|im_start|>, <|im_end|>, as in the fixture) with the
Qwen2 pre-tokenizer regex on the Python standard library's top-level .py files
(sorted; the same interpreter gives the same tokenizer), so llama.cpp's GGUF
converter reads it as a `qwen2` vocabulary.
"""

import argparse
import json
import shutil
import sysconfig
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3_moe_a" / "bf16"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2-*, Qwen3-*).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(vocab: int, out: Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json with `vocab` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab < 256 + len(SPECIALS) + 1:
        raise SystemExit(f"--vocab {vocab}: a byte-level BPE needs at least 260 tokens")
    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise SystemExit("no Python standard library sources to train the tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    base = tok.get_vocab_size()
    if base != vocab - len(SPECIALS):
        raise SystemExit(f"the training text gave only {base} tokens, not {vocab - len(SPECIALS)}")
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "tokenizer_class": "TokenizersBackend",
    }, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=384,
                    help="vocabulary size: 384 = the fixture's tokenizer, else a trained byte-level BPE")
    a = ap.parse_args()
    eot, im_end = a.vocab - 3, a.vocab - 1  # <|endoftext|>, <|im_end|>
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        # Qwen3-30B-A3B's context (RoPE has no weights: the same seed gives the
        # same weights at any value).
        max_position_embeddings=40960,
        tie_word_embeddings=False, eos_token_id=eot, pad_token_id=eot,
    )
    # Built in bf16 directly (an f32 model first would need twice the memory:
    # ~10 GB at 4 layers); the weights are drawn after a fresh seed.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cpu"):
            model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    out = Path(a.out)
    model.save_pretrained(out)
    if a.vocab == 384:
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:
            if (FIXTURE / f).exists():
                shutil.copy(FIXTURE / f, out / f)
    else:
        train_tokenizer(a.vocab, out)
        shutil.copy(FIXTURE / "chat_template.jinja", out / "chat_template.jinja")
        (out / "generation_config.json").write_text(json.dumps({
            "do_sample": False, "eos_token_id": [im_end, eot], "pad_token_id": eot,
        }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
