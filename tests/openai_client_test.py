"""Drives a running `epserve serve` with the official `openai` Python client.

Usage: python3 tests/openai_client_test.py BASE_URL MODEL
Checks a streaming chat completion (with usage), a non-streaming completion,
n = 2 (greedy, and sampled with a seed while streaming), logit_bias, the model
list, and that a bad request raises the client's typed error.
Exits non-zero on the first failure.
"""

import sys

import openai


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)

    ids = [m.id for m in client.models.list().data]
    assert model in ids, ids

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
            if c.finish_reason:
                finish = c.finish_reason
    assert usage is not None and usage.completion_tokens > 0, usage
    assert finish in ("stop", "length"), finish

    full = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=24,
        temperature=0,
    )
    assert full.choices[0].message.content == text, (full.choices[0].message.content, text)
    assert full.usage.completion_tokens == usage.completion_tokens

    comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 8, comp.usage
    assert comp.choices[0].finish_reason == "length"

    # n = 2: two choices of one prompt; greedy ones equal the n = 1 answer.
    two = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1], two.choices
    assert two.choices[0].text == two.choices[1].text == comp.choices[0].text, two.choices
    assert two.usage.prompt_tokens == comp.usage.prompt_tokens, two.usage
    assert two.usage.completion_tokens == 16, two.usage
    # Sampled and streamed: each chunk names its choice; seeded, so repeatable.
    def sampled_chat():
        texts = {}
        for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
                temperature=1.0, seed=7, n=2, stream=True):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        return texts
    first = sampled_chat()
    assert sorted(first) == [0, 1], first
    assert sampled_chat() == first
    # logit_bias: +100 on one token makes greedy decoding repeat it.
    biased = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, temperature=0,
                                       logit_bias={"42": 100}, logprobs=0)
    toks = biased.choices[0].logprobs.tokens
    assert len(toks) == 3 and len(set(toks)) == 1, toks
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1, logit_bias={"99999999": 1})
        raise AssertionError("out-of-vocabulary logit_bias accepted")
    except openai.BadRequestError as e:
        assert "logit_bias" in str(e), e
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError:
        pass
    try:
        client.completions.create(model=model, prompt="x", max_tokens=10**7)
        raise AssertionError("oversized request accepted")
    except openai.BadRequestError:
        pass
    print("openai client: streaming chat, completion, n = 2, logit_bias, models, errors OK")


if __name__ == "__main__":
    main()
