"""Drives a running `epserve serve` with the official `openai` Python client.

Usage: python3 tests/openai_client_test.py BASE_URL MODEL
Checks a streaming chat completion (with usage), a non-streaming completion,
the model list, and that a bad request raises the client's typed error.
Exits non-zero on the first failure.
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import openai

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
    print("openai client: streaming chat, completion, models, errors OK")
    structured(client, model)


if __name__ == "__main__":
    main()
