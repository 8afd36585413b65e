#!/usr/bin/env python3
"""Writes a small ShareGPT-format sample file, deterministically (no download).

vLLM's ShareGPT format, as `epserve bench serve --dataset-name sharegpt
--dataset-path FILE` (and `vllm bench serve`) read it: a JSON list of
{"id": ..., "conversations": [{"from": "human" | "gpt", "value": ...}, ...]}.
Prompts and replies are made of English words with lengths spread like a chat
benchmark's (prompt ~8-400 words, reply ~8-500 words by default), some with
a system turn first or a second exchange after, so the reader's choice of the
first human turn and the gpt reply after it is exercised.

    scripts/make_sharegpt_sample.py OUT.json [--num 32] [--seed 0] [--max-words 400]

The same arguments always write the same bytes (its own xorshift generator,
not Python's `random`, whose algorithms may change between versions).
tests/fixtures/sharegpt_sample.json is `--num 32 --max-words 120`.
"""

import argparse
import json

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "up out about into than them can only other new some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came "
    "right used take three expert router token cache prefix block layer model server request stream "
    "latency throughput memory kernel batch decode prefill attention worker coordinator cluster"
).split()

QUESTIONS = [
    "Explain how {a} relates to {b} in a few sentences.",
    "Write a short story about {a} and {b}.",
    "What is the difference between {a} and {b}?",
    "Summarize the following text: {text}",
    "Translate this into plain language: {text}",
    "List three facts about {a}.",
]


class XorShift:
    def __init__(self, seed):
        self.s = (seed * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF or 1

    def next(self):
        s = self.s
        s ^= (s << 13) & 0xFFFFFFFFFFFFFFFF
        s ^= s >> 7
        s ^= (s << 17) & 0xFFFFFFFFFFFFFFFF
        self.s = s
        return s

    def below(self, n):
        return self.next() % n


def words(rng, lo, hi):
    n = lo + rng.below(max(1, hi - lo + 1))
    out = [WORDS[rng.below(len(WORDS))] for _ in range(n)]
    text = " ".join(out)
    return text[0].upper() + text[1:] + "."


def conversation(rng, i, max_words):
    a, b = WORDS[rng.below(len(WORDS))], WORDS[rng.below(len(WORDS))]
    q = QUESTIONS[rng.below(len(QUESTIONS))].format(a=a, b=b, text=words(rng, 4, max_words))
    turns = []
    if rng.below(4) == 0:
        turns.append({"from": "system", "value": "You are a helpful assistant."})
    turns.append({"from": "human", "value": q})
    turns.append({"from": "gpt", "value": words(rng, 8, max_words + max_words // 4)})
    if rng.below(3) == 0:
        turns.append({"from": "human", "value": "And " + words(rng, 3, 20)})
        turns.append({"from": "gpt", "value": words(rng, 8, 60)})
    return {"id": f"sample-{i}", "conversations": turns}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-words", type=int, default=400)
    args = ap.parse_args()
    if args.num < 1 or args.max_words < 8:
        ap.error("--num must be >= 1 and --max-words >= 8")
    rng = XorShift(args.seed)
    data = [conversation(rng, i, args.max_words) for i in range(args.num)]
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
