"""The extraction dedup key and payload fingerprint of a message row.

pipeline/extraction/keys.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from inboxd.pipeline.extraction.keys import MessageIdentity

BASE = MessageIdentity(
    message_id=7,
    mailbox_id="support",
    provider="gmail",
    external_id="18c2f0a1b2",
    recorded_by_application=False,
    message_id_norm="abc@example.com",
    raw_sha256="f" * 64,
    content_fingerprint="c" * 64,
)


@pytest.mark.parametrize(
    ("provider", "external_id"),
    [
        ("gmail", "18c2f0a1b2"),
        ("outlook", "AAkALgAAAAAAHYQDEapmEc2byACqAC-EWg0A"),
        ("ses", "0100018c-ses-message-id"),
        ("imap", "INBOX:1700000000:42"),
    ],
)
def test_immutable_provider_ids_key_first(provider: str, external_id: str) -> None:
    ident = dataclasses.replace(BASE, provider=provider, external_id=external_id)
    assert ident.dedup_key == f"{provider}:support:{external_id}"


@pytest.mark.parametrize("provider", ["maildir", "import"])
def test_doors_without_provider_identity_key_by_message_id(provider: str) -> None:
    ident = dataclasses.replace(BASE, provider=provider, external_id="1700000000.M1P2.host")
    assert ident.dedup_key == "mid:abc@example.com"


def test_without_message_id_the_raw_sha256_then_the_row() -> None:
    no_mid = dataclasses.replace(BASE, provider="maildir", message_id_norm=None)
    assert no_mid.dedup_key == "sha256:" + "f" * 64
    nothing = dataclasses.replace(no_mid, raw_sha256=None)
    assert nothing.dedup_key == "row:7"


def test_rows_the_application_recorded_are_keyed_by_row() -> None:
    # their mailbox/external id change when the provider's copy is promoted over them
    recorded = dataclasses.replace(BASE, recorded_by_application=True, external_id="pending_1")
    assert recorded.dedup_key == "row:7"


def test_payload_fingerprint_falls_back_to_bytes_then_row() -> None:
    assert BASE.payload_fingerprint == "c" * 64
    no_fp = dataclasses.replace(BASE, content_fingerprint=None)
    assert no_fp.payload_fingerprint == "raw:" + "f" * 64
    assert dataclasses.replace(no_fp, raw_sha256=None).payload_fingerprint == "row:7"
