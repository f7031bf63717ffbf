-- inboxd schema: the product's interface to the application.
--
-- Applied by `inboxd migrate`; idempotent (every statement is IF NOT EXISTS or
-- CREATE OR REPLACE), so running it twice is a no-op.
--
-- Every table carries tenant_id, and every primary key, unique constraint and
-- foreign key includes it, so the schema can be distributed by tenant on a
-- sharded PostgreSQL (Citus) without a code change (docs/architecture.md §3). Every query
-- inboxd issues filters by tenant_id.

CREATE TABLE IF NOT EXISTS inboxd_schema_version (
    schema_sha256  text PRIMARY KEY,
    applied_at     timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE inboxd_schema_version IS 'Which schema.sql texts were applied (sha256), so an unchanged start takes no locks. Operational metadata: the one table without tenant_id.';
COMMENT ON COLUMN inboxd_schema_version.schema_sha256 IS 'sha256 of the schema.sql text that was applied.';
COMMENT ON COLUMN inboxd_schema_version.applied_at IS 'When it was (last) applied.';

CREATE TABLE IF NOT EXISTS inboxd_daemons (
    owner         text PRIMARY KEY,
    host          text NOT NULL,
    pid           integer NOT NULL,
    version       text NOT NULL,
    started_at    timestamptz NOT NULL,
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE inboxd_daemons IS 'Each running `inboxd run` process (replica), for `inboxd status`: written when its presence lock is taken, its heartbeat moved with every presence ping, removed at a clean stop. Operational metadata, like inboxd_schema_version: no tenant_id.';
COMMENT ON COLUMN inboxd_daemons.owner IS 'The lease owner id of the process (host:pid:random), as in mailboxes.lease_owner.';
COMMENT ON COLUMN inboxd_daemons.host IS 'Host name the process runs on.';
COMMENT ON COLUMN inboxd_daemons.pid IS 'Its process id on that host.';
COMMENT ON COLUMN inboxd_daemons.version IS 'The inboxd release it runs (`inboxd --version`).';
COMMENT ON COLUMN inboxd_daemons.started_at IS 'When the process started.';
COMMENT ON COLUMN inboxd_daemons.heartbeat_at IS 'Its last presence ping (every 10 s while it holds its presence lock); older than 30 s: the process is gone or cut off from the database.';

CREATE TABLE IF NOT EXISTS tenants (
    tenant_id   text PRIMARY KEY CHECK (tenant_id ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    name        text NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE tenants IS 'One organisation using inboxd. All other rows belong to exactly one tenant.';
COMMENT ON COLUMN tenants.tenant_id IS 'Stable id from the tenant config file (lower-case, safe in object-store keys).';
COMMENT ON COLUMN tenants.name IS 'Human-readable name, for operators.';
COMMENT ON COLUMN tenants.created_at IS 'When inboxd first saw this tenant.';

CREATE TABLE IF NOT EXISTS mailboxes (
    tenant_id           text NOT NULL REFERENCES tenants (tenant_id),
    mailbox_id          text NOT NULL CHECK (mailbox_id ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    provider            text NOT NULL,
    address             text NOT NULL DEFAULT '',
    sync_mode           text NOT NULL DEFAULT 'auto' CHECK (sync_mode IN ('push', 'poll', 'auto')),
    cursor              text,
    cursor_updated_at   timestamptz,
    sync_state          text NOT NULL DEFAULT 'idle',
    last_success_at     timestamptz,
    last_error          text,
    last_error_at       timestamptz,
    throttle_until      timestamptz,
    throttle_backoff_s  integer NOT NULL DEFAULT 0,
    cancel_requested    boolean NOT NULL DEFAULT false,
    lease_owner         text,
    lease_expires_at    timestamptz,
    lease_token         bigint NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, mailbox_id)
);
COMMENT ON TABLE mailboxes IS 'One connected source of mail for a tenant (Gmail/Outlook mailbox, IMAP account, forwarding address, Maildir, import target): what other helpdesks call an integration or channel.';
COMMENT ON COLUMN mailboxes.mailbox_id IS 'Stable id from the tenant config file.';
COMMENT ON COLUMN mailboxes.provider IS 'Door the mail comes through: gmail, outlook, ses, imap, maildir, import.';
COMMENT ON COLUMN mailboxes.address IS 'The mailbox''s own address, used to tell outbound from inbound mail.';
COMMENT ON COLUMN mailboxes.sync_mode IS 'push (provider notifications), poll (interval), auto (push, polled when push is quiet).';
COMMENT ON COLUMN mailboxes.cursor IS 'Provider sync position (Gmail historyId, Graph deltaLink, IMAP UIDVALIDITY:UID). Only moves forward, only past clean pages.';
COMMENT ON COLUMN mailboxes.cursor_updated_at IS 'When the cursor last moved.';
COMMENT ON COLUMN mailboxes.sync_state IS 'idle, syncing, backfilling, needs_attention (auth/config problem an operator must fix).';
COMMENT ON COLUMN mailboxes.last_success_at IS 'End of the last sync run that finished without error.';
COMMENT ON COLUMN mailboxes.last_error IS 'Last sync error, one line, no secrets.';
COMMENT ON COLUMN mailboxes.last_error_at IS 'When last_error happened.';
COMMENT ON COLUMN mailboxes.throttle_until IS 'No provider call before this time (Retry-After or exponential backoff).';
COMMENT ON COLUMN mailboxes.throttle_backoff_s IS 'Current backoff step in seconds (30 s .. 1 h); reset to 0 by one success.';
COMMENT ON COLUMN mailboxes.cancel_requested IS 'Set by `inboxd sync cancel`; a running sync stops between pages and clears it.';
COMMENT ON COLUMN mailboxes.lease_owner IS 'Process currently allowed to sync this mailbox.';
COMMENT ON COLUMN mailboxes.lease_expires_at IS 'The lease is free after this time unless renewed.';
COMMENT ON COLUMN mailboxes.lease_token IS 'Fencing token: increases on every new lease; cursor writes carry it so a stale owner is rejected.';
COMMENT ON COLUMN mailboxes.created_at IS 'When the mailbox was first configured.';

CREATE TABLE IF NOT EXISTS threads (
    tenant_id           text NOT NULL,
    thread_id           bigint GENERATED BY DEFAULT AS IDENTITY,
    mailbox_id          text NOT NULL,
    external_thread_id  text NOT NULL,
    subject             text NOT NULL DEFAULT '',
    message_count       integer NOT NULL DEFAULT 0,
    participant_count   integer NOT NULL DEFAULT 0,
    first_message_at    timestamptz,
    last_message_at     timestamptz,
    latest_message_id   bigint,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, thread_id),
    UNIQUE (tenant_id, mailbox_id, external_thread_id),
    FOREIGN KEY (tenant_id, mailbox_id) REFERENCES mailboxes (tenant_id, mailbox_id)
);
COMMENT ON TABLE threads IS 'A conversation in one mailbox, keyed by the provider''s thread id. Metadata columns are recomputed for every touched thread on every ingest batch.';
COMMENT ON COLUMN threads.thread_id IS 'inboxd''s id for the thread.';
COMMENT ON COLUMN threads.mailbox_id IS 'Mailbox the thread lives in.';
COMMENT ON COLUMN threads.external_thread_id IS 'Provider thread key (Gmail threadId, Graph conversationId); for raw-MIME doors derived from headers (first References entry, else In-Reply-To, else Message-ID, else a source-prefixed id); an application placeholder (pending_/draft_/new_/UUID) until the provider''s copy arrives.';
COMMENT ON COLUMN threads.subject IS 'Subject of the earliest message.';
COMMENT ON COLUMN threads.message_count IS 'Number of messages in the thread.';
COMMENT ON COLUMN threads.participant_count IS 'Distinct addresses across from/to/cc/bcc/reply-to of the thread''s messages.';
COMMENT ON COLUMN threads.first_message_at IS 'Earliest message time (sent_at, else received_at).';
COMMENT ON COLUMN threads.last_message_at IS 'Latest message time (sent_at, else received_at).';
COMMENT ON COLUMN threads.latest_message_id IS 'messages.message_id of the latest message.';
COMMENT ON COLUMN threads.created_at IS 'When the thread row was created.';
COMMENT ON COLUMN threads.updated_at IS 'When the thread metadata was last recomputed.';

CREATE TABLE IF NOT EXISTS messages (
    tenant_id            text NOT NULL,
    message_id           bigint GENERATED BY DEFAULT AS IDENTITY,
    mailbox_id           text NOT NULL,
    thread_id            bigint NOT NULL,
    external_id          text NOT NULL,
    direction            text NOT NULL DEFAULT 'inbound' CHECK (direction IN ('inbound', 'outbound')),
    send_status          text CHECK (send_status IN ('pending', 'sent', 'failed', 'synced')),
    internet_message_id  text,
    message_id_norm      text,
    in_reply_to          text,
    "references"         text[] NOT NULL DEFAULT '{}',
    subject              text NOT NULL DEFAULT '',
    subject_norm         text NOT NULL DEFAULT '',
    from_address         text NOT NULL DEFAULT '',
    from_name            text NOT NULL DEFAULT '',
    sent_at              timestamptz,
    received_at          timestamptz NOT NULL DEFAULT now(),
    text_body            text,
    html_body            text,
    html_key             text,
    has_attachments      boolean NOT NULL DEFAULT false,
    content_fingerprint  text,
    raw_sha256           text,
    raw_key              text,
    conflict_of          bigint,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, message_id),
    UNIQUE (tenant_id, mailbox_id, external_id),
    FOREIGN KEY (tenant_id, thread_id) REFERENCES threads (tenant_id, thread_id)
);
COMMENT ON TABLE messages IS 'One email, stored once however many mailboxes or providers it was seen through (message_copies lists each sighting).';
COMMENT ON COLUMN messages.message_id IS 'inboxd''s id for the message.';
COMMENT ON COLUMN messages.mailbox_id IS 'Mailbox of the primary copy.';
COMMENT ON COLUMN messages.thread_id IS 'Thread the message belongs to.';
COMMENT ON COLUMN messages.external_id IS 'Provider id of the primary copy (Gmail id, Graph id, IMAP UIDVALIDITY:UID, raw sha256 for content-addressed doors), or the application''s placeholder until its copy syncs back.';
COMMENT ON COLUMN messages.direction IS 'inbound, or outbound when sent by the mailbox owner / recorded by the application.';
COMMENT ON COLUMN messages.send_status IS 'For messages the application sends: pending, sent, failed; synced once the provider''s copy has been reconciled. NULL for received mail.';
COMMENT ON COLUMN messages.internet_message_id IS 'Message-ID header exactly as received (may be NULL: 145 corpus files have none).';
COMMENT ON COLUMN messages.message_id_norm IS 'Message-ID without angle brackets/whitespace, domain lower-cased. Not unique: senders reuse Message-IDs.';
COMMENT ON COLUMN messages.in_reply_to IS 'Normalised In-Reply-To.';
COMMENT ON COLUMN messages."references" IS 'Normalised References, oldest first.';
COMMENT ON COLUMN messages.subject IS 'Decoded subject.';
COMMENT ON COLUMN messages.subject_norm IS 'Subject with reply/forward prefixes stripped, whitespace collapsed, case-folded (matching key only).';
COMMENT ON COLUMN messages.from_address IS 'Sender address, lower-cased.';
COMMENT ON COLUMN messages.from_name IS 'Sender display name.';
COMMENT ON COLUMN messages.sent_at IS 'Date header (UTC); NULL when absent or unparseable.';
COMMENT ON COLUMN messages.received_at IS 'When the provider received it (or when inboxd did, for doors without that information).';
COMMENT ON COLUMN messages.text_body IS 'Plain-text body (decoded from its declared charset).';
COMMENT ON COLUMN messages.html_body IS 'HTML body, inline when small or when the object-store upload failed.';
COMMENT ON COLUMN messages.html_key IS 'Object-store key of a large HTML body (html_body is then NULL).';
COMMENT ON COLUMN messages.has_attachments IS 'True when the message has at least one attachment row.';
COMMENT ON COLUMN messages.content_fingerprint IS 'sha256 of normalised sender, subject, minute of sent_at and body text: equal for one message seen through two providers or line-ending styles, different for different content.';
COMMENT ON COLUMN messages.raw_sha256 IS 'sha256 of the raw MIME bytes of the primary copy, when the door had them; identifies bytes, not messages.';
COMMENT ON COLUMN messages.raw_key IS 'Object-store key of those raw bytes (byte-exact).';
COMMENT ON COLUMN messages.conflict_of IS 'Set when this message reuses the Message-ID of an earlier, different message (see ingest_conflicts).';
COMMENT ON COLUMN messages.created_at IS 'When inboxd stored the row.';
COMMENT ON COLUMN messages.updated_at IS 'When the row last changed (merge, promotion).';

-- The last tier of the dedup cascade: two concurrent ingests of one message
-- cannot both insert it (docs/architecture.md §3 tier 4). It is also the index every
-- Message-ID lookup of the cascade uses, so its predicate must not mention
-- content_fingerprint (a NULL fingerprint never conflicts anyway).
CREATE UNIQUE INDEX IF NOT EXISTS messages_mid_key
    ON messages (tenant_id, message_id_norm, content_fingerprint)
    WHERE message_id_norm IS NOT NULL;
DROP INDEX IF EXISTS messages_mid_fingerprint_key;  -- its predicate hid it from lookups
CREATE INDEX IF NOT EXISTS messages_thread_idx ON messages (tenant_id, thread_id);
-- Bodies of 1-3 KB push rows past the TOAST threshold; pglz compression was 54 %
-- of the insert time of messages, lz4 a third of that (bench/README.md).
DO $$ BEGIN
    IF current_setting('server_version_num')::int >= 140000 THEN
        ALTER TABLE messages ALTER COLUMN text_body SET COMPRESSION lz4;
        ALTER TABLE messages ALTER COLUMN html_body SET COMPRESSION lz4;
    END IF;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    NULL;  -- a server built without lz4 keeps pglz
END $$;
CREATE INDEX IF NOT EXISTS messages_outbound_idx ON messages (tenant_id, from_address, subject_norm)
    WHERE send_status IN ('pending', 'sent');

CREATE TABLE IF NOT EXISTS message_copies (
    tenant_id    text NOT NULL,
    mailbox_id   text NOT NULL,
    external_id  text NOT NULL,
    message_id   bigint NOT NULL,
    labels       text[] NOT NULL DEFAULT '{}',
    raw_sha256   text,
    raw_key      text,
    received_at  timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, mailbox_id, external_id),
    FOREIGN KEY (tenant_id, message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE,
    FOREIGN KEY (tenant_id, mailbox_id) REFERENCES mailboxes (tenant_id, mailbox_id)
);
COMMENT ON TABLE message_copies IS 'Each sighting of a message: one row per (mailbox, provider id). A re-sync finds its copy here and writes nothing.';
COMMENT ON COLUMN message_copies.mailbox_id IS 'Mailbox the copy was seen in.';
COMMENT ON COLUMN message_copies.external_id IS 'Provider id of the copy in that mailbox.';
COMMENT ON COLUMN message_copies.message_id IS 'The message this copy is.';
COMMENT ON COLUMN message_copies.labels IS 'Provider labels/folders of this copy.';
COMMENT ON COLUMN message_copies.raw_sha256 IS 'sha256 of this copy''s raw bytes (copies of one message may differ in bytes, e.g. line endings).';
COMMENT ON COLUMN message_copies.raw_key IS 'Object-store key of this copy''s raw bytes.';
COMMENT ON COLUMN message_copies.received_at IS 'When this copy arrived in its mailbox.';
COMMENT ON COLUMN message_copies.created_at IS 'When inboxd recorded the copy.';
CREATE INDEX IF NOT EXISTS message_copies_message_idx ON message_copies (tenant_id, message_id);
-- cascade tier 2b: the same bytes already in this mailbox under another id
CREATE INDEX IF NOT EXISTS message_copies_bytes_idx ON message_copies (tenant_id, mailbox_id, raw_sha256)
    WHERE raw_sha256 IS NOT NULL;

CREATE TABLE IF NOT EXISTS message_participants (
    tenant_id     text NOT NULL,
    message_id    bigint NOT NULL,
    role          text NOT NULL CHECK (role IN ('from', 'to', 'cc', 'bcc', 'reply_to')),
    position      smallint NOT NULL,
    address       text NOT NULL,
    display_name  text NOT NULL DEFAULT '',
    PRIMARY KEY (tenant_id, message_id, role, position),
    FOREIGN KEY (tenant_id, message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE
);
COMMENT ON TABLE message_participants IS 'Addresses on a message, one row per address per header.';
COMMENT ON COLUMN message_participants.role IS 'Header: from, to, cc, bcc, reply_to.';
COMMENT ON COLUMN message_participants.position IS 'Order within that header, from 0.';
COMMENT ON COLUMN message_participants.address IS 'Address, lower-cased (may be empty for a group or unparseable entry with a name).';
COMMENT ON COLUMN message_participants.display_name IS 'Decoded display name.';
CREATE INDEX IF NOT EXISTS message_participants_address_idx ON message_participants (tenant_id, address);

CREATE TABLE IF NOT EXISTS attachments (
    tenant_id      text NOT NULL,
    attachment_id  bigint GENERATED BY DEFAULT AS IDENTITY,
    message_id     bigint NOT NULL,
    position       smallint NOT NULL,
    filename       text NOT NULL DEFAULT '',
    content_type   text NOT NULL DEFAULT 'application/octet-stream',
    disposition    text NOT NULL DEFAULT 'attachment',
    content_id     text,
    size_bytes     bigint NOT NULL DEFAULT 0,
    sha256         text,
    storage_key    text,
    stored         boolean NOT NULL DEFAULT false,
    store_error    text,
    provider_ref   text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, attachment_id),
    UNIQUE (tenant_id, message_id, position),
    FOREIGN KEY (tenant_id, message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE
);
COMMENT ON TABLE attachments IS 'Attachments and inline parts of a message. Bytes live in the object store under storage_key.';
COMMENT ON COLUMN attachments.position IS 'Order of the part in the message, from 0.';
COMMENT ON COLUMN attachments.filename IS 'Decoded file name (RFC 2231/2047), may be empty.';
COMMENT ON COLUMN attachments.content_type IS 'Declared MIME type.';
COMMENT ON COLUMN attachments.disposition IS 'attachment or inline.';
COMMENT ON COLUMN attachments.content_id IS 'Content-ID for inline parts referenced from HTML (cid:).';
COMMENT ON COLUMN attachments.size_bytes IS 'Decoded size in bytes.';
COMMENT ON COLUMN attachments.sha256 IS 'sha256 of the decoded bytes.';
COMMENT ON COLUMN attachments.storage_key IS 'Object-store key (deterministic: att/<tenant>/<sha256>).';
COMMENT ON COLUMN attachments.stored IS 'True once the bytes are in the object store; false rows are retried on the next sighting.';
COMMENT ON COLUMN attachments.store_error IS 'Why the last store attempt failed.';
COMMENT ON COLUMN attachments.provider_ref IS 'Provider attachment id for lazy fetch (Gmail attachmentId, Graph attachment id).';
COMMENT ON COLUMN attachments.created_at IS 'When the row was created.';
CREATE INDEX IF NOT EXISTS attachments_unstored_idx ON attachments (tenant_id, message_id) WHERE NOT stored;

CREATE TABLE IF NOT EXISTS ingest_conflicts (
    tenant_id            text NOT NULL,
    conflict_id          bigint GENERATED BY DEFAULT AS IDENTITY,
    message_id_norm      text NOT NULL,
    existing_message_id  bigint NOT NULL,
    new_message_id       bigint NOT NULL,
    reason               text NOT NULL,
    created_at           timestamptz NOT NULL DEFAULT now(),
    resolved_at          timestamptz,
    resolution           text,
    PRIMARY KEY (tenant_id, conflict_id),
    UNIQUE (tenant_id, new_message_id),
    FOREIGN KEY (tenant_id, existing_message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE,
    FOREIGN KEY (tenant_id, new_message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE
);
COMMENT ON TABLE ingest_conflicts IS 'Two different messages with the same Message-ID. Both are stored; nothing is dropped or overwritten. For review.';
COMMENT ON COLUMN ingest_conflicts.message_id_norm IS 'The shared, normalised Message-ID.';
COMMENT ON COLUMN ingest_conflicts.existing_message_id IS 'The message that had the Message-ID first.';
COMMENT ON COLUMN ingest_conflicts.new_message_id IS 'The later, different message.';
COMMENT ON COLUMN ingest_conflicts.reason IS 'Why they were judged different (content fingerprint mismatch).';
COMMENT ON COLUMN ingest_conflicts.created_at IS 'When the conflict was detected.';
COMMENT ON COLUMN ingest_conflicts.resolved_at IS 'When someone reviewed it.';
COMMENT ON COLUMN ingest_conflicts.resolution IS 'What the reviewer decided.';

CREATE TABLE IF NOT EXISTS dead_items (
    tenant_id     text NOT NULL,
    dead_item_id  bigint GENERATED BY DEFAULT AS IDENTITY,
    mailbox_id    text NOT NULL,
    external_id   text NOT NULL,
    reason        text NOT NULL,
    detail        text NOT NULL DEFAULT '',
    raw_sha256    text,
    raw_key       text,
    attempts      integer NOT NULL DEFAULT 1,
    created_at    timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    resolved_at   timestamptz,
    PRIMARY KEY (tenant_id, dead_item_id),
    UNIQUE (tenant_id, mailbox_id, external_id),
    FOREIGN KEY (tenant_id, mailbox_id) REFERENCES mailboxes (tenant_id, mailbox_id)
);
COMMENT ON TABLE dead_items IS 'Items that could not be ingested (unparseable, deleted before fetch). They do not pin the cursor; the raw bytes are kept for replay.';
COMMENT ON COLUMN dead_items.external_id IS 'Provider id (or raw sha256) of the item.';
COMMENT ON COLUMN dead_items.reason IS 'Short machine-readable reason, e.g. no_header, empty, fetch_gone.';
COMMENT ON COLUMN dead_items.detail IS 'One-line human explanation.';
COMMENT ON COLUMN dead_items.raw_sha256 IS 'sha256 of the raw bytes, when there were any.';
COMMENT ON COLUMN dead_items.raw_key IS 'Object-store key of the raw bytes.';
COMMENT ON COLUMN dead_items.attempts IS 'How many times the item was seen and failed.';
COMMENT ON COLUMN dead_items.created_at IS 'First failure.';
COMMENT ON COLUMN dead_items.last_seen_at IS 'Latest failure.';
COMMENT ON COLUMN dead_items.resolved_at IS 'When it was replayed successfully or dismissed.';

CREATE TABLE IF NOT EXISTS events (
    tenant_id    text NOT NULL,
    event_id     bigint GENERATED BY DEFAULT AS IDENTITY,
    kind         text NOT NULL,
    mailbox_id   text,
    thread_id    bigint,
    message_id   bigint,
    payload      jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, event_id)
);
COMMENT ON TABLE events IS 'Transactional outbox for the application: written in the same transaction as the rows it announces, then NOTIFY inboxd_events. Read in event_id order per tenant.';
COMMENT ON COLUMN events.event_id IS 'Increasing id; resume after the last one you processed.';
COMMENT ON COLUMN events.kind IS 'message.created, message.merged, thread.created, ingest.conflict, mailbox.sync_completed, ...';
COMMENT ON COLUMN events.mailbox_id IS 'Mailbox concerned, if any.';
COMMENT ON COLUMN events.thread_id IS 'Thread concerned, if any.';
COMMENT ON COLUMN events.message_id IS 'Message concerned, if any.';
COMMENT ON COLUMN events.payload IS 'Event details (ids, counts); never bodies.';
COMMENT ON COLUMN events.created_at IS 'Commit time of the change.';

-- Poll scheduling (pipeline/mailbox/scheduling.py claim_due). Added after the table existed,
-- so applying this file to an older database adds them.
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS poll_interval_s double precision NOT NULL DEFAULT 300
    CHECK (poll_interval_s > 0);
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS last_polled_at timestamptz;
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS next_poll_at timestamptz;
COMMENT ON COLUMN mailboxes.poll_interval_s IS 'Seconds between polls (poll mode), or how long push may stay quiet before a poll (auto mode). From the tenant config.';
COMMENT ON COLUMN mailboxes.last_polled_at IS 'When a poll scanner last claimed the mailbox; it is due again poll_interval_s after the later of this and the start of its last clean sync run (sync_started_at).';
COMMENT ON COLUMN mailboxes.next_poll_at IS 'Claim cooldown: no scanner claims the mailbox again before this time (keeps overlapping scanners and replicas from double-scheduling).';
-- The start of a sync run (its lease acquisition): a clean run's start is when the
-- mailbox was last known in sync, and its next poll is due an interval after that, not
-- after the run's end (issue 25: counting from the end stretched every period by the
-- run's length). Added after the table existed.
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS sync_started_at timestamptz;
COMMENT ON COLUMN mailboxes.sync_started_at IS 'When the latest sync run took the lease. When last_success_at is later, that run was clean and the mailbox was in sync as of this time.';

-- Presence of a lease holder (pipeline/mailbox/leases.py): the key of the session-level
-- advisory lock it holds; when the lock is gone, so is the holder. Added after the
-- table existed, so applying this file to an older database adds it.
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS lease_session_key bigint;
COMMENT ON COLUMN mailboxes.lease_session_key IS 'Key of the advisory lock the lease holder keeps on a connection while it lives; absent from pg_locks means the holder is gone and the lease may be taken before it expires.';

-- Push bookkeeping (pipeline/mailbox/scheduling.py record_push): auto mode polls a mailbox
-- only once its pushes have been quiet. Added after the table existed.
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS last_push_at timestamptz;
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS push_hint text;
COMMENT ON COLUMN mailboxes.last_push_at IS 'When a provider last pushed a change for this mailbox (Pub/Sub, Graph notification); auto mode polls only after [sync] push_quiet_after_s without one.';
COMMENT ON COLUMN mailboxes.push_hint IS 'What the last push said, as the provider gave it (Gmail: the notification''s historyId); a hint for the next sync, never a cursor.';

-- Gmail's users.watch (adapters/gmail/source.py renews it before it lapses; the
-- registry records each renewal). Added after the table existed.
ALTER TABLE mailboxes ADD COLUMN IF NOT EXISTS watch_expires_at timestamptz;
COMMENT ON COLUMN mailboxes.watch_expires_at IS 'When the mailbox''s push channel lapses unless renewed: Gmail''s users.watch as Gmail answered the last renewal, or the earliest expiry of an Outlook mailbox''s Graph subscriptions; NULL when never watched (no [gmail] topic or [outlook] notification_url, or no sync yet).';

-- A copy that left its mailbox (pipeline/copies.py record_removed): the message row
-- stays. Added after the table existed.
ALTER TABLE message_copies ADD COLUMN IF NOT EXISTS removed_at timestamptz;
ALTER TABLE message_copies ADD COLUMN IF NOT EXISTS removal_reason text;
COMMENT ON COLUMN message_copies.removed_at IS 'When the copy left its mailbox (deleted at the provider, or in no synced label/folder any more); NULL while it is there.';
COMMENT ON COLUMN message_copies.removal_reason IS 'Why it left: deleted, unlabelled, expunged.';

-- The sending provider's id of an outbound message, for correlating its delivery
-- events (Postmark MessageID, Resend email_id, SES messageId …). Added after the
-- table existed, so applying this file to an older database adds it.
ALTER TABLE messages ADD COLUMN IF NOT EXISTS esp_message_id text;
COMMENT ON COLUMN messages.esp_message_id IS 'Outbound only: the sending provider''s id of this message (as its API answered the send), when the application recorded it; delivery events are correlated by it or by Message-ID.';
CREATE INDEX IF NOT EXISTS messages_esp_message_idx ON messages (tenant_id, esp_message_id)
    WHERE esp_message_id IS NOT NULL;

-- Delivery events (ESP webhooks; pipeline/delivery/). Persisted first, processed after.
CREATE TABLE IF NOT EXISTS delivery_events (
    tenant_id           text NOT NULL REFERENCES tenants (tenant_id),
    event_id            bigint GENERATED BY DEFAULT AS IDENTITY,
    source              text NOT NULL,
    dedup_key           text NOT NULL,
    provider            text NOT NULL,
    provider_type       text NOT NULL,
    event_type          text NOT NULL CHECK (event_type IN ('accepted', 'delivered', 'deferred',
                            'bounced', 'complained', 'opened', 'clicked', 'unsubscribed',
                            'suppressed', 'rejected', 'unknown')),
    occurred_at         timestamptz NOT NULL,
    received_at         timestamptz NOT NULL DEFAULT now(),
    provider_message_id text,
    message_id_norm     text,
    message_key         text,
    message_id          bigint,
    recipient           text,
    recipient_hash      text NOT NULL DEFAULT '',
    bounce_type         text CHECK (bounce_type IN ('permanent', 'transient', 'undetermined')),
    bounce_subtype      text,
    list_id             text,
    payload             jsonb NOT NULL DEFAULT '{}',
    state               text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'applied', 'dead')),
    attempts            integer NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz NOT NULL DEFAULT now(),
    last_error          text,
    applied_at          timestamptz,
    PRIMARY KEY (tenant_id, event_id),
    UNIQUE (tenant_id, source, dedup_key)
);
COMMENT ON TABLE delivery_events IS 'Every verified delivery event of a sending provider, stored before the webhook is answered; the log that evidence and suppressions are derived from.';
COMMENT ON COLUMN delivery_events.source IS 'The delivery source id from the tenant config ([[delivery_sources]] id).';
COMMENT ON COLUMN delivery_events.dedup_key IS 'id:<provider event id> (webhook-id, SNS MessageId, sg_event_id, Mailgun event id), or fp:<sha256 of the provider type and event object> when the provider has no event id. A second delivery of the same event is not stored again.';
COMMENT ON COLUMN delivery_events.provider IS 'Provider scheme: standard_webhooks, ses, sendgrid, mailgun, postmark.';
COMMENT ON COLUMN delivery_events.provider_type IS 'The provider''s own event type, as sent (e.g. email.bounced, Bounce, dropped).';
COMMENT ON COLUMN delivery_events.event_type IS 'Normalised type; unknown keeps the provider type in provider_type.';
COMMENT ON COLUMN delivery_events.occurred_at IS 'When the event happened, from the signed content (received_at when the provider gives no time). Evidence is ordered by it.';
COMMENT ON COLUMN delivery_events.received_at IS 'When inboxd received and stored it.';
COMMENT ON COLUMN delivery_events.provider_message_id IS 'The provider''s id of the sent message (SES messageId, SendGrid X-Message-Id, Postmark MessageID, Resend email_id).';
COMMENT ON COLUMN delivery_events.message_id_norm IS 'Normalised RFC 5322 Message-ID of the sent message, when the event carries it.';
COMMENT ON COLUMN delivery_events.message_key IS 'What evidence is grouped by: provider_message_id, else mid:<message_id_norm>; NULL when the event names no message.';
COMMENT ON COLUMN delivery_events.message_id IS 'messages.message_id of the outbound message, when correlated (by Message-ID), set when the event is applied.';
COMMENT ON COLUMN delivery_events.recipient IS 'Recipient address, only when the source keeps addresses (recipients = "keep"); NULL when hashed.';
COMMENT ON COLUMN delivery_events.recipient_hash IS 'sha256 hex of the trimmed lower-cased recipient address; empty when the event names none.';
COMMENT ON COLUMN delivery_events.bounce_type IS 'permanent, transient or undetermined (bounces only). Only permanent suppresses.';
COMMENT ON COLUMN delivery_events.bounce_subtype IS 'The provider''s bounce sub-type or code.';
COMMENT ON COLUMN delivery_events.list_id IS 'List or purpose an unsubscribe applies to (SendGrid asm group, Postmark stream, SES topic); NULL: the whole source.';
COMMENT ON COLUMN delivery_events.payload IS 'The provider event minimised to the source''s field allowlist; never bodies.';
COMMENT ON COLUMN delivery_events.state IS 'pending (to apply), applied (evidence and suppressions derived), dead (failed max attempts; inboxd events replay --dead re-queues).';
COMMENT ON COLUMN delivery_events.attempts IS 'Apply attempts so far.';
COMMENT ON COLUMN delivery_events.next_attempt_at IS 'Not retried before this time (exponential backoff with jitter).';
COMMENT ON COLUMN delivery_events.last_error IS 'Why the last apply attempt failed.';
COMMENT ON COLUMN delivery_events.applied_at IS 'When it was last applied.';
CREATE INDEX IF NOT EXISTS delivery_events_due_idx ON delivery_events (next_attempt_at)
    WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS delivery_events_evidence_idx
    ON delivery_events (tenant_id, source, message_key, recipient_hash) WHERE message_key IS NOT NULL;

CREATE TABLE IF NOT EXISTS delivery_evidence (
    tenant_id           text NOT NULL REFERENCES tenants (tenant_id),
    source              text NOT NULL,
    message_key         text NOT NULL,
    recipient_hash      text NOT NULL,
    recipient           text,
    provider_message_id text,
    message_id_norm     text,
    message_id          bigint,
    status              text NOT NULL,
    accepted_at         timestamptz,
    last_deferred_at    timestamptz,
    delivered_at        timestamptz,
    bounced_at          timestamptz,
    bounce_type         text,
    bounce_subtype      text,
    complained_at       timestamptz,
    rejected_at         timestamptz,
    suppressed_at       timestamptz,
    unsubscribed_at     timestamptz,
    last_opened_at      timestamptz,
    last_clicked_at     timestamptz,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, source, message_key, recipient_hash)
);
COMMENT ON TABLE delivery_evidence IS 'What is known about each sent message and recipient, derived from all applied delivery_events by occurred_at (pipeline/delivery/evidence.py), so every arrival order gives the same row.';
COMMENT ON COLUMN delivery_evidence.message_key IS 'provider_message_id, else mid:<normalised Message-ID>.';
COMMENT ON COLUMN delivery_evidence.recipient_hash IS 'sha256 hex of the lower-cased recipient; empty for events that name no recipient.';
COMMENT ON COLUMN delivery_evidence.recipient IS 'Recipient address when the source keeps addresses.';
COMMENT ON COLUMN delivery_evidence.provider_message_id IS 'The provider''s message id.';
COMMENT ON COLUMN delivery_evidence.message_id_norm IS 'Normalised Message-ID, when any event carried it.';
COMMENT ON COLUMN delivery_evidence.message_id IS 'messages.message_id of the outbound message, when correlated.';
COMMENT ON COLUMN delivery_evidence.status IS 'Transport outcome: complained > bounced (unless delivered later) > delivered > rejected > suppressed > deferred > accepted > unknown. Opens and clicks never change it.';
COMMENT ON COLUMN delivery_evidence.accepted_at IS 'First accepted event.';
COMMENT ON COLUMN delivery_evidence.last_deferred_at IS 'Latest deferral; never changes a delivered or bounced status.';
COMMENT ON COLUMN delivery_evidence.delivered_at IS 'First delivery.';
COMMENT ON COLUMN delivery_evidence.bounced_at IS 'First bounce.';
COMMENT ON COLUMN delivery_evidence.bounce_type IS 'Type of the first bounce (permanent first on a tie).';
COMMENT ON COLUMN delivery_evidence.bounce_subtype IS 'Sub-type of that bounce.';
COMMENT ON COLUMN delivery_evidence.complained_at IS 'First complaint.';
COMMENT ON COLUMN delivery_evidence.rejected_at IS 'First rejection by the provider.';
COMMENT ON COLUMN delivery_evidence.suppressed_at IS 'First refusal because of the provider''s suppression list.';
COMMENT ON COLUMN delivery_evidence.unsubscribed_at IS 'First unsubscribe.';
COMMENT ON COLUMN delivery_evidence.last_opened_at IS 'Latest open (engagement, kept apart from the transport outcome).';
COMMENT ON COLUMN delivery_evidence.last_clicked_at IS 'Latest click.';
COMMENT ON COLUMN delivery_evidence.updated_at IS 'When the row last changed.';
CREATE INDEX IF NOT EXISTS delivery_evidence_message_idx ON delivery_evidence (tenant_id, message_id)
    WHERE message_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS suppressions (
    tenant_id      text NOT NULL REFERENCES tenants (tenant_id),
    address_hash   text NOT NULL,
    scope          text NOT NULL,
    address        text,
    reason         text NOT NULL CHECK (reason IN ('hard_bounce', 'complaint', 'unsubscribe')),
    source         text NOT NULL,
    event_id       bigint NOT NULL,
    occurred_at    timestamptz NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, address_hash, scope),
    FOREIGN KEY (tenant_id, event_id) REFERENCES delivery_events (tenant_id, event_id)
);
COMMENT ON TABLE suppressions IS 'Addresses the application must not send to, with the event that caused it. inboxd itself never sends mail in response to an event.';
COMMENT ON COLUMN suppressions.address_hash IS 'sha256 hex of the UTF-8 of the space-trimmed lower-cased address (check with encode(sha256(convert_to(lower(btrim(addr)), ''UTF8'')), ''hex'')).';
COMMENT ON COLUMN suppressions.scope IS 'all (hard bounce, complaint: every mail), list:<source>:<list id> or source:<source> (unsubscribe: only that list or purpose).';
COMMENT ON COLUMN suppressions.address IS 'The address, when the source keeps addresses.';
COMMENT ON COLUMN suppressions.reason IS 'hard_bounce, complaint or unsubscribe.';
COMMENT ON COLUMN suppressions.source IS 'Delivery source of the event.';
COMMENT ON COLUMN suppressions.event_id IS 'The delivery_events row that created it: the earliest qualifying event by occurred_at, whatever the arrival order.';
COMMENT ON COLUMN suppressions.occurred_at IS 'When that event happened.';
COMMENT ON COLUMN suppressions.created_at IS 'When the row was first written.';

