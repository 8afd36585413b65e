#!/usr/bin/env python3
"""Train the bundled demo model (models/demo): a small Qwen3-MoE that writes readable English
about the Python language, with a byte-level BPE tokenizer and a ChatML chat template.

Run from the repository root (CPU only, ~23 min on 2 quiet cores; the pinned versions are
tests/fixtures/requirements.txt, on Python 3.11.7 whose pydoc_data/topics.py is the corpus):

    /work/venv/bin/python scripts/make_demo_model.py                 # train, save, golden
    /work/venv/bin/python scripts/make_demo_model.py --steps 30 --out /tmp/demo   # quick try
    /work/venv/bin/python scripts/make_demo_model.py --golden-only   # re-derive the golden

Corpus: the "topics" of the Python documentation that CPython ships in its standard library
(Lib/pydoc_data/topics.py, the text `help("assert")` prints), PSF licence. Prose paragraphs
only (code, grammar productions and tables are dropped), each turned into a ChatML turn:
user asks about the section's heading, assistant answers with the paragraph(s). Every 20th
answer is held out for the perplexity report. See models/demo/README.md.

Everything is seeded; with the same versions and the same thread count (2) a re-run gives the
same weights.
"""

import argparse
import collections
import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
import sys
import time
import zlib

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads sleep instead of spinning at barriers: on a shared, oversubscribed host the
# default spin-waiting burned ~10x the CPU time per step (measured: 3 vs 0.27 CPU-s per
# 1024-token step, 2 threads, load average 15 on 2 cores)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "models", "demo")
GOLDEN = os.path.join(ROOT, "tests", "fixtures", "demo_golden.json")

SEED = 1234
VOCAB = 2048  # BPE merges + 256 bytes; the 3 specials come after
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HOLD_EVERY = 20  # every 20th answer (in corpus order) is held out

MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,  # unused: every layer is MoE
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    hidden_act="silu",
    router_aux_loss_coef=0.01,
)

# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")


def corpus_source():
    import pydoc_data.topics as t

    return t.__file__, t.topics


def is_prose(lines):
    """A block of one indentation whose text reads like sentences."""
    ind = {len(l) - len(l.lstrip(" ")) for l in lines}
    if len(ind) != 1:
        return False
    text = " ".join(l.strip() for l in lines)
    words = text.split()
    if len(words) < 8 or text.startswith((">>>", "...", "|", "+-", "*")) or "::=" in text:
        return False
    if text[-1] not in ".:;)\"'”’":
        return False
    alpha = sum(c.isalpha() or c == " " for c in text) / len(text)
    return alpha > 0.8


def clean(text):
    text = re.sub(r"\s+", " ", text).strip()
    text = text.replace("‘", "'").replace("’", "'").replace("“", '"').replace("”", '"')
    return text[:-1] + "." if text.endswith(":") else text  # its code example is dropped


# Docstrings of these standard-library modules, their public functions and classes and the
# classes' methods (PSF licence, as the topics). Pure imports, no side effects.
MODULES = """abc argparse array ast asyncio base64 bisect builtins calendar cmath collections
collections.abc contextlib copy csv dataclasses datetime decimal difflib enum fnmatch fractions
functools gc getopt glob gzip hashlib heapq hmac html inspect io ipaddress itertools json logging
math mimetypes operator os os.path pathlib pickle pprint queue random re secrets shlex shutil
signal socket sqlite3 statistics string struct subprocess sys tempfile textwrap threading time
timeit tokenize traceback types typing unittest urllib.parse uuid warnings weakref zipfile
zlib""".split()


def docstrings():
    """[(qualified name, kind, [paragraph, ...])], prose only, first occurrence of each text."""
    import importlib
    import inspect

    out, seen = [], set()
    for mn in MODULES:
        mod = importlib.import_module(mn)
        objs = [(mn, "module", mod)]
        for name, o in sorted(vars(mod).items()):
            if name.startswith("_"):
                continue
            if not (inspect.isfunction(o) or inspect.isbuiltin(o) or inspect.isclass(o)):
                continue
            if getattr(o, "__module__", None) not in (mn, "_" + mn, mn.split(".")[0]):
                continue
            objs.append((f"{mn}.{name}", "class" if inspect.isclass(o) else "function", o))
            if inspect.isclass(o):
                for an, a in sorted(vars(o).items()):
                    if not an.startswith("_") and callable(a) and a.__doc__:
                        objs.append((f"{mn}.{name}.{an}", "method", a))
        for qn, kind, o in objs:
            d = inspect.getdoc(o)
            if not d:
                continue
            paras = [clean(" ".join(b.split("\n"))) for b in re.split(r"\n\s*\n", d) if is_prose(b.split("\n"))]
            text = " ".join(paras)
            if paras and text not in seen:
                seen.add(text)
                out.append((qn, kind, paras))
    return out


