"""Parsing in worker processes gives the same MessageData as parsing in place (corpus files)."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest

from inboxd.pipeline.message import DeadItem, MessageData
from inboxd.pipeline.mime import workers as parsing
from inboxd.pipeline.mime.workers import _dumps_parsed, parse_in_workers, parse_many

CORPUS_FILES = [
    "django-mailbox/message_with_utf8_attachment.eml",
    "mikel-mail/multi_charset__japanese_attachment_long_name.eml",
    "mime-tools-testmsgs/attachment-filename-encoding-Latin1.eml",
    "jhillyerd-enmime/testdata__low-quality__unk-charset-part.eml",
]


def raws(corpus: Path) -> list[bytes]:
    return [(corpus / "mime" / rel).read_bytes() for rel in CORPUS_FILES]


def test_the_workers_pickling_rebuilds_every_field(corpus: Path) -> None:
    items = parse_many(raws(corpus), "t", "m", "gmail", keep_raw=False)
    items.append(DeadItem("t", "m", "x", "unparsable", "detail", None, "sha"))
    assert any(isinstance(i, MessageData) and i.attachments and i.from_ for i in items)
    back = pickle.loads(_dumps_parsed(items))  # noqa: S301 - bytes made just above
    assert back == items
    assert [type(i) for i in back] == [type(i) for i in items]


@pytest.mark.slow  # starts a worker process
async def test_parse_in_workers_equals_parsing_in_place(corpus: Path) -> None:
    data = raws(corpus)
    in_place = parse_many(data, "t", "m", "gmail", keep_raw=True)
    assert await parse_in_workers(data, "t", "m", "gmail") == in_place


async def test_one_callers_chunks_are_parsed_side_by_side_and_kept_in_order(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two chunks must be in parse_many at the same time: a barrier of two parties
    # breaks (BrokenBarrierError) if the chunks ran one after another.
    monkeypatch.setattr(parsing, "PARSE_WORKERS", 2)
    monkeypatch.setattr(parsing, "_limiter", None)
    barrier = threading.Barrier(2, timeout=10)
    real = parsing.parse_many
    met: list[int] = []

    def side_by_side(chunk, *args, **kwargs):
        if not met:
            met.append(barrier.wait())
        return real(chunk, *args, **kwargs)

    monkeypatch.setattr(parsing, "parse_many", side_by_side)
    data = raws(corpus) * parsing.PARSE_CHUNK_SIZE  # 4 chunks

    items = await parse_in_workers(data, "t", "m", "gmail", in_thread=True)

    assert met, "no two chunks were parsed at once"
    assert items == real(data, "t", "m", "gmail", keep_raw=True)
