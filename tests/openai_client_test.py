"""Drives a running `epserve serve` with the official `openai` Python client.

Usage: python3 tests/openai_client_test.py BASE_URL MODEL
Checks a streaming chat completion (with usage), a non-streaming completion,
n = 2 (greedy, and sampled with a seed while streaming), logit_bias, the model
list, that a bad request raises the client's typed error, and tool calling (the
server must run a model with a tool-capable chat template).
Exits non-zero on the first failure.
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import openai

# A tool small enough for the fixture's 512-token context (its tiny vocabulary
# spends about a token per character). Closed schemas (no additional
# properties): an open object lets the random-weight fixture write extra keys
# until max_tokens runs out, so a forced call would end with "length".
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
# Forced calls (tool_choice "required" / named) are enforced with structured output.
FORCED_CALLS = True


def stream_reassembled(stream):
    """(content, tool calls by index as [id, name, arguments], finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                content += c.delta.content
            for tc in c.delta.tool_calls or []:
                cur = calls.setdefault(tc.index, ["", "", ""])
                if tc.id:
                    cur[0] = tc.id
                if tc.function and tc.function.name:
                    cur[1] += tc.function.name
                if tc.function and tc.function.arguments:
                    cur[2] += tc.function.arguments
            if c.finish_reason:
                finish = c.finish_reason
    return content, [calls[i] for i in sorted(calls)], finish


def check_tools(client, model):
    """A chat template with tools: requests, response and stream shapes; forced
    calls parse into tool_calls whose arguments are JSON for the schema."""
    msgs = [{"role": "user", "content": "1+2?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=[ADD], max_tokens=12, temperature=0)
    m = r.choices[0].message
    # The random-weight fixture does not call tools by itself.
    assert m.tool_calls in (None, []), m
    assert r.choices[0].finish_reason in ("stop", "length"), r.choices[0]
    content, calls, finish = stream_reassembled(client.chat.completions.create(
        model=model, messages=msgs, tools=[ADD], max_tokens=12, temperature=0, stream=True))
    assert (content or None, calls, finish) == (m.content or None, [], r.choices[0].finish_reason)

    # A history with a call and its result.
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    r = client.chat.completions.create(model=model, messages=history, tools=[ADD], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > 0

    try:
        client.chat.completions.create(model=model, messages=msgs, tools=[ADD], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "mul"}})
        raise AssertionError("unknown tool in tool_choice accepted")
    except openai.BadRequestError as e:
        assert e.body and e.body.get("param") == "tool_choice", e.body

    if not FORCED_CALLS:
        try:
            client.chat.completions.create(model=model, messages=msgs, tools=[ADD], tool_choice="required",
                                           max_tokens=4)
            raise AssertionError("tool_choice required accepted without structured output")
        except openai.BadRequestError:
            pass
        return

    for choice, names in (({"type": "function", "function": {"name": "add"}}, {"add"}), ("required", {"add", "now"})):
        for temperature in (0, 1):
            r = client.chat.completions.create(model=model, messages=msgs, tools=[ADD, NOW], tool_choice=choice,
                                               max_tokens=84, temperature=temperature, seed=7)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c
            assert c.message.tool_calls, c.message
            for tc in c.message.tool_calls:
                assert tc.type == "function" and tc.id.startswith("call_"), tc
                assert tc.function.name in names, tc
                args = json.loads(tc.function.arguments)
                assert isinstance(args, dict), args
                if tc.function.name == "add":
                    assert isinstance(args["a"], int) and 0 <= args["a"] <= 99, args
            content, calls, finish = stream_reassembled(client.chat.completions.create(
                model=model, messages=msgs, tools=[ADD, NOW], tool_choice=choice, max_tokens=84,
                temperature=temperature, seed=7, stream=True))
            assert finish == "tool_calls", finish
            assert content == (c.message.content or ""), (content, c.message.content)
            got = [(n, json.loads(a)) for _, n, a in calls]
            want = [(tc.function.name, json.loads(tc.function.arguments)) for tc in c.message.tool_calls]
            assert got == want, (got, want)
            assert all(i.startswith("call_") for i, _, _ in calls), calls
# A bounded schema: every conforming output fits the max_tokens below.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}


def validate(value, schema, path="$"):
    """A small JSON Schema check for the keywords PERSON uses."""
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    t = schema.get("type")
    if t == "object":
        assert isinstance(value, dict), (path, value)
        for k in schema.get("required", []):
            assert k in value, (path, "missing", k)
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                validate(v, props[k], f"{path}.{k}")
            else:
                assert schema.get("additionalProperties", True) is not False, (path, "extra", k)
    elif t == "string":
        assert isinstance(value, str), (path, value)
        assert len(value) <= schema.get("maxLength", len(value)), (path, value)
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (path, value)
    elif t == "boolean":
        assert isinstance(value, bool), (path, value)
    elif t == "array":
        assert isinstance(value, list), (path, value)
        assert len(value) <= schema.get("maxItems", len(value)), (path, value)
        for i, v in enumerate(value):
            validate(v, schema["items"], f"{path}[{i}]")


def structured(client, model) -> None:
    """response_format json_schema: 100 sampled answers (temperature 1) all
    parse and validate; guided_choice and an invalid schema."""

    def one(i):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Describe pet number {i} as JSON."}],
            max_tokens=400,
            temperature=1.0,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        validate(json.loads(c.message.content), PERSON)
        return r.usage.completion_tokens

    with ThreadPoolExecutor(max_workers=16) as pool:
        tokens = list(pool.map(one, range(100)))

    comp = client.completions.create(model=model, prompt="Pick one:", max_tokens=16, temperature=1.0,
                                     extra_body={"guided_choice": ["red", "green", "blue"]})
    assert comp.choices[0].text in ("red", "green", "blue"), comp.choices[0].text
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})
        raise AssertionError("invalid schema accepted")
    except openai.BadRequestError as e:
        assert e.param == "response_format.json_schema.schema", (e.param, e.body)
    print(f"openai client: structured output OK (100 json_schema answers, {sum(tokens)} tokens, "
          f"longest {max(tokens)})")


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
    print("openai client: streaming chat, completion, n = 2, logit_bias, models, errors, "
          "unknown fields, tokenize OK")
    structured(client, model)
    check_tools(client, model)


if __name__ == "__main__":
    main()
