"""adapters.files: which files an import reads, in which order, and the exact bytes.

Messages are corpus files (tests/corpus/mime); mbox files and Maildirs are
built from them in tmp_path, so every expected byte string is a corpus file.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from inboxd.adapters.files import SourceError, iter_messages, plan_import

# Three corpus messages that stress mbox framing: body lines starting with "From "
# (CRLF, ends with an empty line), an embedded postmark-like line, and a
# message/rfc822 part whose inner message starts with a postmark.
MBOX_SAMPLES = (
    "mikel-mail/error_emails__cant_parse_from.eml",
    "mailgun-flanker/complaints__yahoo.eml",
    "mikel-mail/attachment_emails__attachment_message_rfc822.eml",
)
# A corpus .eml whose first line is a "From " postmark.
POSTMARK_EML = "mikel-mail/plain_emails__raw_email.eml"
PLAIN_EMLS = (
    "axllent-mailpit/plain-text.eml",
    "axllent-mailpit/tags.eml",
    "axllent-mailpit/mime-attachment.eml",
)
POSTMARK = b"From MAILER-DAEMON Thu Jan  1 00:00:00 1970\n"
_FROM_LINE = re.compile(rb"(?m)^(>*From )")


def write_mbox(path: Path, messages: list[bytes], *, separator: bytes = b"\n") -> None:
    """mboxrd writer: postmark, ">"-quoted From lines, newline-terminated, separator."""
    with path.open("wb") as fh:
        for raw in messages:
            fh.write(POSTMARK)
            fh.write(_FROM_LINE.sub(rb">\1", raw))
            if not raw.endswith(b"\n"):
                fh.write(b"\n")
            fh.write(separator)


@pytest.fixture
def mime(corpus: Path) -> Path:
    return corpus / "mime"


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst


def _maildir(root: Path) -> Path:
    for part in ("cur", "new", "tmp"):
        (root / part).mkdir(parents=True)
    return root


def test_directory_walk_is_sorted_and_counts_skipped_files(mime: Path, tmp_path: Path) -> None:
    top = tmp_path / "in"
    _copy(mime / PLAIN_EMLS[0], top / "b.eml")
    _copy(mime / PLAIN_EMLS[1], top / "A" / "c.EML")
    _copy(mime / "axllent-mailpit" / "SOURCE.md", top / "notes.md")
    box = _maildir(top / "mdir")
    _copy(mime / PLAIN_EMLS[2], box / "cur" / "1.host:2,S")
    _copy(mime / MBOX_SAMPLES[0], box / "new" / "2.host")
    _copy(mime / MBOX_SAMPLES[1], box / "tmp" / "3.host")  # delivery in progress
    write_mbox(top / "z.mbox", [(mime / MBOX_SAMPLES[2]).read_bytes()])

    plan = plan_import([top])

    assert [(f.path.relative_to(top).as_posix(), f.kind) for f in plan.files] == [
        ("A/c.EML", "message"),
        ("b.eml", "message"),
        ("mdir/new/2.host", "maildir"),
        ("mdir/cur/1.host:2,S", "maildir"),
        ("z.mbox", "mbox"),
    ]
    assert plan.skipped == (top / "notes.md",)
    raws = [m.raw for m in iter_messages(plan)]
    assert raws == [
        (mime / name).read_bytes()
        for name in (PLAIN_EMLS[1], PLAIN_EMLS[0], MBOX_SAMPLES[0], PLAIN_EMLS[2], MBOX_SAMPLES[2])
    ]


def test_mbox_gives_back_the_exact_bytes(mime: Path, tmp_path: Path) -> None:
    originals = [(mime / name).read_bytes() for name in MBOX_SAMPLES]
    path = tmp_path / "archive"  # no extension: recognised by its first line
    write_mbox(path, originals)

    plan = plan_import([path])
    messages = list(iter_messages(plan))

    assert [f.kind for f in plan.files] == ["mbox"]
    assert [m.raw for m in messages] == originals
    assert [m.source_ref for m in messages] == [f"{path}#{n}" for n in (1, 2, 3)]
    assert sum(m.span_bytes for m in messages) == path.stat().st_size == plan.total_bytes


def test_mbox_unquotes_exactly_one_level(mime: Path, tmp_path: Path) -> None:
    # Variant of MBOX_SAMPLES[0] whose body lines already read ">From ": the writer
    # stores them as ">>From ", the reader must give ">From " back.
    original = (mime / MBOX_SAMPLES[0]).read_bytes().replace(b"\nFrom ", b"\n>From ")
    assert b"\n>From " in original
    path = tmp_path / "quoted.mbox"
    write_mbox(path, [original])

    assert b"\n>>From " in path.read_bytes()
    assert [m.raw for m in iter_messages(plan_import([path]))] == [original]


def test_mbox_without_blank_separator_lines_still_splits(mime: Path, tmp_path: Path) -> None:
    originals = [(mime / name).read_bytes() for name in MBOX_SAMPLES[1:]]
    path = tmp_path / "tight.mbox"
    write_mbox(path, originals, separator=b"")

    assert [m.raw for m in iter_messages(plan_import([path]))] == originals


def test_an_eml_starting_with_a_postmark_is_one_message(mime: Path, tmp_path: Path) -> None:
    src = mime / POSTMARK_EML
    assert src.read_bytes().startswith(b"From ")
    top = tmp_path / "in"
    _copy(src, top / "one.eml")

    plan = plan_import([top])

    assert [f.kind for f in plan.files] == ["message"]
    assert [m.raw for m in iter_messages(plan)] == [src.read_bytes()]


def test_explicit_file_is_read_whatever_its_name(mime: Path, tmp_path: Path) -> None:
    path = _copy(mime / PLAIN_EMLS[0], tmp_path / "message.txt")

    plan = plan_import([path])

    assert [(f.path, f.kind) for f in plan.files] == [(path, "message")]
    assert plan.skipped == ()


def test_a_file_reached_twice_is_read_once(mime: Path, tmp_path: Path) -> None:
    path = _copy(mime / PLAIN_EMLS[0], tmp_path / "in" / "a.eml")

    plan = plan_import([path, tmp_path / "in", path])

    assert [f.path for f in plan.files] == [path]


def test_symlinked_directories_are_not_followed(mime: Path, tmp_path: Path) -> None:
    _copy(mime / PLAIN_EMLS[0], tmp_path / "real" / "a.eml")
    top = tmp_path / "in"
    top.mkdir()
    (top / "link").symlink_to(tmp_path / "real", target_is_directory=True)

    plan = plan_import([top])

    assert plan.files == ()
    assert plan.skipped == (top / "link",)


def test_symlink_loops_and_dangling_links_are_skipped(mime: Path, tmp_path: Path) -> None:
    top = tmp_path / "in"
    good = _copy(mime / PLAIN_EMLS[0], top / "a.eml")
    (top / "self").symlink_to("self")  # ln -s self self: ELOOP, whatever its name
    (top / "loop.eml").symlink_to("loop.eml")
    (top / "gone.eml").symlink_to("nowhere.eml")
    box = _maildir(top / "Maildir")
    (box / "new" / "1700000000.M1P1.host").symlink_to("1700000000.M1P1.host")

    plan = plan_import([top])

    assert [f.path for f in plan.files] == [good]
    assert sorted(plan.skipped) == sorted(
        [
            box / "new" / "1700000000.M1P1.host",
            top / "gone.eml",
            top / "loop.eml",
            top / "self",
        ]
    )


def test_maildir_message_moved_to_cur_while_importing(mime: Path, tmp_path: Path) -> None:
    box = _maildir(tmp_path / "Maildir")
    _copy(mime / PLAIN_EMLS[0], box / "new" / "1700000000.M1P1.host")
    plan = plan_import([box])
    # A mail client reads it between our planning and our reading.
    os.rename(box / "new" / "1700000000.M1P1.host", box / "cur" / "1700000000.M1P1.host:2,S")

    assert [m.raw for m in iter_messages(plan)] == [(mime / PLAIN_EMLS[0]).read_bytes()]


def test_a_file_removed_after_planning_is_a_source_error(mime: Path, tmp_path: Path) -> None:
    path = _copy(mime / PLAIN_EMLS[0], tmp_path / "a.eml")
    plan = plan_import([path])
    path.unlink()

    with pytest.raises(SourceError, match=r"a\.eml"):
        list(iter_messages(plan))


def test_files_removed_after_planning_are_listed_as_vanished(mime: Path, tmp_path: Path) -> None:
    keep = _copy(mime / PLAIN_EMLS[0], tmp_path / "in" / "a.eml")
    archive = tmp_path / "in" / "b.mbox"
    write_mbox(archive, [(mime / PLAIN_EMLS[1]).read_bytes()])
    box = _maildir(tmp_path / "in" / "Maildir")
    delivered = _copy(mime / PLAIN_EMLS[2], box / "new" / "1700000000.M1P1.host")
    plan = plan_import([tmp_path / "in"])
    archive.unlink()
    delivered.unlink()
    vanished: list[str] = []

    raws = [m.raw for m in iter_messages(plan, vanished)]

    assert raws == [keep.read_bytes()]
    assert sorted(vanished) == sorted([str(archive), str(delivered)])


@pytest.mark.parametrize("name", ["missing.eml", "missing-dir/"])
def test_missing_path_is_a_one_line_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(SourceError) as info:
        plan_import([tmp_path / name])

    assert str(info.value) == f"{tmp_path / name}: no such file or directory"


def test_a_bad_path_fails_the_whole_plan(mime: Path, tmp_path: Path) -> None:
    good = _copy(mime / PLAIN_EMLS[0], tmp_path / "a.eml")

    with pytest.raises(SourceError, match="nope"):
        plan_import([good, tmp_path / "nope"])


def test_special_files_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    with pytest.raises(SourceError, match="not a regular file or directory"):
        plan_import([fifo])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_refused_before_reading(mime: Path, tmp_path: Path) -> None:
    path = _copy(mime / PLAIN_EMLS[0], tmp_path / "in" / "a.eml")
    path.chmod(0)

    with pytest.raises(SourceError, match="permission denied"):
        plan_import([tmp_path / "in"])


def test_no_path_at_all() -> None:
    with pytest.raises(SourceError, match="no path"):
        plan_import([])
