"""Result schemas: loading, the metaschema check, validation reasons."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from inboxd.adapters.extraction import (
    ExtractionTerminal,
    ProcessorConfigError,
    ResultSchema,
    compile_schema,
    load_schema,
)

INVOICE = {
    "type": "object",
    "properties": {
        "number": {"type": "string", "pattern": "^[A-Z0-9-]+$"},
        "total": {"type": "number"},
        "due": {"type": "string", "format": "date"},
        "lines": {"type": "array", "items": {"type": "object", "required": ["sku"]}},
    },
    "required": ["number", "total"],
    "additionalProperties": False,
}


def test_a_valid_result_comes_back_unchanged() -> None:
    schema = compile_schema(INVOICE)
    result = {"number": "INV-1", "total": 12.5, "due": "2024-12-31"}
    assert schema.validate_result(result) == result


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ({"number": "INV-1"}, "at $: 'total' is a required property"),
        ({"number": "INV-1", "total": "12"}, "at $.total: '12' is not of type 'number'"),
        (
            {"number": "INV-1", "total": 1, "due": "31/12/2024"},
            "at $.due: '31/12/2024' is not a 'date'",
        ),
        (
            {"number": "INV-1", "total": 1, "lines": [{"sku": 1}, {}]},
            "at $.lines[1]: 'sku' is a required",
        ),
        (
            {"number": "INV-1", "total": 1, "extra": 1},
            "at $: Additional properties are not allowed",
        ),
    ],
)
def test_an_invalid_result_is_terminal_naming_the_json_path(
    result: dict[str, object], reason: str
) -> None:
    with pytest.raises(ExtractionTerminal) as caught:
        compile_schema(INVOICE).validate_result(result)
    assert caught.value.reason.startswith("result does not validate " + reason)
    assert "\n" not in caught.value.reason


def test_a_result_that_is_not_an_object_is_terminal() -> None:
    with pytest.raises(ExtractionTerminal, match="not a JSON object but list"):
        compile_schema(INVOICE).validate_result([1, 2])


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ({"number": "A", "total": float("inf")}, "$.total is inf, not a finite number"),
        ({"number": "A", "total": float("nan")}, "$.total is nan, not a finite number"),
        ({"number": "A", "total": 2**64}, "$.total is an integer outside the signed 64-bit"),
        ({"number": "A", "total": 1, "lines": [{"sku": -(2**70)}]}, "$.lines[0].sku is an"),
    ],
)
def test_a_number_json_cannot_carry_is_terminal(result: dict[str, object], reason: str) -> None:
    # jsonschema takes inf for a number, and orjson would write it as null
    with pytest.raises(ExtractionTerminal) as caught:
        compile_schema(INVOICE).validate_result(result)
    assert caught.value.reason.startswith("result cannot be stored: " + reason)


def test_a_long_value_is_cut_in_the_reason() -> None:
    with pytest.raises(ExtractionTerminal) as caught:
        compile_schema(INVOICE).validate_result({"number": "x" * 5000 + "\n", "total": 1})
    assert len(caught.value.reason) <= 300
    assert "$.number" in caught.value.reason


def test_the_schema_is_checked_against_its_metaschema() -> None:
    with pytest.raises(
        ProcessorConfigError,
        match=r"`schema` is not a valid JSON Schema at \$\.properties\.total\.type",
    ):
        compile_schema({"type": "object", "properties": {"total": {"type": "money"}}})


@pytest.mark.parametrize(
    ("schema", "ref"),
    [
        ({"$ref": "#/$defs/nope"}, "#/$defs/nope"),
        ({"properties": {"a": {"$ref": "https://schemas.example/a.json"}}}, "https://schemas"),
        (
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "definitions": {"x": {}},
                "items": [{"$ref": "#/definitions/y"}],
            },
            "#/definitions/y",
        ),
        ({"$defs": {"n": {"$anchor": "num"}}, "properties": {"a": {"$ref": "#number"}}}, "#num"),
    ],
)
def test_a_ref_that_does_not_resolve_locally_is_refused(
    schema: dict[str, object], ref: str
) -> None:
    with pytest.raises(ProcessorConfigError) as caught:
        compile_schema(schema)
    assert str(caught.value).startswith(f"`schema`: $ref '{ref}")
    assert "does not resolve" in str(caught.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"n": {"type": "number"}}, "properties": {"a": {"$ref": "#/$defs/n"}}},
        {"$defs": {"n": {"$anchor": "num"}}, "properties": {"a": {"$ref": "#num"}}},
        {"properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "string"}}},
        {"$id": "https://s.example/r", "$defs": {"b": {"$id": "b"}}, "items": {"$ref": "b"}},
        {"$dynamicAnchor": "node", "properties": {"kids": {"items": {"$dynamicRef": "#node"}}}},
        {"properties": {"a": {"const": {"$ref": "#/not/a/reference"}}}},
        {"properties": {"meta": {"$ref": "https://json-schema.org/draft/2020-12/schema"}}},
    ],
)
def test_refs_inside_the_schema_and_to_metaschemas_resolve(schema: dict[str, object]) -> None:
    assert compile_schema(schema).validate_result({}) == {}


def test_a_ref_that_fails_at_validation_is_terminal_not_an_internal_error() -> None:
    # a schema compile_schema would refuse, built around it: the run must not loop
    document = {"properties": {"a": {"$ref": "#/$defs/gone"}}}
    schema = ResultSchema(document, jsonschema.Draft202012Validator(document))
    with pytest.raises(ExtractionTerminal) as caught:
        schema.validate_result({"a": 1})
    assert caught.value.reason.startswith("the schema cannot validate: ")
    assert "#/$defs/gone" in caught.value.reason


def test_the_dialect_is_the_schemas_own() -> None:
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {"n": {"type": "number", "maximum": 10, "exclusiveMaximum": True}},
    }
    schema = compile_schema(draft4)
    with pytest.raises(ExtractionTerminal, match=r"\$\.n"):
        schema.validate_result({"n": 10})
    with pytest.raises(ProcessorConfigError, match="unknown \\$schema"):
        compile_schema({"$schema": "https://example.com/my-dialect", "type": "object"})


def test_a_schema_file_is_read_relative_to_the_base_dir(tmp_path: Path) -> None:
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "invoice.json").write_text(json.dumps(INVOICE), encoding="utf-8")
    assert load_schema("schemas/invoice.json", tmp_path) == INVOICE
    assert load_schema({"type": "object"}, tmp_path) == {"type": "object"}


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), ("{not json", "is not JSON"), ("[1]", "does not hold a JSON object")],
)
def test_a_bad_schema_file_names_the_key(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "s.json").write_text(content, encoding="utf-8")
    with pytest.raises(ProcessorConfigError, match=f"`schema`: .*{message}"):
        load_schema("s.json", tmp_path)
    with pytest.raises(ProcessorConfigError, match="`schema` must be"):
        load_schema(42, tmp_path)
