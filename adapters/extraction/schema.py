"""A processor's result schema: loaded once, checked against its metaschema, then
used to validate every result a backend produces (builtin and http alike).

The schema is either an inline table of the tenant file or a path to a JSON
file, relative to the tenant file's folder. Its dialect is its own `$schema`
(draft 4 to 2020-12, `jsonschema.validators.validator_for`), 2020-12 when it
names none. `format` is asserted with the dialect's format checker, so a
`"format": "date"` field holding "31/12/2024" fails like a wrong type would.
No `$ref` is fetched over the network: the validator's registry holds only the
schema itself and the published metaschemas (jsonschema's own default would
fetch a remote `$ref` with urllib, deprecated), and `compile_schema` refuses a
schema with any `$ref` that does not resolve there, so check-config reports it
instead of every message failing at run time.

A result that fails validation is `ExtractionTerminal`: re-running the same
extraction of the same mail gives the same result (builtin), or the endpoint
answered something the schema rejects (http); either way a human decides. So is
a schema that turns out unusable while validating (a reference that does not
resolve): no retry makes it usable. So is a result that cannot be stored as it
validated: a NaN or infinite number (orjson would write null), or an integer
outside JSON_INT_MIN..JSON_INT_MAX.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators
import jsonschema_specifications  # type: ignore[import-untyped]
import referencing
import referencing.exceptions
import referencing.jsonschema

from inboxd.adapters.extraction.errors import ExtractionTerminal, ProcessorConfigError
from inboxd.pipeline.mailbox.leases import one_line

if TYPE_CHECKING:  # not re-exported by referencing; only the type of resolver_with_root
    from referencing._core import Resolver

#: Dialect of a schema without `$schema` (the newest jsonschema 4.x implements).
DEFAULT_DIALECT: type[jsonschema.protocols.Validator] = jsonschema.Draft202012Validator
#: Longest failure reason kept, characters (pipeline/mailbox/leases.py ERROR_MAX_CHARS is the
#: limit of the row the reason lands in; a result's value can be long).
REASON_MAX_CHARS = 300
#: Largest schema file read, bytes: a schema is a page of JSON, not a data set.
SCHEMA_FILE_MAX_BYTES = 1_000_000
#: Integers a result may hold: a signed 64-bit integer's range. orjson writes none
#: wider ("serializes … a signed 64-bit integer's minimum to an unsigned 64-bit
#: integer's maximum", its README; beyond, TypeError) and readers of the stored
#: jsonb commonly take a number into a bigint / int64, so the signed range is kept.
JSON_INT_MIN = -(2**63)
JSON_INT_MAX = 2**63 - 1
#: Keywords whose value is a reference to resolve (`$recursiveRef` is always "#").
REFERENCE_KEYWORDS = ("$ref", "$dynamicRef")
#: What `$ref` may reach besides the schema itself: the published metaschemas,
#: shipped with jsonschema (jsonschema-specifications); nothing is retrieved.
LOCAL_REGISTRY: referencing.Registry[Any] = jsonschema_specifications.REGISTRY


@dataclass(frozen=True, slots=True)
class ResultSchema:
    """A checked schema and its validator, built once per processor."""

    schema: dict[str, Any]
    # equal schemas are equal processors (a SIGHUP with the same file changes nothing)
    validator: jsonschema.protocols.Validator = field(compare=False)

    def validate_result(self, result: object) -> dict[str, Any]:
        """`result` unchanged when it is a JSON object valid against the schema.

        Raises ExtractionTerminal with a one-line reason naming the JSON path of
        the most relevant failure (`jsonschema.exceptions.best_match`), e.g.
        ``result does not validate at $.total: 'abc' is not of type 'number'``.
        """
        if not isinstance(result, dict):
            raise ExtractionTerminal(f"result is not a JSON object but {type(result).__name__}")
        unstorable = unstorable_number(result)
        if unstorable is not None:
            raise ExtractionTerminal(one_line(f"result cannot be stored: {unstorable}"))
        try:
            error = jsonschema.exceptions.best_match(self.validator.iter_errors(result))
        except referencing.exceptions.Unresolvable as exc:
            # compile_schema refuses these; a schema built otherwise must still not
            # turn every message into a retry loop (module docstring)
            reason = f"the schema cannot validate: {exc}"
            raise ExtractionTerminal(one_line(reason, REASON_MAX_CHARS)) from exc
        if error is not None:
            reason = f"result does not validate at {error.json_path}: {error.message}"
            raise ExtractionTerminal(one_line(reason, REASON_MAX_CHARS))
        return result

    @property
    def property_names(self) -> frozenset[str] | None:
        """The top-level properties a result may have, None when any name is allowed."""
        if self.schema.get("additionalProperties") is not False:
            return None
        properties = self.schema.get("properties")
        return frozenset(properties) if isinstance(properties, dict) else frozenset()


def unstorable_number(document: object) -> str | None:
    """Where `document` holds a number JSON cannot carry (module docstring), as
    "$.path is …"; None when it has none. Iterative: a result may nest as deep as
    orjson reads (1024 levels), past Python's recursion limit."""
    stack: list[tuple[str, object]] = [("$", document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return f"{path} is {value}, not a finite number"
        if isinstance(value, int) and not JSON_INT_MIN <= value <= JSON_INT_MAX:
            return f"{path} is an integer outside the signed 64-bit range"
        if isinstance(value, dict):
            stack.extend((f"{path}.{key}", item) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def load_schema(spec: object, base_dir: Path, *, key: str = "schema") -> dict[str, Any]:
    """The schema document named by `spec`: an inline mapping (copied) or a JSON
    file path, relative to `base_dir`. ProcessorConfigError names `key` when the
    file is missing, unreadable, not JSON or not an object."""
    if isinstance(spec, Mapping):
        plain: dict[str, Any] = _plain(dict(spec))
        return plain
    if not isinstance(spec, str | Path) or not str(spec):
        raise ProcessorConfigError(f"`{key}` must be a JSON file path or an inline table")
    path = Path(spec)
    if not path.is_absolute():
        path = base_dir / path
    try:
        if path.stat().st_size > SCHEMA_FILE_MAX_BYTES:
            raise ProcessorConfigError(f"`{key}`: {path} is over {SCHEMA_FILE_MAX_BYTES} bytes")
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProcessorConfigError(f"`{key}`: cannot read {path}: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProcessorConfigError(f"`{key}`: {path} is not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise ProcessorConfigError(f"`{key}`: {path} does not hold a JSON object")
    return document


def compile_schema(schema: Mapping[str, Any], *, key: str = "schema") -> ResultSchema:
    """Check `schema` against its metaschema and build its validator.

    ProcessorConfigError (naming `key` and the schema's failing path) when the
    schema is not a valid schema of its dialect, names an unknown `$schema`, or
    holds a `$ref` that does not resolve locally (module docstring)."""
    document = _plain(dict(schema))
    dialect = document.get("$schema")
    # default=None: None for an unknown `$schema` (the library's own default would
    # warn and validate with the newest draft), and for none at all.
    found = jsonschema.validators.validator_for(document, default=None)
    if found is None and dialect is not None:
        raise ProcessorConfigError(one_line(f"`{key}`: unknown $schema {dialect!r}"))
    cls: type[jsonschema.protocols.Validator] = found or DEFAULT_DIALECT
    try:
        cls.check_schema(document)
    except jsonschema.exceptions.SchemaError as exc:
        where = exc.json_path
        raise ProcessorConfigError(
            one_line(f"`{key}` is not a valid JSON Schema at {where}: {exc.message}")
        ) from exc
    specification = referencing.jsonschema.specification_with(cls.ID_OF(cls.META_SCHEMA))
    resource = specification.create_resource(document)
    ref = next(_unresolvable(LOCAL_REGISTRY.resolver_with_root(resource), resource), None)
    if ref is not None:
        raise ProcessorConfigError(
            one_line(
                f"`{key}`: $ref {ref!r} does not resolve (only references inside the"
                " schema do; nothing is fetched over the network)",
                REASON_MAX_CHARS,
            )
        )
    # an empty registry: jsonschema adds the metaschemas, and no retrieval
    validator = cls(document, format_checker=cls.FORMAT_CHECKER, registry=referencing.Registry())
    return ResultSchema(document, validator)


def _unresolvable(resolver: Resolver[Any], resource: referencing.Resource[Any]) -> Iterator[str]:
    """Every reference of `resource` and its subschemas that `resolver` cannot
    look up; each subschema resolves against its own base URI (`$id`)."""
    contents = resource.contents
    if isinstance(contents, dict):
        for keyword in REFERENCE_KEYWORDS:
            ref = contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                yield ref
    for subresource in resource.subresources():
        yield from _unresolvable(resolver.in_subresource(subresource), subresource)


def _plain(value: Any) -> Any:
    """A deep copy as plain dicts and lists (tomllib gives those already; a caller's
    mapping types would otherwise leak into jsonschema)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
