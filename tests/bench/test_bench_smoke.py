"""Every benchmark in bench/ at its --smoke size, so that none rots unnoticed.

Each script runs as CI would run it by hand: a subprocess of this interpreter
with the admin DSN of the suite's server. A script exits 1 when a figure is not
a measurement (a failed request, an unexpected outcome, nothing timed), so the
exit status is the verdict; the output checks make sure that every figure was
printed at all. The scripts create their own `bench_*_<pid>_*` databases and
drop them; each test checks that none was left behind (and drops any that was).
bench/vocabulary.py is a module of words, not a benchmark.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncpg
import pytest
from helpers import wait_for

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
#: A smoke run prints a line per figure as it goes; one that prints nothing for this
#: long is stuck, however busy the machine (its quietest stretch, one figure's timed
#: loop, takes seconds on 2 idle cores).
SILENT_S = 240
#: The whole run's bound, generous: each takes 5-30 s on 2 idle cores, and more than
#: the 150 s this once was next to a second suite. The verdict is the exit status; this
#: only ends a run that keeps printing and never finishes.
DEADLINE_S = 900
#: pytest-timeout's limit per test: the deadline plus the database checks.
TEST_TIMEOUT_S = DEADLINE_S + 30
#: Lines of output shown when a run fails.
SHOWN_LINES = 60
#: How often a run is checked for having exited or gone quiet.
POLL_S = 0.5
#: The reader has the rest of the output once the process is gone; a grandchild that
#: kept the pipe open is not waited for longer than this.
READER_JOIN_S = 10

# Under `make test` (pytest-xdist) these run in two groups, one after another within a
# group, so at most two at once: each loads both cores by itself
# (tests/helpers/xdist_groups.py).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]


def run_bench(script: str, *args: str) -> tuple[int, str]:
    """Run bench/<script> until it exits (SILENT_S, DEADLINE_S); (its pid, stdout +
    stderr). Asserts exit 0."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # each line as it is printed
    )
    lines: list[str] = []
    last_line_at = [time.monotonic()]

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            last_line_at[0] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def silent() -> str | None:
        quiet_s = time.monotonic() - last_line_at[0]
        return f"{script} printed nothing for {quiet_s:.0f} s" if quiet_s > SILENT_S else None

    try:
        wait_for(
            proc.poll,
            DEADLINE_S,
            what=f"{script} {' '.join(args)} to exit",
            until=lambda code: code is not None,
            poll_s=POLL_S,
            abort=silent,
            context=lambda: "".join(lines[-SHOWN_LINES:]),
        )
    finally:
        if proc.poll() is None:
            proc.kill()  # its finally blocks do not run: the database check drops what is left
            proc.wait()
        reader.join(timeout=READER_JOIN_S)
        if not reader.is_alive():
            proc.stdout.close()  # type: ignore[union-attr]  # PIPE above
    output = "".join(lines)
    tail = "\n".join(output.splitlines()[-SHOWN_LINES:])
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{tail}"
    assert "PROBLEM" not in output and "FAILED" not in output, tail
    return proc.pid, output


def expect_lines(output: str, *patterns: str) -> None:
    missing = [p for p in patterns if not re.search(p, output, re.M)]
    assert not missing, f"no line matches {missing} in:\n{output}"


async def _leftovers(server_dsn: str, prefix: str, pid: int) -> list[str]:
    conn = await asyncpg.connect(server_dsn)
    try:
        names = [
            r["datname"]
            for r in await conn.fetch(
                "SELECT datname FROM pg_database WHERE datname LIKE $1", f"{prefix}_{pid}_%"
            )
        ]
        for name in names:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return names
    finally:
        await conn.close()


def assert_no_databases_left(server_dsn: str, prefix: str, pid: int) -> None:
    left = asyncio.run(_leftovers(server_dsn, prefix, pid))
    assert not left, f"the benchmark left databases behind (dropped now): {left}"


