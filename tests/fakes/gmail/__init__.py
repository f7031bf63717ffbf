"""A fake Gmail (REST v1, batch, OAuth 2.0 token/authorize/certs) for tests and benchmarks.

    async with FakeGmail(["alice@example.com"]) as fake:
        box = fake.mailbox("alice@example.com")
        box.add_files(sorted(corpus.glob("mime/mailgun-flanker/*.eml")))
        refresh = fake.issue_refresh_token("alice@example.com")
        # the real client: api_url=fake.base_url (the host; paths are /gmail/v1/…
        # and /batch/gmail/v1), token_url=fake.token_url, certs_url=fake.certs_url,
        # OAuth client fake.client_id / fake.client_secret
        fake.faults.fail_message(message_id, 429)      # per-part 429 inside a batch
        box.expire_history()                            # next history.list → 404
        assert fake.counters.max_downloads() <= 1       # no body downloaded twice

Modules: server (FakeGmail, routes), state (mailboxes, history), listing
(messages.list / history.list), api (method dispatcher), batch (multipart),
oauth (token endpoint), quota (units per user per second), faults, counters,
testkit (ManualClock for quota/token time without sleeping, request helpers).
"""

from .counters import Counters
from .errors import Answer, google_error
from .faults import Faults
from .oauth import GMAIL_SCOPE, ServiceAccountKey, pkce_s256
from .quota import METHOD_UNITS, Quota
from .server import DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET, FakeGmail
from .state import Mailbox, Message
from .testkit import ManualClock

__all__ = [
    "DEFAULT_CLIENT_ID",
    "DEFAULT_CLIENT_SECRET",
    "GMAIL_SCOPE",
    "METHOD_UNITS",
    "Answer",
    "Counters",
    "FakeGmail",
    "Faults",
    "Mailbox",
    "ManualClock",
    "Message",
    "Quota",
    "ServiceAccountKey",
    "google_error",
    "pkce_s256",
]
