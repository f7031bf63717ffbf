"""A fake Microsoft Graph v1.0 (mail) and identity platform v2.0 for tests and benchmarks.

    async with FakeGraph(["alice@contoso.com"]) as fake:
        box = fake.mailbox("alice@contoso.com")
        box.add_files(sorted(corpus.glob("mime/mailgun-flanker/*.eml")))   # byte-exact
        # the real client: graph_url=fake.graph_url (…/v1.0), authority_url=
        # fake.authority_url, tenant fake.directory_id, app fake.client_id /
        # fake.client_secret; every mail request must send
        # Prefer: IdType="ImmutableId" (fake.strict_immutable)
        fake.move_message(message.immutable_id, "archive")   # REST id changes
        box.expire_delta_tokens("inbox")                     # next deltaLink → 410
        fake.faults.fail_message(message.immutable_id, 429)  # inner 429 in a $batch
        assert fake.counters.max_downloads() <= 1            # no body downloaded twice
        assert fake.counters.throttled["alice@contoso.com"] == 0   # no self-inflicted 429
        assert fake.counters.missing_immutable_total() == 0

Modules: server (FakeGraph, routes, Python helpers), state (users, folders,
messages, change log), resources (JSON shapes), delta (message delta rounds),
api (the mail API dispatcher: auth, Prefer, ids), batch ($batch), throttle
(Outlook's 10,000 per 10 min and 4 concurrent per mailbox), subscriptions
(webhooks, validation, notifications, lifecycle), identity (v2.0 token and
device code endpoints), faults, counters, testkit (ManualClock, Receiver,
request helpers).
"""

from .counters import Counters
from .errors import Answer, graph_error
from .faults import Faults
from .identity import DEVICE_CODE_GRANT, GRAPH_DEFAULT_SCOPE
from .server import FakeGraph
from .state import Folder, Mailbox, Message
from .testkit import ManualClock

__all__ = [
    "DEVICE_CODE_GRANT",
    "GRAPH_DEFAULT_SCOPE",
    "Answer",
    "Counters",
    "FakeGraph",
    "Faults",
    "Folder",
    "Mailbox",
    "ManualClock",
    "Message",
    "graph_error",
]
