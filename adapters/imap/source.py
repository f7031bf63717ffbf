"""The IMAP door's sync loop: new mail of each configured folder, in UID windows.

One sync run, per folder (in the configured order):

    EXAMINE folder (read-only) → UIDVALIDITY, UIDNEXT, HIGHESTMODSEQ
      ├─ the folder does not exist (EXAMINE NO, ImapFolderMissing), or the server
      │   will not open it (another NO: ImapFolderRefused) → skipped: the other
      │   folders sync; `degraded()` names it for the runner (last_error, and
      │   needs_attention once so FOLDER_MISSING_RUNS runs in a row, unless the
      │   refusal's code says it is temporary)
      ├─ the cursor knows the folder with another UIDVALIDITY, or the server forgot
      │   where it was (HIGHESTMODSEQ below the cursor's, NOMODSEQ after a modseq,
      │   UIDNEXT not above the cursor's last UID: a restored or rebuilt server) →
      │   CursorExpired with the cursor minus that folder (restart_from), the folder
      │   marked `reread`: the runner writes mailbox.cursor_reset and the folder is
      │   read again in full (ALL, whatever `backfill` says: mail that arrived while
      │   the cursor was stale is stored); UIDs stored already under the same
      │   UIDVALIDITY are not downloaded again, the rest comes back `duplicate`
      │   or `merged` through the cascade
      ├─ first sync (folder not in the cursor): UID SEARCH of the backfill window
      │   ("all": ALL, days: SINCE date, "none": nothing); the folder's position
      │   after it is UIDNEXT-1 as EXAMINE saw it, so mail arriving during a long
      │   backfill is new mail of the next run, never skipped
      └─ incremental: UID SEARCH UID last+1:* — a server answers `n:*` with the
          highest UID even when it is ≤ last (RFC 3501 §6.4.8), which is not new
          mail and is dropped here
      with QRESYNC (RFC 7162) the EXAMINE names the cursor's modseq and the server
      answers the UIDs expunged since (VANISHED): the first page records them on
      the stored copies (`removed`, reason expunged) before the cursor moves;
      without it, at most hourly, the folder's UIDs on the server are compared
      with the stored copies (one UID SEARCH, one index range scan)
    then windows of IMAP_WINDOW UIDs: UID FETCH BODY.PEEK[] (nothing marked read)
      → parse (worker process) → Page(cursor_after = the folder at the window's
      last UID). A window the server answers NO is fetched one UID at a time; a UID
      it will not deliver becomes a dead item (fetch_failed), which is settled and
      does not pin the cursor. A UID expunged since the search is simply gone.

External id: `folder:uidvalidity:uid`; the thread key comes from the headers; the
raw bytes are kept byte-exact. Folders with `direction = "outbound"` (Sent) store
outbound copies, which reconcile with `POST /v1/outbound` placeholders.

The connection is opened on the first run and kept between runs (reopened after
any failure or once the server closed it, closed by `aclose` when the runner
stops). A login refused without a response code is retried; LOGIN_REFUSED_ATTEMPTS
in a row make it an ImapAuthError. `watch` keeps a second connection in IDLE
(RFC 2177) on the first folder and rings the doorbell on new mail and expunges;
after a drop it reconnects with the backoff of adapters/imap/reconnect.py, after a
refused login every IDLE_REFUSED_RETRY_S (it never gives up while its runner lives).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import structlog

from inboxd.adapters.base import Page
from inboxd.adapters.imap.client import FolderState, ImapConnection
from inboxd.adapters.imap.config import Folder, ImapMailbox
from inboxd.adapters.imap.cursor import (
    FolderCursor,
    dump_cursor,
    load_cursor,
    load_reread,
    load_retired,
)
from inboxd.adapters.imap.errors import (
    ImapAuthError,
    ImapCertificateError,
    ImapFolderMissing,
    ImapFolderRefused,
    ImapLoginRefused,
    ImapNotTls,
    ImapProtocolError,
    ImapUnavailable,
)
from inboxd.adapters.imap.idle_slots import IdleSlots
from inboxd.adapters.imap.reconnect import IdleBackoff
from inboxd.adapters.overlap import overlapped_pages
from inboxd.pipeline.errors import CursorExpired
from inboxd.pipeline.message import AttachmentData, DeadItem, MessageData
from inboxd.pipeline.mime.workers import parse_in_workers
from inboxd.pipeline.outcomes import ItemResult

__all__ = ["ImapSource", "StoredUnder"]


@dataclass(slots=True)
class _Window:
    """One UID window downloaded, waiting to be parsed into its page."""

    raws: dict[int, bytes]
    dead: list[MessageData | DeadItem]
    cursor_after: str
    removed: dict[str, str]


# The external ids of the live stored copies under a prefix (pipeline/copies.py).
StoredUnder = Callable[[str], Awaitable[list[str]]]

log = structlog.get_logger(__name__)

# Without QRESYNC, expunges are found by comparing a folder's UIDs on the server
# (one UID SEARCH) with the stored copies (one index range scan) at most this often:
# an hour bounds the cost for a large folder to two cheap queries an hour.
EXPUNGE_SCAN_INTERVAL_S = 3600.0
# IDLE is ended and re-issued after this long: servers may drop an IDLE after 30
# minutes of inactivity (RFC 2177), so 25 leaves room for a slow round trip.
IDLE_RENEW_S = 25 * 60
# The IDLE watch tries again this long after a refused login or certificate (the
# sync run decides whether the mailbox needs attention; see `watch`).
IDLE_REFUSED_RETRY_S = 300.0
# A login answered NO without a response code this many times in a row (runs are
# 30 s, 60 s … apart: about a minute and a half) is a refused credential; fewer
# may be a server's passing trouble that does not say so (RFC 5530 codes are optional).
LOGIN_REFUSED_ATTEMPTS = 3
# A configured folder missing in this many sync runs in a row puts the mailbox in
# needs_attention (the other folders keep syncing): one or two runs may meet a
# folder another client is renaming or recreating.
FOLDER_MISSING_RUNS = 3
# A UID whose FETCH drops the connection this often, with the server answering a
# new connection each time, is a message the server cannot read: a dead item.
FETCH_ONE_ATTEMPTS = 2
_GONE = object()  # expunged between the search and the fetch
_UNDELIVERABLE = object()
# UIDs per UID FETCH and per page (one ingest transaction). 100 typical messages
# are ~0.5-1 MB on the wire: one round trip amortised over many messages, and a
# window small enough that a NO costs at most 100 single fetches.
IMAP_WINDOW = 100
# A mailbox past the IDLE bound polls at its interval; this when none is given
# (the tenant file's default poll_interval_s, daemon/config/tenant.py).
DEFAULT_POLL_INTERVAL_S = 60.0


class ImapSource:
    """The Source (adapters/base.py) for one IMAP account."""

    provider = "imap"

    def __init__(
        self,
        tenant_id: str,
        mailbox_id: str,
        mailbox: ImapMailbox,
        *,
        stored_under: StoredUnder | None = None,
        window: int = IMAP_WINDOW,
        idle_slots: IdleSlots | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self.tenant_id = tenant_id
        self.mailbox_id = mailbox_id
        self.mailbox = mailbox
        self.window = window
        self._idle_slots = idle_slots  # None: no bound (tests, one-off runs)
        self._poll_interval_s = poll_interval_s
        self._stored_under = stored_under
        self._connection: ImapConnection | None = None
        self._scanned: dict[str, float] = {}  # folder → when its expunge scan ran
        self._retired: dict[str, int] = {}  # this run's folders being read again
        self._reread: set[str] = set()  # folders to read in full after a reset
        self._refused = 0  # logins answered a code-less NO in a row
        self._missing: dict[str, int] = {}  # folder → runs in a row it was missing
        self._missing_now: dict[str, str] = {}  # folder → the last run's error
        self._passing: set[str] = set()  # of those, refused with a temporary code

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()

    async def watch(self, ring: Callable[[], None]) -> None:
        """IDLE on a connection of its own in the first configured folder (where new
        mail lands: INBOX by default) and ring the doorbell when the server reports
        new mail; polling covers the other folders. Needs `idle = true` and
        `max_connections` ≥ 2 (the sync keeps the other), and a free slot of the
        process's IDLE bound (adapters/imap/idle_slots.py): without one, ring every
        `poll_interval_s` and ask again."""
        if not self.mailbox.idle or self.mailbox.max_connections < 2:
            return
        bounded = False
        while self._idle_slots is not None and not self._idle_slots.try_take():
            if not bounded:
                log.info("imap_idle_bound_reached", max_imap_idle=self._idle_slots.limit)
                bounded = True
            await anyio.sleep(self._poll_interval_s)
            ring()
        try:
            await self._listen(ring)
        finally:
            if self._idle_slots is not None:
                self._idle_slots.give_back()

    async def _listen(self, ring: Callable[[], None]) -> None:
        """IDLE until cancelled, reconnecting; returns when the server has no IDLE."""
        folder = self.mailbox.folders[0].name
        backoff = IdleBackoff()
        while True:
            try:
                await self._idle_once(folder, ring, backoff)
                return  # the server has no IDLE: polling only
            except (ImapAuthError, ImapCertificateError, ImapNotTls) as exc:
                # Never return for good: the sync run is what reports a credential
                # (needs_attention stops this runner, and this watch with it), and
                # its pooled connection may never meet the refusal — a watch that
                # gave up left the mailbox "idle" without IDLE until a reload, its
                # new mail waiting for the poll (issue 22 #10). Retried slowly: a
                # wrong password tried often can lock the account.
                delay = IDLE_REFUSED_RETRY_S
                log.warning("imap_idle_refused", error=str(exc), retry_s=delay)
                # and a run, to find out now: in push mode the next poll may be a
                # day away, the mailbox "idle" while its mail waited
                ring()
            except (ImapUnavailable, ImapProtocolError) as exc:
                delay = backoff.next_delay()
                log.info("imap_idle_reconnect", error=str(exc), retry_s=round(delay, 3))
                if isinstance(exc, ImapLoginRefused | ImapProtocolError):
                    # the server answers but will not let us IDLE (a login refused
                    # without a code, the folder gone or refused): a run reports it
                    # (the refusals counted, the folder in the status) instead of
                    # waiting for the poll; a server that is down is left alone
                    ring()
            await anyio.sleep(delay)

    async def _idle_once(self, folder: str, ring: Callable[[], None], backoff: IdleBackoff) -> None:
        connection = await ImapConnection.open(self.mailbox)
        try:
            if "IDLE" not in connection.capabilities:
                log.info("imap_idle_unsupported", host=self.mailbox.host)
                return
            await connection.examine(folder)
            backoff.connected()
            ring()  # anything that arrived while we were not listening
            while True:
                if await connection.idle(IDLE_RENEW_S):
                    ring()
        finally:
            with anyio.CancelScope(shield=True):
                await connection.close()

    async def settle(self, page: Page, results: list[ItemResult]) -> None:  # noqa: ARG002
        return None  # the cursor is the only state; nothing to do on the server

    async def fetch_attachment(self, item: MessageData, attachment: AttachmentData) -> bytes:
        raise NotImplementedError("raw-MIME door: attachments arrive with the message")

    def degraded(self) -> tuple[str, bool] | None:
        """After a run that completed: the folders it could not read (the runner puts
        this in the status) and whether the mailbox needs attention for them."""
        if not self._missing_now:
            return None
        text = "; ".join(self._missing_now.values())
        lasting = any(
            self._missing[name] >= FOLDER_MISSING_RUNS
            for name in self._missing_now
            if name not in self._passing
        )
        return (
            f"folder missing or refused on the server (skipped, the others synced): {text}",
            lasting,
        )

    async def pages(self, cursor: str | None) -> AsyncGenerator[Page, None]:
        positions = load_cursor(cursor)
        self._retired = load_retired(cursor)
        self._reread = load_reread(cursor)
        self._missing_now = {}
        self._passing = set()
        try:
            for folder in self.mailbox.folders:
                try:
                    async for page in self._folder_pages(folder, positions):
                        yield page
                except (ImapFolderMissing, ImapFolderRefused) as exc:
                    # one folder gone or refused must not hold back the others (issue
                    # 22 #11): a failed run's throttle delayed them, IDLE's rings too
                    self._missing[folder.name] = self._missing.get(folder.name, 0) + 1
                    # the status names the folder and why in words that stay the
                    # same from run to run (the server's text, with its timings, is
                    # in the log line): an unchanged problem is recognised as such
                    if isinstance(exc, ImapFolderRefused):
                        code = f" [{exc.code}]" if exc.code else ""
                        self._missing_now[folder.name] = f"{folder.name!r} refused{code}"
                        if exc.temporary:
                            self._passing.add(folder.name)
                    else:
                        self._missing_now[folder.name] = f"{folder.name!r} missing"
                    log.warning("imap_folder_skipped", folder=folder.name, error=str(exc))
                    continue
                self._missing.pop(folder.name, None)
        except ImapUnavailable:
            await self.aclose()  # the next run reconnects
            raise

    async def _connect(self) -> ImapConnection:
        """The sync connection, opened again when a failure or the server closed it
        (a pooled connection a server restart dropped is never reused)."""
        if self._connection is None or self._connection.closed:
            try:
                self._connection = await ImapConnection.open(self.mailbox)
            except ImapLoginRefused as exc:
                self._refused += 1
                if self._refused >= LOGIN_REFUSED_ATTEMPTS:
                    raise ImapAuthError(f"{exc} ({self._refused} times in a row)") from exc
                raise
            self._refused = 0
        return self._connection

    def _cursor(self, positions: dict[str, FolderCursor]) -> str:
        return dump_cursor(positions, self._retired, self._reread)

    async def _folder_pages(
        self, folder: Folder, positions: dict[str, FolderCursor]
    ) -> AsyncGenerator[Page, None]:
        connection = await self._connect()
        known = positions.get(folder.name)
        since = (known.uidvalidity, known.modseq) if known and known.modseq else None
        state = await connection.examine(folder.name, since)
        if known is not None and (why := _forgotten(known, state)):
            rest = {name: p for name, p in positions.items() if name != folder.name}
            retired = dict(self._retired)
            if known.uidvalidity != state.uidvalidity:
                retired[folder.name] = known.uidvalidity
            raise CursorExpired(
                f"imap folder {folder.name!r}: {why}",
                restart_from=dump_cursor(rest, retired, self._reread | {folder.name}),
            )
        removed = {
            _external_id(folder, state, uid): "expunged"
            for uid in state.vanished
            if known is not None and uid <= known.last_uid
        }
        if known is not None and not connection.qresync:
            removed.update(await self._scan_expunged(connection, folder, state, known))
        end = (state.uidnext - 1) if state.uidnext else None
        if known is None:
            uids = await self._first_uids(connection, folder, state)
            floor = 0
        else:
            floor = known.last_uid
            uids = [u for u in await connection.search_uids("UID", f"{floor + 1}:*") if u > floor]
        if not uids:
            last = max(floor, end or 0)
            moved = known is None or (last, state.highestmodseq) != (known.last_uid, known.modseq)
            if known is None:
                removed.update(await self._retire(folder))
                self._reread.discard(folder.name)
            if moved or removed:
                positions[folder.name] = FolderCursor(state.uidvalidity, last, state.highestmodseq)
                yield Page(
                    items=[],
                    cursor_after=self._cursor(positions),
                    backfill=known is None,
                    removed=removed,
                )
            return
        backfill = known is None

        async def downloads() -> AsyncGenerator[_Window, None]:
            for start in range(0, len(uids), self.window):
                window = uids[start : start + self.window]
                raws, dead = await self._download_window(folder, state, window)
                final = start + self.window >= len(uids)
                last = max(window[-1], end or 0) if final and backfill else window[-1]
                # every page may carry this EXAMINE's modseq: the expunges before it
                # were reported by VANISHED and are recorded with the first page
                positions[folder.name] = FolderCursor(state.uidvalidity, last, state.highestmodseq)
                gone = dict(removed) if start == 0 else {}
                if final and backfill:
                    gone.update(await self._retire(folder))
                # the folder has a position now: its reset read goes on from there
                self._reread.discard(folder.name)
                yield _Window(raws, dead, self._cursor(positions), gone)

        async def finish(window: _Window) -> Page:
            return Page(
                items=await self._parse_window(folder, state, window.raws) + window.dead,
                cursor_after=window.cursor_after,
                backfill=backfill,
                removed=window.removed,
            )

        # the next window downloads while this one is parsed (adapters/overlap.py):
        # fetch then parse in turn left the parse worker idle a third of a backfill
        # (bench/README.md, imap.py)
        async for page in overlapped_pages(downloads(), finish):
            yield page

    async def _retire(self, folder: Folder) -> dict[str, str]:
        """After a folder was read again under a new UIDVALIDITY: its copies under the
        old one address nothing any more (the cascade linked the mail to the rows it
        had); recorded as gone, and the folder no longer retired."""
        old = self._retired.pop(folder.name, None)
        if old is None or self._stored_under is None:
            return {}
        stale = await self._stored_under(f"{folder.name}:{old}:")
        return dict.fromkeys(stale, "uidvalidity_changed")

    async def _scan_expunged(
        self, connection: ImapConnection, folder: Folder, state: FolderState, known: FolderCursor
    ) -> dict[str, str]:
        """Stored copies whose UID the server no longer has (servers without QRESYNC),
        at most every EXPUNGE_SCAN_INTERVAL_S per folder."""
        now = anyio.current_time()
        last = self._scanned.get(folder.name)
        if self._stored_under is None or (
            last is not None and now - last < EXPUNGE_SCAN_INTERVAL_S
        ):
            return {}
        prefix = _external_id(folder, state, 0)[:-1]  # "folder:uidvalidity:"
        stored = await self._stored_under(prefix)
        on_server = set(await connection.search_uids("UID", f"1:{max(known.last_uid, 1)}"))
        self._scanned[folder.name] = now
        gone: dict[str, str] = {}
        for external_id in stored:
            uid = external_id[len(prefix) :]
            if uid.isdigit() and int(uid) <= known.last_uid and int(uid) not in on_server:
                gone[external_id] = "expunged"
        return gone

    async def _fetch_one(self, folder: Folder, state: FolderState, uid: int) -> bytes | object:
        """One UID's bytes; _GONE when the server no longer has it (expunged since the
        search); _UNDELIVERABLE when it refuses it — answers NO, or drops a connection
        FETCH_ONE_ATTEMPTS times over it while a new one (the server is up) is had
        each time. A server that is down raises ImapUnavailable: the run fails."""
        for _ in range(FETCH_ONE_ATTEMPTS):
            connection = await self._selected(folder, state)
            try:
                one, ok = await connection.fetch_raw([uid])
            except ImapUnavailable:
                continue
            if uid in one:
                return one[uid]
            return _GONE if ok else _UNDELIVERABLE
        return _UNDELIVERABLE

    async def _selected(self, folder: Folder, state: FolderState) -> ImapConnection:
        """The connection with `folder` selected, reopened if a failure closed it; the
        folder must still be the one the run started with."""
        connection = await self._connect()
        if connection.selected != folder.name:
            again = await connection.examine(folder.name)
            if again.uidvalidity != state.uidvalidity:
                raise ImapUnavailable(
                    f"imap folder {folder.name!r}: UIDVALIDITY changed during the run"
                )
        return connection

    async def _first_uids(
        self, connection: ImapConnection, folder: Folder, state: FolderState
    ) -> list[int]:
        """A folder without a position: after a reset every UID not stored yet (mail
        that arrived while the cursor was stale is there whatever `backfill` says);
        on a mailbox's first sync, the backfill window."""
        if folder.name not in self._reread and folder.name not in self._retired:
            return await self._backfill_uids(connection)
        uids = await connection.search_uids("ALL")
        if self._stored_under is None:
            return uids
        prefix = _external_id(folder, state, 0)[:-1]  # "folder:uidvalidity:"
        stored = {eid[len(prefix) :] for eid in await self._stored_under(prefix)}
        return [uid for uid in uids if str(uid) not in stored]

    async def _backfill_uids(self, connection: ImapConnection) -> list[int]:
        backfill = self.mailbox.backfill
        if backfill == "none":
            return []
        if backfill == "all":
            return await connection.search_uids("ALL")
        since = self.mailbox.since()
        assert since is not None
        return await connection.search_uids("SINCE", since.strftime("%d-%b-%Y"))

    async def _download_window(
        self, folder: Folder, state: FolderState, uids: list[int]
    ) -> tuple[dict[int, bytes], list[MessageData | DeadItem]]:
        """The window's bytes by UID, and dead items for the UIDs the server refuses."""
        connection = await self._selected(folder, state)
        try:
            raws, ok = await connection.fetch_raw(uids)
        except ImapUnavailable:
            # the server going away, or one message it cannot read (Dovecot answers
            # an internal error reading one message with BYE): told apart below
            raws, ok = {}, False
        dead: list[MessageData | DeadItem] = []
        if not ok:  # find the UIDs the server will not deliver, one at a time
            for uid in (u for u in uids if u not in raws):
                raw = await self._fetch_one(folder, state, uid)
                if isinstance(raw, bytes):
                    raws[uid] = raw
                elif raw is _UNDELIVERABLE:
                    dead.append(
                        DeadItem(
                            self.tenant_id,
                            self.mailbox_id,
                            _external_id(folder, state, uid),
                            "fetch_failed",
                            f"the server would not deliver UID {uid} of {folder.name}",
                        )
                    )
        return raws, dead

    async def _parse_window(
        self, folder: Folder, state: FolderState, raws: dict[int, bytes]
    ) -> list[MessageData | DeadItem]:
        ordered = sorted(raws)
        parsed = await parse_in_workers(
            [raws[u] for u in ordered], self.tenant_id, self.mailbox_id, "imap"
        )
        items: list[MessageData | DeadItem] = []
        for uid, item in zip(ordered, parsed, strict=True):
            external_id = _external_id(folder, state, uid)
            if isinstance(item, DeadItem):
                items.append(dataclasses.replace(item, external_id=external_id))
                continue
            item.external_id = external_id
            item.direction = folder.direction
            item.labels = [folder.name]
            items.append(item)
        return items


