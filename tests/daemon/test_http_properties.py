"""Content the database cannot hold is the sender's error, never an outage.

Every HTTP route that takes a body, in process against a real PostgreSQL: the
ESP hook route of each scheme with correctly signed bodies, and
`POST /v1/outbound` with a valid token. Examples first (each bad input of the
hardening issue, with what is stored), then hypothesis over generated bodies
and fields — extreme times, long ids, deep nesting, NUL, lone surrogates,
wrong types — asserting the answer is 2xx or 4xx (never 5xx while the database
is up) and that a 4xx stored nothing. The apps are tests/daemon/esp_hooks_rig.py's
and http_rig.py's, the ones test_hooks and test_http serve.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import orjson
import pytest
from esp_hooks_rig import HookServer, hook, post_hook, serving_hooks, stored_events
from helpers.db import rows_in
from helpers.esp_signing import (
    SendGridSigner,
    SnsSigner,
    mailgun_body,
    mailgun_config,
    postmark_config,
    postmark_headers,
    ses_config,
    sign_standard,
    standard_config,
)
from http_rig import ACME, outbound_body, serving_api
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from inboxd.adapters.esp.registry import build_esp_receiver
from inboxd.daemon.webhooks.esp import DeliveryHook
from inboxd.pipeline.delivery.intake import SourcePolicy

pytestmark = pytest.mark.slow  # ~55 s: hundreds of signed requests, each against a fresh listener

#: Examples per route (each starts a listener, ~0.17 s): enough to meet every kind
#: of hostile value several times,
#: few enough that the file stays well under a minute.
EXAMPLES = 40
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
EXTREME_TIMES = ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"]
LONG_ID = "x" * 3000


def nested(depth: int) -> Any:
    value: Any = ["leaf"]
    for _ in range(depth):
        value = {"k": value}
    return value


@asynccontextmanager
async def all_schemes(
    pool, db_dsn, store
) -> AsyncIterator[tuple[HookServer, SendGridSigner, SnsSigner]]:
    sendgrid, sns = SendGridSigner(), SnsSigner()
    ses_receiver = build_esp_receiver("ses", {"id": "ses", **ses_config()}, str, fetch=sns.fetch())
    ses = DeliveryHook(
        tenant_id="acme",
        source_id="ses",
        receiver=ses_receiver,
        policy=SourcePolicy(ses_receiver.default_payload_fields),
    )
    async with serving_hooks(
        pool,
        db_dsn,
        store,
        sw=hook("sw", standard_config()),
        sg=hook("sg", sendgrid.config()),
        mg=hook("mg", mailgun_config()),
        pm=hook("pm", postmark_config()),
        ses=ses,
    ) as served:
        yield served, sendgrid, sns


def resend(created_at: Any = "2026-11-30T09:00:00Z", **data: Any) -> bytes:
    return json.dumps(
        {"type": "email.delivered", "created_at": created_at, "data": {"to": ["a@x.org"], **data}}
    ).encode()


def sg_event(n: int, **fields: Any) -> dict[str, Any]:
    return {
        "event": "delivered",
        "email": f"u{n}@x.org",
        "timestamp": int(time.time()),
        "sg_event_id": f"ev-{n}",
        "sg_message_id": "m.f.1",
        **fields,
    }


def postmark(**fields: Any) -> bytes:
    event = {
        "RecordType": "Delivery",
        "DeliveredAt": "2026-11-30T09:00:00Z",
        "Recipient": "a@x.org",
    }
    return json.dumps({**event, **fields}).encode()


def mailgun(**fields: Any) -> dict[str, Any]:
    return {"event": "delivered", "id": "mg-1", "timestamp": time.time(), **fields}


def ses_event(**mail: Any) -> dict[str, Any]:
    return {
        "eventType": "Delivery",
        "mail": {"messageId": "ses-1", "destination": ["a@x.org"], **mail},
        "delivery": {"recipients": ["a@x.org"], "timestamp": "2026-11-30T09:00:05Z"},
    }


# -- each bad input of the issue: the request's fault (4xx), nothing stored -------------


@pytest.mark.parametrize(
    "case",
    ["time_min", "time_max", "long_id", "deep_tags", "nul_id", "dup_id", "dup_signature"],
)
async def test_standard_webhooks_bad_input_is_refused_and_stores_nothing(
    pool, db_dsn, store, case: str
) -> None:
    body, msg_id, status = resend(), "msg_1", 400
    if case.startswith("time_"):
        body = resend(EXTREME_TIMES[case == "time_max"])
    elif case == "long_id":
        msg_id = LONG_ID
    elif case == "deep_tags":
        body = resend(tags=nested(300))
    elif case == "nul_id":
        body = resend(email_id="em\x00")
    headers = CIMultiDict(sign_standard(body, msg_id))
    if case == "dup_id":
        headers.add("webhook-id", "msg_2")
        status = 401
    elif case == "dup_signature":
        headers.add("webhook-signature", headers["webhook-signature"])
        status = 401
    async with all_schemes(pool, db_dsn, store) as (served, _, _):
        assert (await post_hook(served, "sw", body, headers))[0] == status
    assert await rows_in(pool, "delivery_events") == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"sg_event_id": LONG_ID},
        {"timestamp": -62135596800},
        {"timestamp": 253402300799},
        {"category": nested(300)},
        {"sg_event_id": "ev\x00"},
        {"smtp-id": "<" + LONG_ID + ">"},
    ],
    ids=["long_id", "time_min", "time_max", "deep_category", "nul_id", "long_smtp_id"],
)
async def test_sendgrid_bad_event_is_kept_safe_and_the_good_ones_stored(
    pool, db_dsn, store, bad: dict[str, Any]
) -> None:
    batch = [sg_event(1), sg_event(2, **bad), sg_event(3)]
    async with all_schemes(pool, db_dsn, store) as (served, sendgrid, _):
        body = json.dumps(batch).encode()
        assert await post_hook(served, "sg", body, CIMultiDict(sendgrid.headers(body))) == (
            200,
            {"stored": 3, "duplicates": 0},
        )
        # SendGrid's retry of the same batch is all duplicates, the bad event too
        body = json.dumps(batch).encode()
        assert (await post_hook(served, "sg", body, CIMultiDict(sendgrid.headers(body))))[1] == {
            "stored": 0,
            "duplicates": 3,
        }
    rows = await stored_events(pool)
    kinds = sorted((r["event_type"], r["provider_type"]) for r in rows)
    assert kinds == [
        ("delivered", "delivered"),
        ("delivered", "delivered"),
        ("unknown", "malformed:delivered"),
    ]
    (safe,) = [r for r in rows if r["event_type"] == "unknown"]
    # its own id when usable, else a fingerprint; never an address or message id
    assert safe["dedup_key"] == ("id:ev-2" if "sg_event_id" not in bad else safe["dedup_key"])
    assert safe["dedup_key"].startswith("fp:") == ("sg_event_id" in bad)
    assert (safe["recipient_hash"], safe["message_key"]) == ("", None)
    assert {r["dedup_key"] for r in rows} >= {"id:ev-1", "id:ev-3"}


async def test_sendgrid_repeated_headers_are_refused(pool, db_dsn, store) -> None:
    async with all_schemes(pool, db_dsn, store) as (served, sendgrid, _):
        body = json.dumps([sg_event(1)]).encode()
        for name in (
            "x-twilio-email-event-webhook-signature",
            "x-twilio-email-event-webhook-timestamp",
        ):
            headers = CIMultiDict(sendgrid.headers(body))
            headers.add(name, headers[name])
            assert (await post_hook(served, "sg", body, headers))[0] == 401
    assert await rows_in(pool, "delivery_events") == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"DeliveredAt": EXTREME_TIMES[0]},
        {"DeliveredAt": EXTREME_TIMES[1]},
        {"Metadata": nested(300)},
        {"MessageID": LONG_ID},
        {"Recipient": "a\x00@x.org"},
    ],
    ids=["time_min", "time_max", "deep_metadata", "long_message_id", "nul_recipient"],
)
async def test_postmark_bad_input_is_400_and_stores_nothing(
    pool, db_dsn, store, fields: dict[str, Any]
) -> None:
    async with all_schemes(pool, db_dsn, store) as (served, _, _):
        assert (await post_hook(served, "pm", postmark(**fields), CIMultiDict(postmark_headers())))[
            0
        ] == 400
        headers = CIMultiDict(postmark_headers())
        headers.add("authorization", headers["authorization"])
        assert (await post_hook(served, "pm", postmark(), headers))[0] == 401
    assert await rows_in(pool, "delivery_events") == 0


@pytest.mark.parametrize(
    "fields",
    [{"timestamp": -1.0}, {"timestamp": 253402300799}, {"id": LONG_ID}, {"tags": nested(300)}],
    ids=["time_min", "time_max", "long_id", "deep_tags"],
)
async def test_mailgun_bad_input_is_400_and_stores_nothing(
    pool, db_dsn, store, fields: dict[str, Any]
) -> None:
    async with all_schemes(pool, db_dsn, store) as (served, _, _):
        body = mailgun_body(mailgun(**fields))
        assert (
            await post_hook(served, "mg", body, CIMultiDict({"content-type": "application/json"}))
        )[0] == 400
    assert await rows_in(pool, "delivery_events") == 0


@pytest.mark.parametrize(
    "mail",
    [
        {"timestamp": EXTREME_TIMES[0]},
        {"messageId": LONG_ID},
        {"tags": nested(300)},
        {"commonHeaders": {"messageId": "<a\x00@b>"}},
    ],
    ids=["time_min", "long_message_id", "deep_tags", "nul_message_id"],
)
async def test_ses_bad_input_is_400_and_stores_nothing(
    pool, db_dsn, store, mail: dict[str, Any]
) -> None:
    event = ses_event(**mail)
    if "timestamp" in mail:
        del event["delivery"]["timestamp"]  # so mail.timestamp is the event time
    async with all_schemes(pool, db_dsn, store) as (served, _, sns):
        body = sns.notification(event)
        assert (await post_hook(served, "ses", body, CIMultiDict({"content-type": "text/plain"})))[
            0
        ] == 400
    assert await rows_in(pool, "delivery_events") == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("sent_at", EXTREME_TIMES[0]),
        ("sent_at", EXTREME_TIMES[1]),
        ("subject", "a\x00b"),
        ("text", "a\x00b"),
        ("thread_id", "pending_\x00"),
        ("placeholder_message_id", "pending_\x00"),
        ("message_id_header", "<a\x00@b>"),
        ("client_id", "c\x00"),
        ("esp_message_id", "é" * 900),
        ("subject", "ΐ" * 900),
        ("subject", []),
    ],
)
async def test_outbound_bad_field_is_422_naming_it(
    pool, db_dsn, store, make_mailbox, field: str, value: Any
) -> None:
    await make_mailbox("acme", "inbox", address="support@acme.test")
    async with serving_api(pool, db_dsn, store) as srv:
        async with srv.session.post(
            f"{srv.base}/v1/outbound", json=outbound_body(**{field: value}), headers=ACME
        ) as r:
            assert r.status == 422
            assert field in (await r.json())["fields"]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM messages") == 0


# -- properties: any signed body is answered 2xx or 4xx, and a 4xx stores nothing --------

# Header-safe text (no controls, so aiohttp's client sends it), long runs, non-ASCII.
header_text = st.one_of(
    st.text(
        st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_categories=["Cc"]),
        min_size=1,
        max_size=40,
    ),
    st.integers(200, 3000).map(lambda n: "i" * n),
)
# Body text: anything JSON can carry, lone surrogates and NUL included (json.dumps
# escapes them as \ud800 / \u0000, which is what a hostile sender would post).
body_text = st.one_of(
    st.text(st.characters(codec=None, categories=None), max_size=30),
    st.sampled_from(["", "\x00", "a\x00b", "\ud800", "x\udfff", LONG_ID]),
    st.integers(200, 3000).map(lambda n: "é" * n),
)
iso_time = st.one_of(
    st.sampled_from([*EXTREME_TIMES, "not a time", "2026-11-30T09:00:00Z"]),
    st.builds(
        lambda dt, minutes: (
            dt.isoformat() + f"{'+' if minutes >= 0 else '-'}"
            f"{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
        ),
        st.datetimes(),
        st.integers(-14 * 60, 14 * 60),
    ),
)
unix_time = st.one_of(
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False, allow_infinity=False),
    st.just(time.time()),
)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), body_text)
json_value = st.one_of(
    st.recursive(
        json_leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(body_text, inner, max_size=3),
        max_leaves=8,
    ),
    st.integers(0, 300).map(nested),
)
anything = st.one_of(json_value, body_text, iso_time, unix_time)


async def check_answer(
    pool: asyncpg.Pool, served: HookServer, source: str, body: bytes, headers
) -> None:
    before = await rows_in(pool, "delivery_events")
    status, answer = await post_hook(served, source, body, CIMultiDict(headers))
    assert 200 <= status < 500, (status, answer)
    if status >= 400:
        assert await rows_in(pool, "delivery_events") == before, answer


@PROPERTY
@given(
    msg_id=header_text,
    created_at=st.one_of(iso_time, anything),
    data=st.dictionaries(
        st.sampled_from(["email_id", "to", "tags", "bounce", "message_id", "headers"]),
        anything,
        max_size=4,
    ),
    kind=st.one_of(st.sampled_from(["email.delivered", "email.bounced", "x"]), body_text),
)
async def test_standard_webhooks_never_5xx(
    pool, db_dsn, store, msg_id, created_at, data, kind
) -> None:
    body = json.dumps({"type": kind, "created_at": created_at, "data": data}).encode()
    async with all_schemes(pool, db_dsn, store) as (served, _, _):
        await check_answer(pool, served, "sw", body, sign_standard(body, msg_id))


sg_fields = st.dictionaries(
    st.sampled_from(
        ["sg_event_id", "timestamp", "category", "smtp-id", "asm_group_id", "type", "email"]
    ),
    st.one_of(anything, header_text, unix_time),
    max_size=5,
)


@PROPERTY
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["delivered", "bounce", "group_unsubscribe"]), sg_fields),
        max_size=4,
    )
)
async def test_sendgrid_never_5xx_and_keeps_every_event(pool, db_dsn, store, events) -> None:
    batch = [{**sg_event(i, event=kind), **fields} for i, (kind, fields) in enumerate(events)]
    body = json.dumps(batch).encode()
    before = await rows_in(pool, "delivery_events")  # examples share the test's database
    async with all_schemes(pool, db_dsn, store) as (served, sendgrid, _):
        status, answer = await post_hook(served, "sg", body, CIMultiDict(sendgrid.headers(body)))
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:  # a lone surrogate escape: not Unicode, so not JSON text
        assert (status, await rows_in(pool, "delivery_events")) == (400, before), answer
        return
    assert status == 200, answer  # a batch of objects is always taken, bad events kept safe
    assert answer["stored"] + answer["duplicates"] == len(batch)


@PROPERTY
@given(
    fields=st.dictionaries(
        st.sampled_from(["DeliveredAt", "Metadata", "MessageID", "Recipient", "RecordType", "ID"]),
        st.one_of(anything, iso_time),
        max_size=4,
    )
)
async def test_postmark_never_5xx(pool, db_dsn, store, fields) -> None:
    async with all_schemes(pool, db_dsn, store) as (served, _, _):
        await check_answer(pool, served, "pm", postmark(**fields), postmark_headers())


@PROPERTY
@given(
    fields=st.dictionaries(
        st.sampled_from(["id", "timestamp", "tags", "recipient", "message", "event"]),
        st.one_of(anything, unix_time),
        max_size=4,
    ),
    token=st.one_of(st.just("t" * 50), header_text),
)
async def test_mailgun_never_5xx(pool, db_dsn, store, fields, token) -> None:
    body = mailgun_body(mailgun(**fields), token=token)
    async with all_schemes(pool, db_dsn, store) as (served, _, _):
        await check_answer(pool, served, "mg", body, {"content-type": "application/json"})


@PROPERTY
@given(
    mail=st.dictionaries(
        st.sampled_from(["messageId", "timestamp", "tags", "commonHeaders", "destination"]),
        st.one_of(anything, iso_time),
        max_size=4,
    ),
    message_id=header_text,
)
async def test_ses_never_5xx(pool, db_dsn, store, mail, message_id) -> None:
    async with all_schemes(pool, db_dsn, store) as (served, _, sns):
        body = sns.notification(ses_event(**mail), message_id=message_id)
        await check_answer(pool, served, "ses", body, {"content-type": "text/plain"})


@PROPERTY
@given(
    fields=st.dictionaries(
        st.sampled_from(
            [
                "subject",
                "text",
                "html",
                "thread_id",
                "placeholder_message_id",
                "message_id_header",
                "from_address",
                "sent_at",
                "client_id",
                "esp_message_id",
                "send_status",
            ]
        ),
        st.one_of(anything, iso_time, st.just("pending_" + "p" * 300)),
        max_size=4,
    )
)
async def test_outbound_never_5xx(pool, db_dsn, store, make_mailbox, fields) -> None:
    await make_mailbox("acme", "inbox", address="support@acme.test")
    body = json.dumps(outbound_body(**fields)).encode()
    async with serving_api(pool, db_dsn, store) as srv:
        async with srv.session.post(
            f"{srv.base}/v1/outbound",
            data=body,
            headers={**ACME, "Content-Type": "application/json"},
        ) as r:
            assert r.status in (200, 201, 400, 404, 409, 422), await r.text()