CREATE TABLE IF NOT EXISTS webhook_replay_tokens (
    tenant_id   text NOT NULL,
    scope       text NOT NULL,
    token_hash  text NOT NULL,
    seen_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, scope, token_hash)
);
COMMENT ON TABLE webhook_replay_tokens IS 'Single-use webhook tokens (Mailgun) already accepted, stored with the events of their request; a request presenting one again is refused. Pruned after the timestamp tolerance has passed.';
COMMENT ON COLUMN webhook_replay_tokens.scope IS 'Where the token is single-use: the fingerprint of the signing key (key:<16 hex>, every source sharing that key), else the source id.';
COMMENT ON COLUMN webhook_replay_tokens.token_hash IS 'sha256 hex of the scope and the token.';
COMMENT ON COLUMN webhook_replay_tokens.seen_at IS 'When the request that carried it was stored.';

CREATE TABLE IF NOT EXISTS graph_subscriptions (
    tenant_id        text NOT NULL,
    mailbox_id       text NOT NULL,
    folder           text NOT NULL,
    subscription_id  text NOT NULL,
    client_state     text NOT NULL,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    renewed_at       timestamptz,
    renew_failures   integer NOT NULL DEFAULT 0,
    last_error       text,
    lifecycle_event  text,
    lifecycle_at     timestamptz,
    PRIMARY KEY (tenant_id, mailbox_id, folder),
    UNIQUE (tenant_id, subscription_id),
    FOREIGN KEY (tenant_id, mailbox_id) REFERENCES mailboxes (tenant_id, mailbox_id)
);
COMMENT ON TABLE graph_subscriptions IS 'Microsoft Graph change-notification subscriptions of Outlook mailboxes: one per synced folder. A notification is accepted only when its clientState matches (constant-time) the row of its subscription id.';
COMMENT ON COLUMN graph_subscriptions.folder IS 'The synced folder (well-known name or folder id) whose messages the subscription watches.';
COMMENT ON COLUMN graph_subscriptions.subscription_id IS 'Graph''s subscription id.';
COMMENT ON COLUMN graph_subscriptions.client_state IS 'Random secret sent with every notification of this subscription; never logged, never shown by inboxd status.';
COMMENT ON COLUMN graph_subscriptions.expires_at IS 'expirationDateTime Graph returned; renewed at about half its lifetime.';
COMMENT ON COLUMN graph_subscriptions.renewed_at IS 'Last successful renewal.';
COMMENT ON COLUMN graph_subscriptions.renew_failures IS 'Renewals failed in a row (reset by a success); drives the backoff.';
COMMENT ON COLUMN graph_subscriptions.last_error IS 'Why the last create or renewal failed, one line, no secrets.';
COMMENT ON COLUMN graph_subscriptions.lifecycle_event IS 'A lifecycle notification not acted on yet: reauthorizationRequired (renew), subscriptionRemoved (recreate, then resync with delta) or missed (resync with delta). Cleared by the sync that acts on it.';