def _forgotten(known: FolderCursor, state: FolderState) -> str | None:
    """Why the cursor's position no longer holds for the folder, or None: another
    UIDVALIDITY (RFC 3501 §2.3.1.1), or a server that forgot its state — modseqs
    never go down (RFC 7162 §3.1.1) and UIDs never go back: a lower HIGHESTMODSEQ,
    none at all after one, or a UIDNEXT at or below the last UID seen means a
    restored or rebuilt server, whose new mail may carry UIDs the cursor has passed."""
    if known.uidvalidity != state.uidvalidity:
        return f"UIDVALIDITY {known.uidvalidity} → {state.uidvalidity}"
    if known.modseq is not None and state.highestmodseq is None:
        return f"the server no longer reports a modseq (was {known.modseq})"
    if known.modseq is not None and state.highestmodseq is not None:
        if state.highestmodseq < known.modseq:
            return f"HIGHESTMODSEQ went back from {known.modseq} to {state.highestmodseq}"
    if state.uidnext is not None and state.uidnext <= known.last_uid:
        return f"UIDNEXT {state.uidnext} is not above the last UID seen, {known.last_uid}"
    return None


def _external_id(folder: Folder, state: FolderState, uid: int) -> str:
    return f"{folder.name}:{state.uidvalidity}:{uid}"
