"""The msgraph-sdk (kiota) the real client uses talks to the fake: delta() rounds
followed with with_url, the `$value` content of a message, ids and Prefer
headers as the SDK sends them."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from fakes.graph import FakeGraph
from fakes.graph.testkit import ALICE

with warnings.catch_warnings():
    # kiota_abstractions warns at import (GetQueryParameters is deprecated): not ours.
    warnings.simplefilter("ignore", DeprecationWarning)
    msgraph = pytest.importorskip("msgraph")
    from kiota_abstractions.authentication import (
        AccessTokenProvider,
        AllowedHostsValidator,
        BaseBearerTokenAuthenticationProvider,
    )
    from kiota_abstractions.base_request_configuration import RequestConfiguration
    from msgraph.generated.users.item.mail_folders.item.messages.delta.delta_request_builder import (  # noqa: E501
        DeltaRequestBuilder,
    )
    from msgraph_core import GraphClientFactory  # type: ignore[import-untyped]


# The SDK's generated builders warn (DeprecationWarning) as they are imported lazily;
# importing them takes seconds, hence slow.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_sdk_delta_round_and_mime_content(fake: FakeGraph) -> None:
    class Token(AccessTokenProvider):
        def __init__(self, token: str) -> None:
            self.token = token

        async def get_authorization_token(self, uri: str, context: Any = None) -> str:
            return self.token

        def get_allowed_hosts_validator(self) -> AllowedHostsValidator:
            return AllowedHostsValidator([])

    messages = fake.mailbox(ALICE).add_generated(5)
    provider = BaseBearerTokenAuthenticationProvider(Token(fake.issue_access_token()))
    import httpx

    # No kept-alive connections: the SDK's transport chain leaves one open at close.
    own = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))
    async with GraphClientFactory.create_with_default_middleware(client=own) as http_client:
        adapter = msgraph.GraphRequestAdapter(provider, client=http_client)
        adapter.base_url = fake.graph_url  # before the client: builders copy it
        await check(msgraph.GraphServiceClient(request_adapter=adapter), fake, messages)


async def check(client: Any, fake: FakeGraph, messages: list[Any]) -> None:
    query = DeltaRequestBuilder.DeltaRequestBuilderGetQueryParameters(select=["subject"])
    config = RequestConfiguration(query_parameters=query)
    config.headers.add("Prefer", 'IdType="ImmutableId"')
    config.headers.add("Prefer", "odata.maxpagesize=2")
    delta = client.users.by_user_id(ALICE).mail_folders.by_mail_folder_id("inbox").messages.delta
    page = await delta.get(request_configuration=config)
    ids = [m.id for m in page.value]
    while page.odata_next_link:
        page = await delta.with_url(page.odata_next_link).get(request_configuration=config)
        ids += [m.id for m in page.value]
    assert page.odata_delta_link and sorted(ids) == sorted(m.immutable_id for m in messages)

    plain: RequestConfiguration[Any] = RequestConfiguration()
    plain.headers.add("Prefer", 'IdType="ImmutableId"')
    item = client.users.by_user_id(ALICE).messages.by_message_id(messages[0].immutable_id)
    assert await item.content.get(request_configuration=plain) == messages[0].raw
    assert fake.counters.missing_immutable_total() == 0
    assert fake.counters.calls_of("message.delta", ALICE) == 3