CREATE TABLE IF NOT EXISTS graph_refresh_tokens (
    tenant_id          text NOT NULL,
    mailbox_id         text NOT NULL,
    refresh_token      text NOT NULL,
    configured_sha256  text NOT NULL,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, mailbox_id),
    FOREIGN KEY (tenant_id, mailbox_id) REFERENCES mailboxes (tenant_id, mailbox_id)
);
COMMENT ON TABLE graph_refresh_tokens IS 'The newest refresh token Entra issued to a delegated Outlook mailbox (Entra rotates them and may refuse a redeemed one): written before it is used, read back at start in place of the configured one.';
COMMENT ON COLUMN graph_refresh_tokens.refresh_token IS 'A credential: never logged, never shown by inboxd status.';
COMMENT ON COLUMN graph_refresh_tokens.configured_sha256 IS 'sha256 hex of the refresh token the configuration named when this row was written: when the configured one changes (inboxd connect outlook again), the configured one wins.';
COMMENT ON COLUMN graph_refresh_tokens.updated_at IS 'When the token was stored (Entra issued it just before).';
COMMENT ON COLUMN graph_subscriptions.lifecycle_at IS 'When that lifecycle notification arrived.';

CREATE TABLE IF NOT EXISTS unrouted_items (
    unrouted_id   bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    door          text NOT NULL,
    external_id   text NOT NULL,
    reason        text NOT NULL,
    detail        text NOT NULL DEFAULT '',
    body          text NOT NULL DEFAULT '',
    recipients    text[] NOT NULL DEFAULT '{}',
    attempts      integer NOT NULL DEFAULT 1,
    created_at    timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    resolved_at   timestamptz,
    UNIQUE (door, external_id)
);
COMMENT ON TABLE unrouted_items IS 'Queue messages that belong to no tenant: an unreadable pointer, or mail for no configured recipient. The one tenant-less table: an operator reads it (inboxd status, metrics); no tenant API serves it.';
COMMENT ON COLUMN unrouted_items.door IS 'Which queue door saw it, e.g. ses:<queue name>.';
COMMENT ON COLUMN unrouted_items.external_id IS 'SES message id, else the S3 key, else the SQS message id.';
COMMENT ON COLUMN unrouted_items.reason IS 'invalid_pointer, no_mailbox, object_missing, too_large, unparseable, poison.';
COMMENT ON COLUMN unrouted_items.body IS 'The SQS message body (the pointer), kept to replay it.';
COMMENT ON COLUMN unrouted_items.recipients IS 'Envelope (or header) recipients that matched no mailbox.';

