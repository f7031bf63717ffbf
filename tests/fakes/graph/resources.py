"""JSON shapes of the mail resources the fake serves, as the v1.0 reference draws them.

"message resource type" / "mailFolder resource type": camelCase properties,
`@odata.type` and `@odata.etag` annotations, DateTimeOffset as
`2026-01-01T00:00:00Z`, `from` and `sender` as {"emailAddress": {"name",
"address"}}. `$select` is honoured loosely: the listed properties plus `id`,
`parentFolderId` and the annotations (Graph always returns `id`; the fake adds
parentFolderId so a client can tell which folder an item is in).
"""

from __future__ import annotations

from .state import Folder, Mailbox, Message, graph_datetime

ALWAYS = frozenset({"@odata.type", "@odata.etag", "id", "parentFolderId"})


def message_id(message: Message, immutable: bool) -> str:
    return message.immutable_id if immutable else message.rest_id


def message_resource(
    message: Message, *, immutable: bool, select: frozenset[str] | None = None
) -> dict[str, object]:
    address = {"emailAddress": {"name": message.from_name, "address": message.from_address}}
    out: dict[str, object] = {
        "@odata.type": "#microsoft.graph.message",
        "@odata.etag": f'W/"{message.change_key}"',
        "id": message_id(message, immutable),
        "createdDateTime": graph_datetime(message.received),
        "lastModifiedDateTime": graph_datetime(message.received),
        "changeKey": message.change_key,
        "receivedDateTime": graph_datetime(message.received),
        "sentDateTime": graph_datetime(message.received),
        "hasAttachments": b"content-disposition: attachment" in message.raw.lower(),
        "internetMessageId": message.internet_message_id,
        "subject": message.subject,
        "parentFolderId": message.folder_id,
        "conversationId": message.conversation_id,
        "isRead": message.is_read,
        "isDraft": False,
        "from": address,
        "sender": address,
    }
    if select is not None:
        wanted = {s.lower() for s in select}
        out = {k: v for k, v in out.items() if k in ALWAYS or k.lower() in wanted}
    return out


def removed_resource(item_id: str, reason: str) -> dict[str, object]:
    """A delta entry for an item gone from the folder ("delta query overview":
    removed instances are their id and an @removed object with a reason)."""
    return {
        "@odata.type": "#microsoft.graph.message",
        "id": item_id,
        "@removed": {"reason": reason},
    }


def folder_resource(box: Mailbox, folder: Folder) -> dict[str, object]:
    inside = box.in_folder(folder.id)
    return {
        "id": folder.id,
        "displayName": folder.display_name,
        "parentFolderId": None,
        "childFolderCount": 0,
        "unreadItemCount": sum(1 for m in inside if not m.is_read),
        "totalItemCount": len(inside),
        "isHidden": False,
    }
