"""Structured output: a random model's sampled completions, constrained by a JSON schema, all
parse and validate; `response_format` over HTTP; a bad schema is a 400."""

import json

import jsonschema
import pytest
from inference_fixtures import random_prompts, serve_fixtures
from test_serve_engine import engine_for, request, run_until_idle

from llmstack.inference import SamplingParams
from llmstack.inference.serve.engine import RequestRejected
from llmstack.inference.speculative import SpeculativeConfig
from llmstack.inference.structured import json_object_grammar, json_schema_grammar, regex_grammar

tokenizer, model = serve_fixtures()

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "admin"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,5}$"}]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]


def texts(outputs, n):
    return ["".join(e.text for e in outputs[i]) for i in range(n)]


def test_50_sampled_completions_parse_and_validate_against_their_schema(model, tokenizer):
    # prompt lookup is on: constrained requests decode without guesses beside the others
    engine = engine_for(model, tokenizer, speculative=SpeculativeConfig("ngram"))
    sampling = SamplingParams(temperature=1.0)
    outputs, schemas = {}, [SCHEMAS[i % len(SCHEMAS)] for i in range(50)]
    for i, (prompt, schema) in enumerate(zip(random_prompts([6] * 50, seed=20), schemas)):
        engine.submit(request(prompt, 100, outputs, i, sampling=sampling, seed=i, grammar=json_schema_grammar(schema)))
    run_until_idle(engine)
    assert [outputs[i][-1].finish_reason for i in range(50)] == ["stop"] * 50
    for text, schema in zip(texts(outputs, 50), schemas):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_regular_expression_constraints(model, tokenizer):
    engine, outputs = engine_for(model, tokenizer), {}
    bounded_object = json_schema_grammar({"type": "object", "maxProperties": 2, "additionalProperties": False})
    grammars = [json_object_grammar(), bounded_object, regex_grammar(r"[0-9]{3}-[a-c]{2,4}")]
    for i, grammar in enumerate(grammars):
        engine.submit(request([5, 6, 7], 100, outputs, i, sampling=SamplingParams(temperature=0.0), grammar=grammar))
    run_until_idle(engine)
    first, second, third = texts(outputs, 3)
    assert outputs[0][-1].finish_reason in ("stop", "length")  # any object: it may still be open at max_tokens
    if outputs[0][-1].finish_reason == "stop":
        assert isinstance(json.loads(first), dict)
    assert json.loads(second) == {}
    assert outputs[2][-1].finish_reason == "stop"
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-c]{2,4}", third)


def test_a_schema_that_does_not_compile_is_rejected_when_submitted(model, tokenizer):
    engine = engine_for(model, tokenizer)
    with pytest.raises(RequestRejected, match="JSON schema"):
        engine.submit(request([5, 6], 10, {}, 0, grammar=json_schema_grammar({"type": "no-such-type"})))