CREATE TABLE IF NOT EXISTS queue_pollers (
    door           text NOT NULL,
    owner          text NOT NULL,
    received       bigint NOT NULL DEFAULT 0,
    stored         bigint NOT NULL DEFAULT 0,
    duplicates     bigint NOT NULL DEFAULT 0,
    dead           bigint NOT NULL DEFAULT 0,
    unrouted       bigint NOT NULL DEFAULT 0,
    left_for_retry bigint NOT NULL DEFAULT 0,
    last_error     text,
    last_error_at  timestamptz,
    started_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (door, owner)
);
COMMENT ON TABLE queue_pollers IS 'What each daemon''s queue poller (SES SQS) did since it started, written every few seconds, so inboxd status in another process shows it.';
COMMENT ON COLUMN queue_pollers.door IS 'ses:<queue name>.';
COMMENT ON COLUMN queue_pollers.owner IS 'The daemon (host:pid:random) running the poller.';
COMMENT ON COLUMN queue_pollers.left_for_retry IS 'Messages left for SQS to redeliver (a transient failure).';
COMMENT ON COLUMN queue_pollers.updated_at IS 'Last write; a poller not updated for a minute is gone.';

CREATE TABLE IF NOT EXISTS small_objects (
    tenant_id  text NOT NULL,
    key        text NOT NULL,
    data       bytea NOT NULL,
    stored_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, key)
);
COMMENT ON TABLE small_objects IS 'Object-store objects up to [object_store] database_max_bytes (raw MIME, attachments, large HTML), kept here instead of one file each: one durable write per batch (pipeline/objectstore/database_tier.py). Larger objects are in the configured store under the same keys.';
COMMENT ON COLUMN small_objects.tenant_id IS 'The key''s second segment (raw/<tenant>/<sha256>).';
COMMENT ON COLUMN small_objects.key IS 'The object key, as messages.raw_key and attachments.storage_key name it.';
COMMENT ON COLUMN small_objects.data IS 'The bytes, exactly as put.';
-- MIME text compresses; lz4 costs a third of pglz's CPU (the messages bodies above).
DO $$ BEGIN
    IF current_setting('server_version_num')::int >= 140000 THEN
        ALTER TABLE small_objects ALTER COLUMN data SET COMPRESSION lz4;
    END IF;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    NULL;
