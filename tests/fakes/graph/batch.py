"""JSON batching: POST /v1.0/$batch with up to 20 requests, one 200 with their answers.

"Combine multiple HTTP requests using JSON batching" (json-batching):
- body {"requests": [{"id", "method", "url" (relative: "/users/…" or
  "users/…"), "headers"?, "body"?, "dependsOn"?}]}; ids unique (not
  case-sensitive), at most 20 requests: otherwise the whole batch is 400;
- answer 200 {"responses": [{"id", "status", "headers", "body"}]}, "Individual
  responses might appear in a different order than the requests"
  (faults.reverse_batch reverses them); a JSON body is embedded as JSON, any
  other body (the MIME of `$value`) as a base64 string, which is what Graph
  does (msgraph-sdk-php-core#103; the docs allow a "base64 URL-encoded value"
  body); a failing inner request has its own status (429 with Retry-After);
- headers: the batch's Authorization serves every inner request; every other
  header, Prefer included, is the inner request's own ("headers: … the
  key/value pair for the headers" per request; the page never says outer
  headers carry over), so IdType and maxpagesize are honoured per inner request;
- "Requests in a batch are evaluated individually against the applicable
  throttling limits" — each inner request counts toward its mailbox's window
  and takes a concurrency slot while it runs — and "Outlook service limits for
  JSON batching": "the service executes up to 4 requests in parallel at any
  point, irrespective of the target mailbox"; with `dependsOn` the batch runs
  sequentially, and a request whose dependency failed answers 424.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import anyio
from multidict import CIMultiDict

from .api import Call
from .errors import Answer, bad_request, graph_error

if TYPE_CHECKING:
    from .server import FakeGraph

MAX_BATCH_REQUESTS = 20  # json-batching: "currently limited to 20 individual requests"
BATCH_PARALLELISM = 4  # throttling-limits, Outlook service limits for JSON batching


class BatchError(Exception):
    """The batch as a whole is malformed: 400."""


def parse_requests(body: bytes) -> list[dict[str, Any]]:
    try:
        payload = json.loads(body or b"null")
    except ValueError as exc:
        raise BatchError("Invalid batch payload format.") from exc
    requests = payload.get("requests") if isinstance(payload, dict) else None
    if not isinstance(requests, list) or not requests:
        raise BatchError("Invalid batch payload format.")
    if len(requests) > MAX_BATCH_REQUESTS:
        raise BatchError(f"The maximum number of requests in a batch is {MAX_BATCH_REQUESTS}.")
    seen: set[str] = set()
    for request in requests:
        if not isinstance(request, dict) or not all(
            isinstance(request.get(k), str) for k in ("id", "method", "url")
        ):
            raise BatchError("Each request needs string id, method and url.")
        key = request["id"].lower()
        if key in seen:
            raise BatchError(f"Batch request id '{request['id']}' is not unique.")
        seen.add(key)
    return requests


def to_call(request: dict[str, Any], authorization: str) -> Call:
    url = str(request["url"])
    if url.startswith(("http://", "https://")):
        raise BatchError("The url of a batch request must be relative.")
    path, _, query = url.partition("?")
    if not path.startswith("/"):
        path = "/" + path
    headers: CIMultiDict[str] = CIMultiDict(
        (str(k), str(v)) for k, v in (request.get("headers") or {}).items()
    )
    if authorization:
        headers["Authorization"] = authorization
    params: dict[str, str] = {}
    for pair in query.split("&") if query else []:
        key, _, value = pair.partition("=")
        params[unquote(key)] = unquote(value)
    body = request.get("body")
    raw = json.dumps(body).encode() if isinstance(body, dict | list) else b""
    return Call(str(request["method"]).upper(), path, params, headers, raw)


def encode_response(request_id: str, answer: Answer) -> dict[str, Any]:
    body: object = None
    if answer.body:
        body = answer.json if answer.is_json else base64.b64encode(answer.body).decode()
    return {
        "id": request_id,
        "status": answer.status,
        "headers": dict(answer.headers),
        "body": body,
    }


async def run_batch(fake: FakeGraph, body: bytes, authorization: str) -> Answer:
    """The whole $batch: 400 for a malformed batch, else 200 with every response."""
    try:
        requests = parse_requests(body)
        calls = {r["id"]: to_call(r, authorization) for r in requests}
    except BatchError as exc:
        return bad_request(str(exc))
    fake.counters.batch_sizes.append(len(requests))
    answers: dict[str, Answer] = {}

    async def run_one(request_id: str) -> None:
        answers[request_id] = await fake.api.dispatch(calls[request_id])

    if any(r.get("dependsOn") for r in requests):
        for request in requests:  # "Batch should be either fully sequential or fully parallel"
            failed = [
                d for d in request.get("dependsOn") or [] if answers.get(d, _OK).status >= 400
            ]
            if failed:
                answers[request["id"]] = graph_error(
                    424, "FailedDependency", f"Dependency {failed[0]} failed."
                )
            else:
                await run_one(request["id"])
    else:
        limiter = anyio.CapacityLimiter(BATCH_PARALLELISM)

        async def limited(request_id: str) -> None:
            async with limiter:
                await run_one(request_id)

        async with anyio.create_task_group() as tg:
            for request in requests:
                tg.start_soon(limited, request["id"])
    ordered = [encode_response(r["id"], answers[r["id"]]) for r in requests]
    if fake.faults.reverse_batch:
        ordered.reverse()
    return Answer(
        200, json.dumps({"responses": ordered}).encode(), {"Content-Type": "application/json"}
    )


_OK = Answer(200)