def doc_forms(qn, kind):
    if kind == "module":
        forms = ["What is the {} module?", "Tell me about the {} module.", "What does the {} module do?"]
    elif kind == "class":
        forms = ["What is {}?", "Tell me about {}.", "What is the {} class?"]
    else:
        forms = ["What does {}() do?", "What does {} do?", "Explain {}()."]
    return [f.format(qn) for f in forms]


def sections():
    """[(topic, heading, [paragraph, ...])] in a fixed order, prose only."""
    _, topics = corpus_source()
    out = []
    for key in sorted(topics):
        lines = topics[key].split("\n")
        heading, paras, block = None, [], []

        def flush_block():
            if block and is_prose(block):
                paras.append(clean(" ".join(block)))
            block.clear()

        i = 0
        while i < len(lines):
            line = lines[i]
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if line.strip() and UNDERLINE.match(nxt.strip()) and len(nxt.strip()) >= len(line.strip()) - 1:
                flush_block()
                if heading and paras:
                    out.append((key, heading, list(paras)))
                heading, paras = clean(line), []
                i += 2
                continue
            if line.strip():
                block.append(line)
            else:
                flush_block()
            i += 1
        flush_block()
        if heading and paras:
            out.append((key, heading, list(paras)))
    return out


def section_forms(heading, k):
    """Every phrasing of the question about a section's k-th part: each form, with the
    heading as written and without its quotes (`the "for" statement`, `the for statement`)."""
    h = heading.rstrip(".")
    h0 = h[0].lower() + h[1:] if len(h) > 1 and h[1].islower() else h
    if k == 0:
        forms = ["Tell me about {}.", "What is {}?", "Explain {}.", "What should I know about {}?"]
    else:
        forms = ["Tell me more about {}.", "What else is there about {}?", "Continue about {}."]
    subjects = [h0] + ([h0.replace('"', "")] if '"' in h0 else [])
    return [f.format(x) for x in subjects for f in forms]


def examples(max_chars=900, with_docstrings=False):
    """Chat examples [(question, answer, [every phrasing of the question], "topic" | "doc")]
    and which are held out. The question is one phrasing drawn with the seed (the held-out perplexity uses it);
    training draws a phrasing each time it uses an example."""
    rng = random.Random(SEED)
    ex = []

    def topic(heading, k, chunk):
        forms = section_forms(heading, k)  # the heading as written first: 4 forms (k = 0) or 3
        ex.append((rng.choice(forms[: 4 if k == 0 else 3]), " ".join(chunk), forms, "topic"))

    for _, heading, paras in sections():
        chunk, k = [], 0
        for p in paras:
            if chunk and len(" ".join(chunk)) + len(p) > max_chars:
                topic(heading, k, chunk)
                chunk, k = [], k + 1
            chunk.append(p)
        if chunk:
            topic(heading, k, chunk)
    for qn, kind, paras in docstrings() if with_docstrings else []:
        keep = paras[:1]
        for para in paras[1:]:  # whole paragraphs, up to max_chars
            if len(" ".join(keep)) + len(para) > max_chars:
                break
            keep.append(para)
        forms = doc_forms(qn, kind)
        ex.append((rng.choice(forms), " ".join(keep), forms, "doc"))
    train = [e for i, e in enumerate(ex) if i % HOLD_EVERY != HOLD_EVERY - 1]
    held = [e for i, e in enumerate(ex) if i % HOLD_EVERY == HOLD_EVERY - 1]
    return train, held