END $$;

-- Extraction claims (pipeline/extraction/claims.py, docs/architecture.md §10): one job per
-- (tenant, processor, schema_version, dedup key), claimed under a lease with a fencing
-- token, completed together with its outbox event.
CREATE TABLE IF NOT EXISTS extraction_jobs (
    tenant_id            text NOT NULL,
    job_id               bigint GENERATED BY DEFAULT AS IDENTITY,
    processor_id         text NOT NULL CHECK (processor_id ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    schema_version       text NOT NULL CHECK (schema_version <> ''),
    dedup_key            text NOT NULL,
    message_id           bigint NOT NULL,
    mailbox_id           text NOT NULL,
    payload_fingerprint  text NOT NULL,
    state                text NOT NULL DEFAULT 'pending'
                         CHECK (state IN ('pending', 'running', 'retry_wait', 'completed', 'needs_review')),
    lease_owner          text,
    lease_expires_at     timestamptz,
    lease_token          bigint NOT NULL DEFAULT 0,
    attempts             integer NOT NULL DEFAULT 0,
    next_attempt_at      timestamptz NOT NULL DEFAULT now(),
    last_error           text,
    review_reason        text,
    result               jsonb,
    completed_at         timestamptz,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, job_id),
    UNIQUE (tenant_id, processor_id, schema_version, dedup_key),
    FOREIGN KEY (tenant_id, message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE
);
COMMENT ON TABLE extraction_jobs IS 'One extraction of one message identity by one processor at one schema_version: the claim of the exactly-once protocol (pipeline/extraction/claims.py). Its unique key is the claim; a second message with the same key is linked (same fingerprint) or recorded in extraction_payload_conflicts (different fingerprint), never extracted again.';
COMMENT ON COLUMN extraction_jobs.tenant_id IS 'Tenant the message belongs to.';
COMMENT ON COLUMN extraction_jobs.job_id IS 'inboxd''s id for the job (inboxd extract retry --id).';
COMMENT ON COLUMN extraction_jobs.processor_id IS 'Processor from the tenant config that extracts (its parse backend and JSON Schema).';
COMMENT ON COLUMN extraction_jobs.schema_version IS 'Version of the processor''s JSON Schema; a new version is a new key, so it deliberately re-extracts history.';
COMMENT ON COLUMN extraction_jobs.dedup_key IS 'Message identity (pipeline/extraction/keys.py): <provider>:<mailbox>:<id> for immutable provider ids (gmail, outlook, ses, imap), else mid:<normalised Message-ID>, else sha256:<raw sha256>, else row:<message_id>; derived from the message row, so every door''s copy of one message has the same key.';
COMMENT ON COLUMN extraction_jobs.message_id IS 'The message row the job was queued for (the first with this key).';
COMMENT ON COLUMN extraction_jobs.mailbox_id IS 'Mailbox of that message''s primary copy (the outbox event names it).';
COMMENT ON COLUMN extraction_jobs.payload_fingerprint IS 'The message''s content fingerprint when queued (else raw:<sha256>, else row:<id>): what a second message with the same key is compared with.';
COMMENT ON COLUMN extraction_jobs.state IS 'pending (due at next_attempt_at), running (leased to lease_owner until lease_expires_at), retry_wait (a retryable failure; due at next_attempt_at), completed (result written, event sent), needs_review (terminal failure or attempts exhausted; only inboxd extract retry runs it again).';
COMMENT ON COLUMN extraction_jobs.lease_owner IS 'Worker (host:pid:random) holding the running claim.';
COMMENT ON COLUMN extraction_jobs.lease_expires_at IS 'The claim may be taken by another worker after this time (database clock) unless renewed.';
COMMENT ON COLUMN extraction_jobs.lease_token IS 'Fencing token: incremented by every claim; complete and the failure writes carry it, so a worker whose lease expired or was taken over changes no row.';
COMMENT ON COLUMN extraction_jobs.attempts IS 'Claims so far (a release at shutdown gives its attempt back); reset by inboxd extract retry.';
COMMENT ON COLUMN extraction_jobs.next_attempt_at IS 'When the job may be claimed: creation, the end of a retry backoff (Retry-After honoured), or for a running job its lease expiry.';
COMMENT ON COLUMN extraction_jobs.last_error IS 'Last retryable or terminal error, one line, no secrets, no bodies.';
COMMENT ON COLUMN extraction_jobs.review_reason IS 'Why the job is in needs_review (the result does not validate, the endpoint refused the input, attempts exhausted).';
COMMENT ON COLUMN extraction_jobs.result IS 'The validated JSON result, written once with state completed; never overwritten.';
COMMENT ON COLUMN extraction_jobs.completed_at IS 'When the result and its extraction.completed event were committed.';
COMMENT ON COLUMN extraction_jobs.created_at IS 'When the job was queued.';
COMMENT ON COLUMN extraction_jobs.updated_at IS 'When the row last changed.';
ALTER TABLE extraction_jobs ADD COLUMN IF NOT EXISTS backfill boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN extraction_jobs.backfill IS 'Queued by inboxd extract backfill (history), not by new mail: claimed after every due job of new mail, so a backfill of 100k messages does not hold up today''s invoices.';
-- the workers' next-due query (claim_due: ORDER BY backfill, next_attempt_at … FOR
-- UPDATE SKIP LOCKED); replaces extraction_jobs_due_idx (next_attempt_at, tenant_id)
DROP INDEX IF EXISTS extraction_jobs_due_idx;
CREATE INDEX IF NOT EXISTS extraction_jobs_due_order_idx
    ON extraction_jobs (backfill, next_attempt_at, tenant_id)
    WHERE state IN ('pending', 'running', 'retry_wait');
