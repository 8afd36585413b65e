"""Drives a running `epserve serve` with the official `openai` Python client.

Usage: python3 tests/openai_client_test.py BASE_URL MODEL
Checks a streaming chat completion (with usage), a non-streaming completion,
the model list, and that a bad request raises the client's typed error.
Exits non-zero on the first failure.
"""

import json
import sys
import urllib.request

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
    # A field the server does not implement is a 400 naming it, never dropped.
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, extra_body={"frobnicate": 1})
        raise AssertionError("unknown field accepted")
    except openai.BadRequestError as e:
        assert e.body and e.body.get("param") == "frobnicate", e.body
    # vLLM's /tokenize and /detokenize.
    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    tok = post("/tokenize", {"model": model, "prompt": "Hello world"})
    assert tok["count"] == len(tok["tokens"]) > 0, tok
    detok = post("/detokenize", {"model": model, "tokens": tok["tokens"]})
    assert detok["prompt"].endswith("Hello world"), detok
    print("openai client: streaming chat, completion, models, errors, unknown fields, tokenize OK")


if __name__ == "__main__":
    main()
