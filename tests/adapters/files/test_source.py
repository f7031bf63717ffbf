"""ImportSource's pages: what is already stored is never parsed again.

A re-import of a stored corpus must cost hashing and one query per page, not a
parse per message (issue 15). The `known` callable stands in for the database
query (pipeline.copies.known_copies, tested with the cascade); the parser is
watched through `pipeline.mime.workers.parse_many`, which every parse goes through.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Sequence
from pathlib import Path

import asyncpg
import pytest

from inboxd.adapters.files import ImportSource, PageRefs, plan_import
from inboxd.pipeline.message import MessageData
from inboxd.pipeline.mime import workers as parsing

NAMES = (
    "axllent-mailpit/plain-text.eml",
    "axllent-mailpit/tags.eml",
    "axllent-mailpit/mime-attachment.eml",
    "axllent-mailpit/mixed-attachment.eml",
)


@pytest.fixture
def files(corpus: Path, tmp_path: Path) -> list[Path]:
    out = []
    for i, name in enumerate(NAMES):
        path = tmp_path / "in" / f"m{i}.eml"
        path.parent.mkdir(exist_ok=True)
        shutil.copyfile(corpus / "mime" / name, path)
        out.append(path)
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def pages_of(source: ImportSource) -> list[tuple[list[MessageData], PageRefs]]:
    out = []
    async for page in source.pages(None):
        assert isinstance(page.context, PageRefs)
        out.append(([i for i in page.items if isinstance(i, MessageData)], page.context))
    return out


async def test_stored_messages_are_left_out_unparsed(
    files: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[bytes] = []
    real = parsing.parse_many

    def watched(raws: Sequence[bytes], *args: object, **kwargs: object) -> list:
        parsed.extend(raws)
        return real(raws, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(parsing, "parse_many", watched)
    asked: list[list[str]] = []
    stored = {sha(files[0]), sha(files[2])}

    async def known(ids: Sequence[str]) -> set[str]:
        asked.append(list(ids))
        return stored & set(ids)

    source = ImportSource(
        "acme", "inbox", plan_import([tmp_path / "in"]), parse_in_thread=True, known=known
    )
    [(items, refs)] = await pages_of(source)

    assert asked == [[sha(p) for p in files]]  # one question for the page
    assert sorted(parsed) == sorted([files[1].read_bytes(), files[3].read_bytes()])
    assert [i.external_id for i in items] == [sha(files[1]), sha(files[3])]
    assert refs.refs == [str(files[1]), str(files[3])]
    assert refs.known == 2
    assert refs.span_bytes == sum(p.stat().st_size for p in files)


async def test_a_page_of_stored_messages_has_no_items(files: list[Path], tmp_path: Path) -> None:
    async def known(ids: Sequence[str]) -> set[str]:
        return set(ids)

    source = ImportSource(
        "acme", "inbox", plan_import([tmp_path / "in"]), parse_in_thread=True, known=known
    )
    [(items, refs)] = await pages_of(source)

    assert (items, refs.refs, refs.known) == ([], [], len(files))


async def test_without_known_every_message_is_parsed(files: list[Path], tmp_path: Path) -> None:
    source = ImportSource("acme", "inbox", plan_import([tmp_path / "in"]), parse_in_thread=True)
    [(items, refs)] = await pages_of(source)

    assert [i.external_id for i in items] == [sha(p) for p in files]
    assert refs.known == 0


async def test_a_database_that_does_not_answer_the_lookup_means_parsing_the_page(
    files: list[Path], tmp_path: Path
) -> None:
    async def known(ids: Sequence[str]) -> set[str]:
        raise asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed")

    source = ImportSource(
        "acme", "inbox", plan_import([tmp_path / "in"]), parse_in_thread=True, known=known
    )
    [(items, refs)] = await pages_of(source)

    # the lookup only saves work: the page goes to ingest whole, which meets the outage
    assert [i.external_id for i in items] == [sha(p) for p in files]
    assert refs.known == 0


async def test_a_file_deleted_after_planning_is_skipped_and_listed(
    files: list[Path], tmp_path: Path
) -> None:
    source = ImportSource("acme", "inbox", plan_import([tmp_path / "in"]), parse_in_thread=True)
    files[1].unlink()  # expunged by a mail client between planning and reading

    [(items, refs)] = await pages_of(source)

    assert refs.refs == [str(files[0]), str(files[2]), str(files[3])]
    assert [i.external_id for i in items] == [sha(files[0]), sha(files[2]), sha(files[3])]
    assert source.vanished == [str(files[1])]
    assert source.read_error is None


async def test_a_read_error_keeps_what_was_read_before_it_in_the_same_page(
    files: list[Path], tmp_path: Path
) -> None:
    source = ImportSource("acme", "inbox", plan_import([tmp_path / "in"]), parse_in_thread=True)
    files[2].unlink()
    files[2].mkdir()  # opens, but reading it fails (EISDIR): not a vanished file

    [(items, refs)] = await pages_of(source)

    assert refs.refs == [str(files[0]), str(files[1])]
    assert [i.external_id for i in items] == [sha(files[0]), sha(files[1])]
    assert source.read_error is not None
    assert str(source.read_error).startswith(f"{files[2]}: ")
    assert source.vanished == []