CREATE INDEX IF NOT EXISTS extraction_jobs_message_idx ON extraction_jobs (tenant_id, message_id);
CREATE INDEX IF NOT EXISTS extraction_jobs_review_idx ON extraction_jobs (tenant_id, processor_id)
    WHERE state = 'needs_review';

CREATE TABLE IF NOT EXISTS extraction_payload_conflicts (
    tenant_id             text NOT NULL,
    conflict_id           bigint GENERATED BY DEFAULT AS IDENTITY,
    job_id                bigint NOT NULL,
    existing_message_id   bigint NOT NULL,
    existing_fingerprint  text NOT NULL,
    new_message_id        bigint NOT NULL,
    new_fingerprint       text NOT NULL,
    created_at            timestamptz NOT NULL DEFAULT now(),
    resolved_at           timestamptz,
    resolution            text,
    PRIMARY KEY (tenant_id, conflict_id),
    UNIQUE (tenant_id, job_id, new_message_id, new_fingerprint),
    FOREIGN KEY (tenant_id, job_id) REFERENCES extraction_jobs (tenant_id, job_id) ON DELETE CASCADE,
    FOREIGN KEY (tenant_id, new_message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE
);
COMMENT ON TABLE extraction_payload_conflicts IS 'A message whose extraction key already has a job with a different payload fingerprint (a reused Message-ID, changed content under an immutable id). Not extracted, the job untouched; kept for review.';
COMMENT ON COLUMN extraction_payload_conflicts.tenant_id IS 'Tenant of both messages.';
COMMENT ON COLUMN extraction_payload_conflicts.conflict_id IS 'inboxd''s id for the conflict.';
COMMENT ON COLUMN extraction_payload_conflicts.job_id IS 'The existing job holding the key (its processor, schema_version and dedup_key).';
COMMENT ON COLUMN extraction_payload_conflicts.existing_message_id IS 'The message that job was queued for.';
COMMENT ON COLUMN extraction_payload_conflicts.existing_fingerprint IS 'The job''s payload fingerprint.';
COMMENT ON COLUMN extraction_payload_conflicts.new_message_id IS 'The later message with the same key.';
COMMENT ON COLUMN extraction_payload_conflicts.new_fingerprint IS 'Its payload fingerprint, different from the job''s.';
COMMENT ON COLUMN extraction_payload_conflicts.created_at IS 'When the conflict was detected.';
COMMENT ON COLUMN extraction_payload_conflicts.resolved_at IS 'When someone reviewed it.';
COMMENT ON COLUMN extraction_payload_conflicts.resolution IS 'What the reviewer decided.';

CREATE TABLE IF NOT EXISTS extraction_inbox (
    tenant_id   text NOT NULL,
    message_id  bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, message_id),
    FOREIGN KEY (tenant_id, message_id) REFERENCES messages (tenant_id, message_id) ON DELETE CASCADE
);
COMMENT ON TABLE extraction_inbox IS 'New messages and new copies (ingest outcome new, conflict or merged) of tenants with processors, written in the ingest transaction and not yet matched against the processors'' filters: the durable hand-off from ingest to the extraction stage (pipeline/extraction/inbox.py). A row is deleted in the transaction that queues its jobs, so a crash between ingest and extraction loses nothing.';
COMMENT ON COLUMN extraction_inbox.tenant_id IS 'Tenant of the message.';
COMMENT ON COLUMN extraction_inbox.message_id IS 'The new message row, or the row a new copy merged into.';
COMMENT ON COLUMN extraction_inbox.created_at IS 'When ingest committed it (the age of the oldest row is the feeder''s lag).';
-- the feeder's oldest-first take (extraction_inbox.take: ORDER BY created_at, tenant_id,
-- message_id … LIMIT … FOR UPDATE SKIP LOCKED); without it every round sorted the inbox
CREATE INDEX IF NOT EXISTS extraction_inbox_created_idx
    ON extraction_inbox (created_at, tenant_id, message_id);