# A figure line: a label, then numbers (count, seconds, rate, CPU).
NUMBERS = r"\s+[\d,]+\s+[\d.]+\s+[\d,]+\s"


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param((), id="every-figure"),
        # The options the recorded figures were also taken with: a TCP relay adding
        # round-trip time, plans of empty tables, (d) on a subset.
        pytest.param(
            ("--only", "b,d", "--rtt-ms", "0.2", "--no-analyze", "--auxx-messages", "100"),
            id="relay-no-analyze",
        ),
    ],
)
def test_ingest(server_dsn: str, extra: tuple[str, ...]) -> None:
    pid, out = run_bench("ingest.py", "--smoke", "--dsn", server_dsn, *extra)
    try:
        if extra:
            expect_lines(
                out,
                r"through a relay adding 0\.2 ms",
                r"\(b\) cascade, new messages" + NUMBERS + r".*\{'new': 300\}",
                r"\(d\) per message.*" + NUMBERS + r".*\{'new': 100\}",
            )
            return
        expect_lines(
            out,
            r"\(a\) COPY ceiling.*" + NUMBERS + r".*rows/s",
            r"\(b\) cascade, new messages" + NUMBERS + r".*\{'new': 300\}",
            r"\(c\) cascade, re-sync .*best of 2" + NUMBERS + r".*passes: ",
            r"\(d\) per message.*" + NUMBERS + r".*\{'new': 300\}",
            r"rows written by \(b\) vs \(a\): same",
            r"rows written by \(d\) vs \(a\): same",
            r"ratios, same run: b/a = ",
            r"parse_raw only, in this process.*" + NUMBERS,
            r"parse_raw only, 2 worker processes.*" + NUMBERS,
            r"ingest only \(pre-parsed\), raw: one file each" + NUMBERS + r".*\{'new': 200\}",
            r"ingest only \(pre-parsed\), raw: in PostgreSQL" + NUMBERS + r".*\{'new': 200\}",
            r"ingest only \(pre-parsed\), raw NOT stored" + NUMBERS + r".*\{'new': 200\}",
            r"stored in PostgreSQL ÷ not stored = [\d.]+ .*; one file each ÷ not stored = [\d.]+",
            # the S3 object store on moto's server (on by default; --no-s3 skips it)
            r"^S3: moto [\d.]+ server over HTTP on 127\.0\.0\.1:\d+",
            r"S3 PUTs alone \(S3Store\.put_many\), no ingest" + NUMBERS + r".*moto CPU [\d.]+s"
            r".*, 200 objects in S3",
            r"ingest only \(pre-parsed\), raw: one S3 object each"
            + NUMBERS
            + r".*\{'new': 200\}  moto CPU [\d.]+s .*, [\d,]+ objects in S3",
            r"ingest only \(pre-parsed\), raw: S3 \+ database tier"
            + NUMBERS
            + r".*\{'new': 200\}  moto CPU [\d.]+s",
            r"one S3 object each ÷ not stored = [\d.]+ .*; S3 \+ database tier ÷ not stored = "
            r"[\d.]+; its PUTs/s ÷ PUTs alone = [\d.]+",
            r"end to end: parse inline.*\{'new': 200\}",
            r"end to end: parse in a thread.*\{'new': 200\}",
            r"end to end: ProcessPoolExecutor\(1\).*\{'new': 200\}",
            r"end to end: ProcessPoolExecutor\(2\).*\{'new': 200\}",
            r"end to end: anyio\.to_process.*\{'new': 200\}",
            r"\(e\) best end to end = [\d,]+ msg/s",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_ingest", pid)


def test_parse() -> None:
    _, out = run_bench("parse.py", "--smoke")
    expect_lines(
        out,
        r"^corpus: .*\(\d+ \.eml",
        r"guarded pass compat32",
        r"guarded pass default",
        r"== Correctness summary ==",
        r"^exception\s+0\s",  # the reference parses every file
        r"== RFC 2047 header decoding",
        r"lhost-postfix-01\s+compat32\s+dos=bsd",
        r"mac__lhost-postfix-01\s+compat32\s+subject=",
        r"\[us-askey\]",
        r"== Speed: best of 1 passes",
        r"^compat32\s+[\d.]+\s+[\d,]+\s",
        r"^default parse only\s+[\d.]+\s+[\d,]+\s",
    )


def test_reimport(server_dsn: str) -> None:
    pid, out = run_bench("reimport.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^generated 300 messages",
            r"^  first import \(all new\)\s+300\s+[\d.]+\s+[\d,]+\s",
            r"^  re-import \(all duplicate\)\s+300\s+[\d.]+\s+[\d,]+\s",
            r"^  baseline: read \+ sha256 in this process\s+300\s",
            r"re-import [\d,]+ files/s \(target ≥ 20,000: (ok|MISSED)\); ÷ read\+hash = [\d.]+",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_reimport", pid)


def test_daemon_backfill(server_dsn: str) -> None:
    pid, out = run_bench("daemon_backfill.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^generated 300 messages",
            r"^  daemon\s+300\s+[\d.]+\s+[\d,]+\s",
            r"^  import\s+300\s+[\d.]+\s+[\d,]+\s",
            r"SIGTERM → exit 0 .*300 files in cur/; rows 300, copies 300, dead 0",
            r"outcomes \{new: 300\}",
            r"ratio daemon/import = [\d.]+",
            r"daemon peak RSS [\d.]+ MB",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_daemon", pid)


def test_webhooks(server_dsn: str) -> None:
    pid, out = run_bench("webhooks.py", "--smoke", "--dsn", server_dsn)
    try:
        rows = {
            (scenario, mode): rf"^\| {scenario} \| {mode} \| [1-9][\d,]* \| [1-9][\d,]* \|"
            for scenario in ("sw", "sg")
            for mode in ("verify-only", "persisted")
        }
        expect_lines(out, *rows.values())
        # every answer a 2xx: the non-2xx column of each row is 0
        for line in out.splitlines():
            if line.startswith(("| sw |", "| sg |")):
                assert line.split("|")[8].strip() == "0", line
    finally:
        assert_no_databases_left(server_dsn, "bench_webhooks", pid)


# A Gmail figure row: msgs, wall s, msg/s, units/s, × quota, and no 429.
GMAIL_ROW = r"\s+200\s+[\d.]+\s+[\d,.]+\s+[\d,.]+\s+[\d.]+\s+0\b"


def test_gmail(server_dsn: str) -> None:
    pid, out = run_bench("gmail.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^  fake capacity: no quota, no pacing" + GMAIL_ROW,
            r"^  paced client at the quota" + GMAIL_ROW,
            r"^  one" + GMAIL_ROW + r"\s+calls: .*messages\.get ×200",
            *(rf"^  m0{i}" + GMAIL_ROW + r"\s+calls: .*messages\.get ×200" for i in (1, 2, 3)),
            r"^  3 mailboxes: msg/s per mailbox min [\d,.]+ / median [\d,.]+",
            r"CPU over the [\d.]+ s window .*daemon main process [\d.]+ s = \d+ %",
            r"quota units per stored message: 5\.\d+ ",
            r"resync after a 404 .*body downloads 0 \(must be 0\); [\d.]+ s from cursor reset",
            r"stored 200 messages, 200 copies, dead 0; .*SIGTERM → exit 0",
            r"stored 600 messages, 600 copies, dead 0; .*SIGTERM → exit 0",
            r"^  fake capacity [\d,]+ msg/s",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_gmail", pid)


# An Outlook figure row: msgs, wall s, msg/s, req/s, × budget, no 429, pacer units/s.
OUTLOOK_ROW = r"\s+[\d,]+\s+[\d.]+\s+[\d,.]+\s+[\d,.]+\s+[\d.]+\s+0\s+[\d,.]+\s+[\d.]+"


def test_outlook(server_dsn: str) -> None:
    pid, out = run_bench("outlook.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^budget: 100,000 requests per 10 min .*SCALED ×10",
            r"^  fake capacity: no limits, no pacing" + OUTLOOK_ROW,
            r"^  paced client at the budget" + OUTLOOK_ROW,
            r"^  delta page \(DeltaGetResponse / orjson\)\s+[\d.]+\s+[\d.]+\s+[\d,.]+",
            r"^  \$batch body \(BatchResponseContent / orjson\)\s+[\d.]+\s+[\d.]+",
            r"same ids and bodies on both paths: yes",
            r"^  one" + OUTLOOK_ROW + r"\s+calls: .*\$value ×400 in 20 \$batch",
            *(rf"^  m0{i}" + OUTLOOK_ROW + r"\s+calls: .*\$value ×300 " for i in (1, 2, 3)),
            r"^  3 mailboxes: msg/s per mailbox min [\d,.]+ / median [\d,.]+",
            r"CPU over the [\d.]+ s window .*daemon main process [\d.]+ s = \d+ %",
            r"door's CPU per stored message: [\d.]+ ms .*bodies downloaded twice: 0",
            r"resync after a 410 .*body downloads 0 \(must be 0\); [\d.]+ s from cursor reset",
            r"stored 400 messages, 400 copies, dead 0; .*SIGTERM → exit 0",
            r"stored 900 messages, 900 copies, dead 0; .*SIGTERM → exit 0",
            r"^  fake capacity [\d,]+ msg/s",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_outlook", pid)


# A moto-alone row: msgs, wall s, msg/s.
SES_REF = r"\s+100\s+[\d.]+\s+[\d,]+\s"


def test_ses(server_dsn: str) -> None:
    pid, out = run_bench("ses.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^moto server on http://127\.0\.0\.1:\d+ ready",
            r"^generated 100 messages",
            *(
                rf"^  moto alone: {what}, {loops} loops" + SES_REF
                for what in (r"receive\+delete", r"receive\+get\+delete")
                for loops in (2, 4)
            ),
            *(rf"^  daemon {loops}\s+100\s+[\d.]+\s+[\d,]+\s" for loops in (2, 4)),
            r"^  import\s+100\s+[\d.]+\s+[\d,]+\s",
            r"SIGTERM → exit 0 .*rows 100, copies 100, dead 0",
            r"outcomes \{new: 100\}",
            *(
                rf"^  daemon {loops}: poller totals received \d+, stored 100, deleted \d+, "
                r".*dead 0, left 0"
                for loops in (2, 4)
            ),
            r"^    daemon_ready → done \(.*daemon main \d+ % .*PostgreSQL \d+ % .*moto \d+ %",
            r"^  same raw files in the daemon 2 and import databases \(raw_sha256\): yes",
            r"^  same raw files in the daemon 4 and import databases \(raw_sha256\): yes",
            r"^  ratios, same run: daemon 2 / moto alone receive\+delete, 2 loops = [\d.]+; "
            r"daemon 2 / moto alone receive\+get\+delete, 2 loops = [\d.]+; "
            r"daemon 2 / import = [\d.]+",
            r"^  ratios, same run: daemon 4 / moto alone .*daemon 4 / import = [\d.]+",
            r"^  daemon 2: peak RSS [\d.]+ MB .*growth 10 % → 90 % of the rows",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_ses", pid)


# A bare-fetch row: msgs, wall s, msg/s, MB/s.
IMAP_REF = r"\s+300\s+[\d.]+\s+[\d,]+\s+[\d.]+\s"


def test_imap(server_dsn: str) -> None:
    pid, out = run_bench("imap.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^Dovecot on 127\.0\.0\.1:\d+ \(plain IMAP\) ready",
            r"^generated 300 messages",
            r"^delivered 300 messages into INBOX .*: 300 messages, UIDNEXT 301",
            r"^  bare fetch, aioimaplib, windows of 100" + IMAP_REF + r".*300 messages",
            r"^  bare fetch, aioimaplib, one UID FETCH 1:\*" + IMAP_REF + r".*300 messages",
            r"^  bare fetch, stdlib imaplib, windows of 100" + IMAP_REF + r".*300 messages",
            r"^  door's client \(fetch_raw\), windows of 100" + IMAP_REF + r".*300 messages",
            r"^  source alone: ImapSource\.pages, no database" + IMAP_REF + r".*300 messages",
            r"^  daemon\s+300\s+[\d.]+\s+[\d,]+\s",
            r"^  import\s+300\s+[\d.]+\s+[\d,]+\s",
            r"rows 300, copies 300, dead 0",
            r"outcomes \{new: 300\}",
            r"^  stored 300 messages, 300 copies, dead 0; .*SIGTERM → exit 0",
            r"^  messages marked \\Seen on the server after the daemon: 0",
            r"^    spawn → done .*daemon main \d+ % .*PostgreSQL \d+ % .*Dovecot \d+ %",
            r"^  run queue, spawn → done .*event-loop thread on a CPU [\d.]+ s, waiting for one",
            r"^    run queue \(schedstat\): event-loop thread on a CPU [\d.]+ s",
            r"^  same messages in both databases \(Message-IDs\): yes",
            r"^  ratios, same run: daemon / import = [\d.]+; "
            r"daemon / bare fetch, aioimaplib, windows of 100 = [\d.]+",
            r"^  daemon peak RSS [\d.]+ MB .*growth 10 % → 90 % of the rows",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_imap", pid)


def test_extraction(server_dsn: str) -> None:
    pid, out = run_bench("extraction.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^  \(a\) ingest, new mail \(cascade \+ hand-off\)\s+300\s+[\d.]+\s+[\d,.]+$",
            r"^  \(b\) builtin extraction, all new\s+300\s+[\d.]+\s+[\d,.]+$",
            r"^  \(c\) re-run of the same messages, all linked\s+300\s",
            r"^  \(d\) http, concurrency 8, 50 ms endpoint\s+60\s",
            r"^  \(d0\) baseline: bare aiohttp POSTs, same endpoint\s+60\s",
            r"^  \(b\) ÷ \(a\) = [\d.]+ \(target ≥ 0.50: (ok|MISSED)\)",
            r"^  \(d\) ÷ concurrency/latency \(160.0/s\) = [\d.]+",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_extraction", pid)


def test_fleet(server_dsn: str) -> None:
    pid, out = run_bench("fleet.py", "--smoke", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^  first syncs: all 20 mailboxes synced cleanly [\d.]+ s after the start",
            r"^    polls on time: interval ÷ mean time between a mailbox's claims \([\d.]+ s, "
            r"[\d,]+ gaps; max [\d.]+ s\) = [\d.]+, i\.e\. [\d,.]+ polls/s",
            r"^    polls counted in the window: claims [\d,]+ = [\d,.]+/s, history\.list [\d,]+",
            r"^    a mailbox's period = interval \+ the claim's lateness after it fell due "
            r"\(mean -?[\d.]+ s: .*\+ claim → clean sync \(mean [\d.]+ s",
            r"^    RSS of the process tree: \d+ MB",
            r"^    RSS of the process trees: \d+ MB \(a \d+ MB, b \d+ MB\)",
            r"^    CPU over the window \(% of one core\): daemon [\d.]+ %",
            r"^    open file handles: [\d,]+ .*PostgreSQL connections \d+",
            r"^    split of the polls \(sync_page_committed lines in each log\): a [\d,]+",
            r"^  takeover after SIGKILL of [ab]: (\d+) of the \1 mailboxes it had polled last "
            r"claimed and synced by the survivor, the last [\d.]+ s after the kill",
            r"stored 40 messages, 40 copies, dead 0; exit daemon 0",
            r"stored 40 messages, 40 copies, dead 0; exit a (0|-9), b (0|-9)",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_fleet", pid)


def test_ses_standin(server_dsn: str) -> None:
    """ses.py against the in-memory S3/SQS stand-in with a latency per call (issue 25)."""
    pid, out = run_bench("ses.py", "--smoke", "--aws", "standin", "--dsn", server_dsn)
    try:
        expect_lines(
            out,
            r"^S3/SQS stand-in \(10 ms a call\) on http://127\.0\.0\.1:\d+ ready",
            r"^generated 100 messages",
            *(
                rf"^  stand-in alone: {what}, {loops} loops" + SES_REF
                for what in (r"receive\+delete", r"receive\+get\+delete")
                for loops in (2, 4)
            ),
            *(rf"^  daemon {loops}\s+100\s+[\d.]+\s+[\d,]+\s" for loops in (2, 4)),
            r"^  import\s+100\s+[\d.]+\s+[\d,]+\s",
            *(
                rf"^  daemon {loops}: poller totals received 100, stored 100, deleted 100, "
                r".*dead 0, left 0, released 0"
                for loops in (2, 4)
            ),
            r"^    daemon_ready → done \(.*daemon main \d+ % .*PostgreSQL \d+ % .*stand-in \d+ %",
            r"^  same raw files in the daemon 2 and import databases \(raw_sha256\): yes",
            r"^  ratios, same run: daemon 2 / stand-in alone receive\+delete, 2 loops = [\d.]+; "
            r"daemon 2 / stand-in alone receive\+get\+delete, 2 loops = [\d.]+; "
            r"daemon 2 / import = [\d.]+",
            r"^  ratios without start-up: daemon 2 from ready / stand-in alone "
            r"receive\+get\+delete, 2 loops = [\d.]+; "
            r"daemon 2 from ready / import's own elapsed = [\d.]+",
        )
    finally:
        assert_no_databases_left(server_dsn, "bench_ses", pid)


def test_every_script_has_a_smoke_test() -> None:
    """A new benchmark in bench/ gets a test here too (vocabulary.py is data,
    door_run.py the machinery gmail.py and outlook.py share)."""
    tested = {
        "ingest.py",
        "parse.py",
        "daemon_backfill.py",
        "reimport.py",
        "extraction.py",
        "webhooks.py",
        "gmail.py",
        "outlook.py",
        "ses.py",
        "imap.py",
        "fleet.py",
    }
    scripts = {p.name for p in BENCH.glob("*.py")} - {"vocabulary.py", "door_run.py"}
    assert scripts == tested, f"bench scripts without a smoke test: {scripts - tested}"
    for name in tested:
        assert "--smoke" in (BENCH / name).read_text(), f"{name} has no --smoke"