def chatml(q, a):
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", f"{a}<|im_end|>\n"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def build_tokenizer(train):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = []
    for q, a, forms, _ in train:
        texts += [f + "\n" for f in forms] + ["user\n", "assistant\n", a + "\n"]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def encode_examples(tok, exs):
    """[(prompt ids, answer ids)] where prompt = the ChatML user turn + assistant header."""
    out = []
    for q, a, *_ in exs:
        p, r = chatml(q, a)
        out.append((tok(p, add_special_tokens=False)["input_ids"], tok(r, add_special_tokens=False)["input_ids"]))
    return out


def encode_variants(tok, exs, topic_repeat=1):
    """[([prompt ids of each phrasing], answer ids)] for training; each topic example
    `topic_repeat` times (so a pass over the examples uses it that often)."""
    out = []
    for _, a, forms, kind in exs:
        prompts = [tok(chatml(f, a)[0], add_special_tokens=False)["input_ids"] for f in forms]
        r = tok(chatml(forms[0], a)[1], add_special_tokens=False)["input_ids"]
        out += [(prompts, r)] * (topic_repeat if kind == "topic" else 1)
    return out


# --------------------------------------------------------------------------------------------
# Baselines: unigram (add-one) and interpolated Kneser-Ney bigram, fitted on the training answers
# --------------------------------------------------------------------------------------------


def baselines(train_enc, held_enc, V):
    uni = collections.Counter()
    big = collections.Counter()
    for p, r in train_enc:
        seq = [p[-1]] + r  # the answer conditioned on the assistant header's last token
        uni.update(r)
        big.update(zip(seq[:-1], seq[1:]))
    N = sum(uni.values())
    ctx = collections.Counter()
    follow = collections.Counter()  # distinct continuations per context
    precede = collections.Counter()  # distinct contexts per word
    for (a, b), c in big.items():
        ctx[a] += c
        follow[a] += 1
        precede[b] += 1
    nbig = len(big)
    D = 0.75

    def p_uni(w):
        return (uni[w] + 1) / (N + V)

    def p_kn(a, w):
        pc = (precede[w] + 0.5) / (nbig + 0.5 * V)  # continuation prob, lightly smoothed
        if ctx[a] == 0:
            return pc
        return max(big[(a, w)] - D, 0) / ctx[a] + D * follow[a] / ctx[a] * pc

    nll_u = nll_b = 0.0
    n = 0
    for p, r in held_enc:
        seq = [p[-1]] + r
        for a, w in zip(seq[:-1], seq[1:]):
            nll_u -= math.log(p_uni(w))
            nll_b -= math.log(p_kn(a, w))
            n += 1
    return math.exp(nll_u / n), math.exp(nll_b / n), n


@torch.no_grad()
def model_ppl(model, held_enc):
    nll, n = 0.0, 0
    for p, r in held_enc:
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(r), reduction="sum").item()
        n += len(r)
    return math.exp(nll / n)


# --------------------------------------------------------------------------------------------
# Loss curve as a PNG without matplotlib (pure-Python encoder, 3x5 digit font)
# --------------------------------------------------------------------------------------------

FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "k": "100101110101101",
}


