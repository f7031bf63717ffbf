"""Fixtures of the extraction backend tests: corpus messages as MessageData."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime.parse import parse_raw

#: Corpus messages the tests read (tests/corpus/mime/…, never edited).
BOOKING = "jhillyerd-enmime/testdata__mail__mime-duplicate-param.eml"  # PDF invoice attached
TEXT_ATTACHMENTS = "php-mime-mail-parser/issue115.eml"  # HTML body, images, attachment.txt
SURVEY = "mikel-mail/error_emails__bad_subject.eml"  # HTML-only, digits in the subject


@pytest.fixture
def corpus_message(corpus: Path) -> Callable[[str], MessageData]:
    """`corpus_message("folder/file.eml")`: that corpus file parsed as a door would."""

    def load(name: str) -> MessageData:
        raw = (corpus / "mime" / name).read_bytes()
        message = parse_raw(raw, tenant_id="t", mailbox_id="m")
        assert isinstance(message, MessageData), name
        return message

    return load
