"""normalise_body's ASCII fast path gives exactly what the general path gives.

Fingerprints of stored messages were computed with the general path (NFKC, _URL with
IGNORECASE, [\\W_]+ removed, casefold); a message seen again must get the same one,
so the fast path is held to byte-equal output, not to "close enough".
"""

from __future__ import annotations

import string
import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from inboxd.pipeline import identity
from inboxd.pipeline.identity import normalise_body

URLISH = [
    "http://a.example/x?y=1",
    "HTTPS://B.example/Z",
    "hTTp:",
    "MailTo:Bob@Example.org",
    "cid:part1.AB@x",
    "CID:",
    "https",
    "mailto",
    "xhttp://y",
    "http:/<b>",
    "(http://in.parens)",
    "'mailto:q'",
    "]cid:z]",
    'https:"quoted"',
]


def reference(text: str | None) -> str:
    """The general path, for every input."""
    if not text:
        return ""
    text = unicodedata.normalize("NFKC", text)
    text = identity._URL.sub(" ", text)
    return identity._NON_WORD.sub("", text).casefold()


ascii_text = st.lists(
    st.one_of(st.text(alphabet=string.printable, max_size=30), st.sampled_from(URLISH)),
    max_size=20,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(ascii_text)
def test_ascii_bodies_normalise_as_the_general_path_does(text: str) -> None:
    assert normalise_body(text) == reference(text)


def test_every_ascii_character_and_url_form() -> None:
    for text in [*URLISH, "".join(map(chr, range(128))), " ".join(URLISH) * 3]:
        assert normalise_body(text) == reference(text), text


def test_corpus_bodies(corpus) -> None:
    from inboxd.pipeline.message import MessageData
    from inboxd.pipeline.mime.parse import parse_raw

    checked = 0
    for path in sorted((corpus / "mime").rglob("*.eml")):
        item = parse_raw(path.read_bytes(), tenant_id="t", mailbox_id="m")
        if isinstance(item, MessageData):
            for text in (item.text, item.html, item.subject):
                assert normalise_body(text) == reference(text), path
                checked += 1
    assert checked > 900