def write_png(path, curves, w=720, h=420):
    """curves: [(rgb, [(x, y), ...])]; y on a linear axis from 0, gridlines with labels."""
    px = bytearray([255] * (w * h * 3))

    def put(x, y, c):
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            px[i : i + 3] = bytes(c)

    def text(x, y, s, c=(60, 60, 60), sc=2):
        for ch in s:
            f = FONT.get(ch)
            if f:
                for k, b in enumerate(f):
                    if b == "1":
                        for dx in range(sc):
                            for dy in range(sc):
                                put(x + (k % 3) * sc + dx, y + (k // 3) * sc + dy, c)
            x += 4 * sc

    L, R, T, B = 60, w - 20, 20, h - 40
    xmax = max(x for _, pts in curves for x, _ in pts)
    ymax = math.ceil(max(y for _, pts in curves for _, y in pts))
    sx = lambda x: L + int((R - L) * x / xmax)  # noqa: E731
    sy = lambda y: B - int((B - T) * y / ymax)  # noqa: E731
    for yv in range(0, ymax + 1):
        for x in range(L, R):
            put(x, sy(yv), (225, 225, 225))
        text(L - 30, sy(yv) - 5, str(yv))
    step = 10 ** int(math.log10(max(xmax, 10)))
    if xmax / step < 4:
        step //= 2
    for xv in range(0, xmax + 1, step):
        for y in range(T, B):
            put(sx(xv), y, (235, 235, 235))
        s = f"{xv // 1000}k" if xv >= 1000 and xv % 1000 == 0 else str(xv)
        text(sx(xv) - 8, B + 10, s)
    for x in range(L, R):
        put(x, B, (0, 0, 0))
    for y in range(T, B):
        put(L, y, (0, 0, 0))
    for c, pts in curves:
        for (x0, y0), (x1, y1) in zip(pts[:-1], pts[1:]):
            a, b, e, f = sx(x0), sy(y0), sx(x1), sy(y1)
            n = max(abs(e - a), abs(f - b), 1)
            for t in range(n + 1):
                xx, yy = a + (e - a) * t // n, b + (f - b) * t // n
                for d in (-1, 0, 1):
                    put(xx, yy + d, c)
    raw = b"".join(b"\x00" + bytes(px[y * w * 3 : (y + 1) * w * 3]) for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def make_model(tok):
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        pad_token_id=tok.pad_token_id,
        **MODEL,
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return cfg, model


def batches(train_var, seq, bs, steps, seed, head_tokens=16, head_weight=4.0):
    """Windows that start at an example's question: each row is examples in a shuffled order
    (a new shuffle per pass), each with a phrasing of its question drawn at random, packed
    until the window is full. The loss is on the answers only (-100 on the questions), so
    every window teaches an answer from its own question; the random windows over the
    concatenated stream an earlier run used mostly started mid-answer, and its greedy
    answers were about the wrong statement."""
    rng = random.Random(seed)
    order, pos = [], 0
    for _ in range(steps):
        xs, ys, ws = [], [], []
        for _ in range(bs):
            toks, labs, wts = [], [], []
            while len(toks) < seq + 1:
                if pos == len(order):
                    order, pos = list(range(len(train_var))), 0
                    rng.shuffle(order)
                prompts, r = train_var[order[pos]]
                pos += 1
                p = rng.choice(prompts)
                toks += p + r
                labs += [-100] * len(p) + r
                wts += [0.0] * len(p) + [head_weight if j < head_tokens else 1.0 for j in range(len(r))]
            xs.append(toks[:seq])
            ys.append(labs[1 : seq + 1])
            ws.append(wts[1 : seq + 1])
        yield torch.tensor(xs), torch.tensor(ys), torch.tensor(ws)


def train(args, tok, train_var, held_enc, train_ex):
    cfg, model = make_model(tok)
    model.set_experts_implementation(args.experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters ({cfg.num_experts} experts top-{cfg.num_experts_per_tok})", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 30

    def lr_at(s):
        # linear warm-up, then 1/sqrt decay: independent of the total, so a run stopped by
        # --max-minutes after k steps is exactly the run with --steps k
        return args.lr * min((s + 1) / warm, math.sqrt(warm / (s + 1)))

    model.train()
    curve, held_curve = [], []
    t0 = time.time()
    tokens = 0
    ema = None
    for step, (x, y, w) in enumerate(
        batches(train_var, args.seq, args.bs, args.steps, SEED, args.head_tokens, args.head_weight)
    ):
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step)
        out = model(input_ids=x, output_router_logits=True)
        nll = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="none"
        )
        w = w.reshape(-1)
        lm = (nll * (w > 0)).sum() / (w > 0).sum()  # reported: plain mean over answer tokens
        loss = (nll * w).sum() / w.sum() + cfg.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += int((y != -100).sum())
        ema = lm.item() if ema is None else 0.95 * ema + 0.05 * lm.item()
        if step % 10 == 0 or step == args.steps - 1:
            curve.append((step + 1, ema))
        out_of_time = args.max_minutes and time.time() - t0 > 60 * args.max_minutes
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1 or out_of_time:
            model.eval()
            hp = model_ppl(model, held_enc[: args.eval_n])
            held_curve.append((step + 1, math.log(hp)))
            rc = ""
            if (step + 1) % (4 * args.eval_every) == 0:
                h, t = recall(model, tok, train_ex, n=30)
                rc = f" recall {h}/{t}"
                if args.keep_states:  # to pick a stopping point: --steps N reproduces it
                    torch.save(dict(model=model.state_dict()), f"{args.state}.{step + 1}")
            model.train()
            el = time.time() - t0
            print(
                f"step {step + 1}/{args.steps} loss {ema:.3f} held-out ppl {hp:.1f} aux {out.aux_loss.item():.3f} "
                f"lr {lr_at(step):.2e} {tokens / el:.0f} tok/s {el:.0f}s{rc}",
                flush=True,
            )
        if out_of_time:
            print(f"stopped by --max-minutes after {step + 1} steps: reproduce with --steps {step + 1}", flush=True)
            curve.append((step + 1, ema))
            break
    args.steps = step + 1
    model.eval()
    return cfg, model, curve, held_curve, time.time() - t0, tokens


# --------------------------------------------------------------------------------------------
# Saving, checks, golden
# --------------------------------------------------------------------------------------------


def save(model, tok, out):
    if os.path.exists(out):
        for fn in os.listdir(out):
            if fn != "README.md":
                p = os.path.join(out, fn)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    os.makedirs(out, exist_ok=True)
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.pad_token_id,
        do_sample=False,
    )
    m = model.to(torch.bfloat16)
    m.save_pretrained(out)  # per-expert hub tensor names
    model.to(torch.float32)
    tok.save_pretrained(out)
    # hub style tokenizer files: chat template inside tokenizer_config.json
    jpath, tpath = os.path.join(out, "chat_template.jinja"), os.path.join(out, "tokenizer_config.json")
    with open(jpath) as f:
        tmpl = f.read()
    os.remove(jpath)
    with open(tpath) as f:
        t = json.load(f)
    t["chat_template"] = tmpl
    t.pop("backend", None)
    t["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(tpath, "w") as f:
        json.dump(t, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    for fn in ("config.json", "generation_config.json"):
        p = os.path.join(out, fn)
        with open(p) as f:
            c = json.load(f)
        with open(p, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
            f.write("\n")


def load_saved(out):
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, experts_implementation="eager", attn_implementation="eager"
    )
    with torch.no_grad():
        for p in model.parameters():  # out of the safetensors mmap (tied params: same object)
            p.data = p.data.clone().contiguous()
    return model.eval()


@torch.no_grad()
def greedy(model, tok, ids, n):
    out = model.generate(
        input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")
    )
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def chat_ids(tok, q):
    r = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    if not isinstance(r, list):
        r = r["input_ids"]
    return [int(i) for i in r]


def recall(model, tok, train_ex, n=60, k=8):
    """Of n training questions about the documentation topics' first sections (every
    len/n-th, asked in the phrasing listed last: unquoted where the heading has quotes), how
    many greedy answers start with the first k tokens of the answer that question was
    trained on: whether the model answers the topic asked."""
    firsts = [e for e in train_ex if e[3] == "topic" and e[2][0].startswith("Tell me about ")]
    step = max(1, len(firsts) // n)
    hits, total = 0, 0
    for q, a, forms, _ in firsts[::step][:n]:
        ref = tok(a, add_special_tokens=False)["input_ids"][:k]
        ids = chat_ids(tok, forms[-1])
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=k, do_sample=False)
        hits += out[0, len(ids) :].tolist() == ref
        total += 1
    return hits, total


SAMPLES = [
    "Tell me about the for statement.",
    "Explain the \"with\" statement.",
    "What is the \"while\" statement?",
    "What is the pass statement?",
    "What is the \"break\" statement?",
    "What is the assert statement?",
    "What does json.dumps() do?",
]

# Golden candidates: the first three (by kind) whose router and logit margins pass make_fixtures'
# MIN_REL_MARGIN over the prompt and 32 greedy tokens.
GOLDEN_CANDIDATES = [
    ("chat", True, "What is the assert statement?"),
    ("chat", True, "Tell me about the for statement."),
    ("chat", True, "Explain the with statement."),
    ("chat", True, "What is a lambda expression?"),
    ("chat", True, "Tell me about the \"if\" statement."),
    ("chat", True, "What is the \"pass\" statement?"),
    ("chat", True, "Explain Boolean operations."),
    ("chat", True, "Tell me about Numeric literals."),
    ("plain", False, "The \"while\" statement is used for"),
    ("plain", False, "A function definition defines"),
    ("plain", False, "Strings are immutable sequences of"),
    ("plain", False, "The \"return\" statement"),
    ("plain", False, "An object is"),
    ("plain", False, "Python"),
    ("plain", False, "The \"if\" statement is used for conditional execution"),
    ("long", True, "What should I know about the import statement, and how does Python find the module?"),
    ("long", True, "Tell me about exceptions and how the try statement handles them in a program."),
    ("long", True, "What is the difference between a list and a tuple in Python, and when is each used?"),
    ("long", True, "Explain how a class definition works and what happens to the names defined in its body."),
    ("long", True, "Tell me about the \"with\" statement and context managers, and why they are useful."),
    ("long", True, "What happens when a function is called with keyword arguments and default values?"),
]


def make_golden(out, golden_path=GOLDEN):
    sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
    import make_fixtures as mf  # sets 1 thread + deterministic algorithms, as for the fixtures

    from transformers import AutoTokenizer

    ref = load_saved(out)
    rcfg = ref.config
    rtok = AutoTokenizer.from_pretrained(out)
    cases, seen = [], set()
    for kind, is_chat, prompt in GOLDEN_CANDIDATES:
        if kind in seen:
            continue
        ids = chat_ids(rtok, prompt) if is_chat else [int(i) for i in rtok(prompt)["input_ids"]]
        r = mf.run_case(ref, rcfg, ids)
        ok = r["router_rel"] > mf.MIN_REL_MARGIN and r["logit_rel"] > mf.MIN_REL_MARGIN
        print(
            f"golden candidate {kind} {prompt!r}: router rel {r['router_rel']:.3g} logit rel {r['logit_rel']:.3g}"
            f" -> {'ok' if ok else 'skip'}; {rtok.decode(r['greedy'])!r}",
            flush=True,
        )
        if not ok:
            continue
        seen.add(kind)
        lg = r["logits"]
        top = torch.topk(lg, 5, dim=-1)
        cases.append(
            {
                "name": kind,
                "prompt": prompt,
                "chat": is_chat,
                "prompt_token_ids": ids,
                "last_logits": [mf.f32(v) for v in lg[-1].tolist()],
                "top5_ids": top.indices.tolist(),
                "top5_logits": [[mf.f32(v) for v in row] for row in top.values.tolist()],
                "greedy_token_ids": r["greedy"],
                "router_topk": {str(i): v for i, v in r["router"].items()},
                "min_router_margin": mf.f32(r["router_margin"]),
                "min_logit_margin": mf.f32(r["logit_margin"]),
            }
        )
    assert len(cases) == 3, f"only {len(cases)} golden cases have clear margins"
    golden = {
        "fixture": "demo",
        "model_type": rcfg.model_type,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "num_layers": rcfg.num_hidden_layers,
        "moe_layers": mf.moe_layer_ids(rcfg),
        "num_experts": rcfg.num_experts,
        "top_k": rcfg.num_experts_per_tok,
        "vocab_size": rcfg.vocab_size,
        "cases": cases,
    }
    with open(golden_path, "w") as f:
        f.write(mf.dump(golden) + "\n")
    print(f"wrote {golden_path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5200)
    ap.add_argument("--max-minutes", type=float, default=0, help="stop early after this much training time")
    ap.add_argument("--docstrings", action="store_true", help="also train on stdlib docstrings")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--head-tokens", type=int, default=16, help="the first answer tokens, weighted --head-weight in the loss")
    ap.add_argument("--head-weight", type=float, default=4.0)
    ap.add_argument("--keep-states", action="store_true", help="also save the weights at every recall check")
    ap.add_argument("--topic-repeat", type=int, default=3, help="uses of each topic example per pass (docstrings: 1)")
    ap.add_argument("--eval-n", type=int, default=30, help="held-out examples per periodic eval")
    ap.add_argument("--experts-impl", default="grouped_mm")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--golden-only", action="store_true")
    ap.add_argument("--state", default="/tmp/demo_state.pt", help="trained f32 weights + curves are kept here")
    ap.add_argument("--from-state", action="store_true", help="skip training: use --state")
    ap.add_argument("--no-golden", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    if args.golden_only:
        make_golden(args.out, GOLDEN if args.out == OUT else os.path.join(args.out, "golden.json"))
        return

    path, topics = corpus_source()
    digest = hashlib.sha256(repr(sorted(topics.items())).encode()).hexdigest()
    train_ex, held_ex = examples(with_docstrings=args.docstrings)
    n_chars = sum(len(e[1]) for e in train_ex)
    print(
        f"corpus {path} (Python {sys.version.split()[0]}), sha256 of topics {digest[:16]}: "
        f"{len(train_ex)} train / {len(held_ex)} held-out answers, {n_chars} answer chars in training",
        flush=True,
    )
    tok = build_tokenizer(train_ex)
    train_enc, held_enc = encode_examples(tok, train_ex), encode_examples(tok, held_ex)
    n_tr = sum(len(p) + len(r) for p, r in train_enc)
    print(f"tokenizer {len(tok)} tokens; training stream {n_tr} tokens; held-out answers {sum(len(r) for _, r in held_enc)} tokens", flush=True)
    ppl_u, ppl_b, n_held = baselines(train_enc, held_enc, len(tok))
    print(f"baselines on {n_held} held-out tokens: unigram ppl {ppl_u:.1f}, bigram (KN) ppl {ppl_b:.1f}", flush=True)

    if args.from_state:
        st = torch.load(args.state)
        cfg, model = make_model(tok)
        model.load_state_dict(st["model"])
        model.eval()
        curve, held_curve, secs, tokens = st["curve"], st["held_curve"], st["secs"], st["tokens"]
    else:
        cfg, model, curve, held_curve, secs, tokens = train(args, tok, encode_variants(tok, train_ex, args.topic_repeat), held_enc, train_ex)
        torch.save(
            dict(model=model.state_dict(), curve=curve, held_curve=held_curve, secs=secs, tokens=tokens), args.state
        )
    save(model, tok, args.out)
    saved = load_saved(args.out)
    ppl_m = model_ppl(saved, held_enc)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    stats = {
        "corpus": f"pydoc_data/topics.py{' + stdlib docstrings' if args.docstrings else ''} of Python {sys.version.split()[0]}",
        "corpus_sha256": digest,
        "train_answers": len(train_ex),
        "held_out_answers": len(held_ex),
        "train_stream_tokens": n_tr,
        "held_out_tokens": n_held,
        "tokenizer_size": len(tok),
        "parameters": sum(p.numel() for p in saved.parameters()),
        "steps": args.steps,
        "batch": args.bs,
        "seq": args.seq,
        "answer_tokens_trained": tokens,
        "windows": "start at a question, examples packed, loss on answers only, question phrasing drawn per use",
        "head_tokens_weight": [args.head_tokens, args.head_weight],
        "topic_repeat": args.topic_repeat,
        "train_seconds": round(secs),
        "threads": args.threads,
        "final_train_loss_ema": round(curve[-1][1], 4),
        "held_out_ppl_model_bf16": round(ppl_m, 2),
        "held_out_ppl_unigram": round(ppl_u, 2),
        "held_out_ppl_bigram_kn": round(ppl_b, 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "curve": curve,
        "held_curve": held_curve,
    }
    print(json.dumps({k: v for k, v in stats.items() if "curve" not in k}, indent=1), flush=True)
    write_png(
        os.path.join(args.out, "loss.png"),
        [((31, 119, 180), curve), ((255, 127, 14), held_curve)],
    )
    hits, total = recall(saved, tok, train_ex)
    stats["recall_train_questions"] = f"{hits}/{total}"
    print(f"recall: {hits}/{total} training questions answered with the start of their own answer", flush=True)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")
    for q in SAMPLES:
        print(f"\nQ: {q}\nA: {greedy(saved, tok, chat_ids(tok, q), 120)}", flush=True)
    print(f"\n{args.out}: {size / 1e6:.1f} MB", flush=True)
    if not args.no_golden:
        make_golden(args.out, GOLDEN if args.out == OUT else os.path.join(args.out, "golden.json"))


if __name__ == "__main__":
    main()
