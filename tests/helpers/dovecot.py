"""A private Dovecot IMAP server for the tests: the `dovecot` fixtures and `DovecotServer`.

The IMAP door is tested against a real server (CONTRIBUTING.md rule 12; issue 13):
Debian's dovecot-imapd, installed by scripts/ensure-dovecot.sh. Each pytest
session — each xdist worker — starts its own master process with a config it
writes into a temp dir of its own (base_dir, state_dir, logs, users, Maildirs),
listening on free loopback ports, and stops it at the end. Nothing of the
machine's own Dovecot (/etc/dovecot, /run/dovecot, ports 143/993) is used.

What the server offers:
- `plain_port`: IMAP without TLS, with STARTTLS; `tls_port`: implicit TLS (imaps).
  The certificate is signed by a test CA (`ca_file`) for `localhost` and
  127.0.0.1. Both listeners also answer on `mismatch_host` (127.0.0.2, still
  loopback), a name the certificate does not carry: a client that verifies the
  host name must refuse it.
- passwd-file users with plain passwords (`add_user`, `new_user`); AUTHENTICATE
  PLAIN/LOGIN and LOGIN accepted without TLS; failed logins answer at once
  (`auth_failure_delay = 0`, instead of Dovecot's 2 s).
- Maildir storage (`mail_location = maildir:~/Maildir`, one home per user), the
  "/" hierarchy separator, special-use Sent/Drafts/Junk/Trash when created.
- Mail put in with `doveadm save` (`deliver`) or as Maildir files
  (`deliver_many`), and doveadm for folders, expunge, flags and status, so a
  test changes the server's state the way another client would.
- `stop()` / `start()` (or `with server.stopped():`, or `restart()`) for a
  server that goes away mid-sync and comes back on the same ports; `stop()`
  drops every client connection, as a real restart does.
- `with server.passdb_failing(user):` a user database that fails temporarily
  (logins answered `NO [UNAVAILABLE]`).

Root (CI runs `make test` as root): Dovecot's own processes then run as
`dovecot`/`dovenull` (the package's users; `nobody` where one is missing) and
the mail of every test user as `nobody`, which owns the users' homes; the temp
dir lives in /tmp (world-traversable) rather than pytest's private basetemp.
As any other user everything runs as that user, login processes unchrooted.

Byte-exactness (measured over tests/corpus/mime): IMAP sends line endings as
CRLF, so a message delivered with CRLF line endings comes back from BODY[]
byte for byte and one with bare LF comes back with CRLF; Dovecot serves a NUL
byte as 0x80 (an IMAP literal cannot carry NUL, RFC 3501 §4.3), in BINARY[]
too; `doveadm save` drops a final bare CR. `deliver_many` writes the files
exactly as given (same FETCH rules).

The fixtures: `dovecot_server` (session scope: started on first use, stopped at
the end of the session) and `dovecot` (per test: the same server, started again
if an earlier test left it stopped). tests/conftest.py registers this module as
a plugin. Outside pytest (bench/), `DovecotServer` is a context manager.
"""

from __future__ import annotations

import datetime as dt
import grp
import ipaddress
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from helpers.waiting import wait_for

# A cold start (config parse, the log, anvil and imap-login processes) measured
# 0.1-0.3 s here; a loaded CI runner is several times slower. Past this the
# server is broken, not slow.
DOVECOT_START_TIMEOUT_S = 30.0
# Between readiness probes: a probe is a local connect + greeting read.
DOVECOT_POLL_INTERVAL_S = 0.05
# A probe whose connect or greeting takes this long means "not ready yet".
DOVECOT_PROBE_TIMEOUT_S = 1.0
# After the master has exited, how long its remaining processes (imap sessions
# saying BYE, the log process) get after SIGTERM before SIGKILL; they take
# milliseconds here.
DOVECOT_STOP_GRACE_S = 5.0
# SIGTERM → every process of the server gone (the grace above included); past
# this, SIGKILL to the whole process group.
DOVECOT_STOP_TIMEOUT_S = 15.0
# One doveadm command (save, fetch, mailbox …) against a local server.
DOVEADM_TIMEOUT_S = 30.0
# A free port may be taken by another process (another xdist worker) between
# our probe and Dovecot's bind: the first start tries fresh ports this often.
DOVECOT_START_ATTEMPTS = 3
# Lines of the server's log a failure message carries.
LOG_TAIL_LINES = 40
# IDLE clients hear of new mail through inotify at once; where inotify is not
# available (a CI runner out of inotify instances) Dovecot falls back to
# polling every mailbox_idle_check_interval (default 30 s). 1 s keeps the
# "stored within 2 s via IDLE" scenario of issue 13 meaningful everywhere.
MAILBOX_IDLE_CHECK_INTERVAL_S = 1

HOST = "127.0.0.1"
# Linux routes all of 127.0.0.0/8 to lo: a second loopback address whose name the
# certificate does not carry (the certificate names localhost and 127.0.0.1).
MISMATCH_HOST = "127.0.0.2"
CERT_HOSTNAME = "localhost"
DH_PARAMS = Path("/usr/share/dovecot/dh.pem")  # Debian's dovecot-core ships it
# Where dovecot-core installs them (a non-root PATH often lacks /usr/sbin).
DOVECOT_PROGRAMS = {"dovecot": Path("/usr/sbin/dovecot"), "doveadm": Path("/usr/bin/doveadm")}
# Names a passwd-file line and a doveadm argument can carry as they are.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


# The parent of the Dovecot master. Dovecot's master exits on SIGTERM before
# some of its children (log, stats, imap sessions still serving a client): as
# orphans they would keep running, or end as zombies under a PID 1 that never
# reaps (some containers). This process is a child subreaper (prctl
# PR_SET_CHILD_SUBREAPER = 36, Linux >= 3.4), so they become its children: it
# passes SIGTERM/SIGINT to the master; once the master has exited it sends
# SIGTERM to the rest of its process group (the server's processes), SIGKILL to
# any still there after DOVECOT_STOP_GRACE_S, reaps them all and exits with the
# master's status — so a stop that returns has left nothing behind.
_REAPER = """
import ctypes, os, signal, sys, time
grace_s = float(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
except (AttributeError, OSError):
    pass
master, early = None, []
def forward(signum, frame):
    if master is None:
        early.append(signum)
        return
    try:
        os.kill(master, signum)
    except ProcessLookupError:
        pass
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
master = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
for signum in early:
    forward(signum, None)
status = None
while status is None:
    pid, wait_status = os.waitpid(-1, 0)
    if pid == master:
        status = os.waitstatus_to_exitcode(wait_status)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
os.killpg(0, signal.SIGTERM)
deadline = time.monotonic() + grace_s
while True:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid:
        continue
    if time.monotonic() > deadline:
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rpartition(")")[2].split()[1])
                if ppid == os.getpid():
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass
    time.sleep(0.01)
sys.exit(status if status >= 0 else 128 - status)
"""


class DovecotError(AssertionError):
    """Dovecot could not be started, stopped or driven; the message has the log tail."""


@dataclass(frozen=True)
class ImapAccount:
    """A user of the test server and its password."""

    username: str
    password: str


@dataclass(frozen=True)
class FolderStatus:
    """`doveadm mailbox status` of one folder."""

    messages: int
    uidvalidity: int
    uidnext: int
    highestmodseq: int


def _free_port() -> int:
    # Free on both loopback addresses the listeners use when we look; Dovecot
    # binds a moment later, and a collision in that window fails the start
    # loudly (bind error in the log), which start() retries with new ports.
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((MISMATCH_HOST, port))
        except OSError:
            continue
        return port


def _greets(port: int, greeting: str) -> bool:
    """Our Dovecot (not another process on that port) greets on `port`."""
    try:
        with socket.create_connection((HOST, port), timeout=DOVECOT_PROBE_TIMEOUT_S) as sock:
            return sock.recv(512).rstrip().endswith(greeting.encode())
    except OSError:
        return False


def _binary(name: str) -> str:
    """Path of a Dovecot program; Debian's places when PATH lacks them (/usr/sbin)."""
    return shutil.which(name) or str(DOVECOT_PROGRAMS[name])


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _write_test_pki(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate it signed for localhost/127.0.0.1.

    EC P-256 keys (generated in microseconds, unlike RSA). The extensions are
    the ones a strict verifier asks for (Python 3.13's VERIFY_X509_STRICT):
    key identifiers, a critical CA basic constraint, key usages.
    Returns (ca_file, cert_file, key_file).
    """
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inboxd test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CERT_HOSTNAME)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(CERT_HOSTNAME), x509.IPAddress(ipaddress.ip_address(HOST))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = (
        directory / "ca.pem",
        directory / "server.pem",
        directory / "server.key",
    )
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)  # read by the master (root, or the user running it)
    return ca_file, cert_file, key_file


class DovecotServer:
    """One private Dovecot: its files, its master process and doveadm against it.

    Not started by the constructor: `start()` (or `with DovecotServer() as s:`).
    Every method that reaches the server (deliver, doveadm, …) needs it running.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.as_root = os.geteuid() == 0
        # As root the unprivileged processes must reach the files: /tmp (mode 1777)
        # instead of pytest's private basetemp (mode 0700).
        self.root = Path(root or tempfile.mkdtemp(prefix="inboxd-test-dovecot-"))
        self.root.chmod(0o755)
        self.host = HOST
        self.mismatch_host = MISMATCH_HOST
        self.cert_hostname = CERT_HOSTNAME
        self.plain_port = 0
        self.tls_port = 0
        # Told apart from any other server on our port by its greeting.
        self.greeting = f"inboxd test Dovecot {self.root.name} ready."
        self.base_dir = self.root / "run"
        self.state_dir = self.root / "state"
        self.home_root = self.root / "home"
        self.config_path = self.root / "dovecot.conf"
        self.users_dir = self.root / "users"  # one passwd-file per user
        self.log_path = self.root / "dovecot.log"
        for directory in (self.base_dir, self.state_dir, self.home_root, self.users_dir):
            directory.mkdir(mode=0o755, exist_ok=True)
        if self.as_root:
            self.internal_user = "dovecot" if _user_exists("dovecot") else "nobody"
            self.login_user = "dovenull" if _user_exists("dovenull") else "nobody"
            mail_user = pwd.getpwnam("nobody")
            os.chown(self.home_root, mail_user.pw_uid, mail_user.pw_gid)
        else:
            mail_user = pwd.getpwuid(os.getuid())
            self.internal_user = self.login_user = mail_user.pw_name
        self.mail_uid, self.mail_gid = mail_user.pw_uid, mail_user.pw_gid
        self.internal_group = grp.getgrgid(pwd.getpwnam(self.internal_user).pw_gid).gr_name
        self.ca_file, self.cert_file, self.key_file = _write_test_pki(self.root)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> DovecotServer:
        # A server that fails to start keeps its files (the error names them).
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pgid(self) -> int | None:
        """While it runs: the id of the process group every process of this server is in."""
        return self._proc.pid if self.running and self._proc is not None else None

    def start(self) -> None:
        """Start the master and return once the plain listener greets.

        The first start picks free ports (trying again with new ones if another
        process took one meanwhile); a restart after `stop()` keeps them.
        """
        if self.running:
            return
        first = self.plain_port == 0
        attempts = DOVECOT_START_ATTEMPTS if first else 1
        for attempt in range(1, attempts + 1):
            if first:
                self.plain_port, self.tls_port = _free_port(), _free_port()
                while self.tls_port == self.plain_port:
                    self.tls_port = _free_port()
            self._write_config()
            try:
                self._start_once()
                return
            except DovecotError as exc:
                if attempt == attempts or "Address already in use" not in str(exc):
                    raise

    def _start_once(self) -> None:
        dovecot = _binary("dovecot")
        if not os.path.exists(dovecot):
            raise DovecotError(
                "dovecot is not installed: run `bash scripts/ensure-dovecot.sh` "
                "(`make test` does) or apt-get install dovecot-imapd"
            )
        startup_log = self.root / "master.out"
        reaper = self.root / "reaper.py"  # a file, so `ps` shows a short command line
        reaper.write_text(_REAPER)
        with startup_log.open("ab") as out:
            # -F: the master stays in the foreground, under _REAPER (see there).
            # Its own session, so a stop that has to kill reaches every process
            # of this server by process group (the one we started, nothing else).
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    str(reaper),
                    str(DOVECOT_STOP_GRACE_S),
                    dovecot,
                    "-F",
                    "-c",
                    str(self.config_path),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self._proc
        try:
            wait_for(
                lambda: _greets(self.plain_port, self.greeting),
                DOVECOT_START_TIMEOUT_S,
                what=f"Dovecot greeting on {self.host}:{self.plain_port}",
                poll_s=DOVECOT_POLL_INTERVAL_S,
                abort=lambda: (
                    None if proc.poll() is None else f"dovecot exited with {proc.returncode}"
                ),
                context=lambda: self._failure_context(startup_log),
            )
        except AssertionError as exc:
            self._terminate()
            raise DovecotError(f"Dovecot did not start ({self.config_path}): {exc}") from None

    def stop(self) -> None:
        """Stop the server; every client connection drops (Dovecot's shutdown_clients).

        Returns once every process of the server has exited.
        """
        self._terminate()

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=DOVECOT_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Normally the reaper has seen every process out; after a kill, whatever
        # is left is still in the process group we created.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """The server is down inside the block and up again (same ports) after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def restart(self) -> None:
        """Stop and start again (same ports): every client connection drops, as in
        a server's upgrade or reboot, and new ones are served once this returns."""
        self.stop()
        self.start()

    @contextmanager
    def passdb_failing(self, user: str) -> Iterator[None]:
        """Inside the block the user database cannot be read for `user`: its
        passwd-file is made unreadable to Dovecot's auth process, which answers a
        login `NO [UNAVAILABLE] Temporary authentication failure` (RFC 5530) and
        disconnects, as when a server's LDAP or SQL user database is down.
        Dovecot re-reads a passwd-file whose mtime (in seconds) changed: each
        change moves it a second on."""
        path = self.users_dir / user

        def touch() -> None:
            mtime = path.stat().st_mtime
            os.utime(path, (mtime + 1, mtime + 1))

        path.chmod(0)
        touch()
        wait_for(
            lambda: not self._user_ok(user),
            DOVECOT_START_TIMEOUT_S,
            what=f"Dovecot failing the user lookup of {user}",
            poll_s=DOVECOT_POLL_INTERVAL_S,
            context=self.log_tail,
        )
        try:
            yield
        finally:
            path.chmod(0o644)
            touch()
            wait_for(
                lambda: self._user_ok(user),
                DOVECOT_START_TIMEOUT_S,
                what=f"Dovecot finding {user} again",
                poll_s=DOVECOT_POLL_INTERVAL_S,
                context=self.log_tail,
            )

    def _user_ok(self, name: str) -> bool:
        done = subprocess.run(
            [_binary("doveadm"), "-c", str(self.config_path), "user", name],
            capture_output=True,
            timeout=DOVEADM_TIMEOUT_S,
            check=False,
        )
        return done.returncode == 0

    def close(self) -> None:
        """Stop the server and remove its files."""
        self._terminate()
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server's log (for failure messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def _failure_context(self, startup_log: Path) -> str:
        parts = [f"--- {self.log_path} (tail) ---", self.log_tail()]
        try:
            out = startup_log.read_text(errors="replace").strip()
        except FileNotFoundError:
            out = ""
        if out:
            parts += [f"--- {startup_log} ---", out[-4000:]]
        return "\n".join(parts)

    # -- configuration ---------------------------------------------------------

    def _write_config(self) -> None:
        # chroot needs root; without it the login processes run as we do.
        chroot = "" if self.as_root else "  chroot =\n"
        dh = f"ssl_dh = <{DH_PARAMS}\n" if DH_PARAMS.exists() else ""
        config = f"""\
# Written by tests/helpers/dovecot.py for one test session; see its docstring.
instance_name = {self.root.name}
base_dir = {self.base_dir}
state_dir = {self.state_dir}
listen = {HOST}, {MISMATCH_HOST}
protocols = imap
log_path = {self.log_path}
info_log_path = {self.log_path}
debug_log_path = {self.log_path}
default_internal_user = {self.internal_user}
default_internal_group = {self.internal_group}
default_login_user = {self.login_user}
first_valid_uid = {min(self.mail_uid, 500)}
first_valid_gid = {min(self.mail_gid, 1)}
mail_location = maildir:~/Maildir
mailbox_idle_check_interval = {MAILBOX_IDLE_CHECK_INTERVAL_S} secs
login_greeting = {self.greeting}
auth_mechanisms = plain login
disable_plaintext_auth = no
auth_failure_delay = 0
ssl = yes
ssl_cert = <{self.cert_file}
ssl_key = <{self.key_file}
{dh}
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {self.users_dir}/%u
}}
userdb {{
  driver = passwd-file
  args = username_format=%u {self.users_dir}/%u
}}
namespace inbox {{
  inbox = yes
  separator = /
  mailbox Drafts {{
    special_use = \\Drafts
  }}
  mailbox Junk {{
    special_use = \\Junk
  }}
  mailbox Sent {{
    special_use = \\Sent
  }}
  mailbox Trash {{
    special_use = \\Trash
  }}
}}
service imap-login {{
{chroot}  inet_listener imap {{
    port = {self.plain_port}
  }}
  inet_listener imaps {{
    port = {self.tls_port}
    ssl = yes
  }}
}}
service anvil {{
{chroot}  # Dovecot delays logins from an IP that failed recently (2 s, doubling to
  # 15 s: auth-penalty.c); every test connects from 127.0.0.1, so one test's
  # wrong password would slow the next test's logins. An auth process that
  # cannot open this socket disables the penalty (Dovecot wiki, Authentication/Penalty).
  unix_listener anvil-auth-penalty {{
    mode = 0
  }}
}}
"""
        self.config_path.write_text(config)

    # -- users -----------------------------------------------------------------

    def add_user(self, name: str, password: str) -> None:
        """Create `name` with `password`, or change its password.

        Each user has a passwd-file of its own (`users/NAME`), so a new user can
        log in at once. Dovecot looks at a file it has read at most once a
        second, so a changed password of a running server is waited for (until
        `doveadm auth test` accepts it, up to about a second).
        """
        if not _SAFE_NAME.match(name):
            raise ValueError(f"user name {name!r}: letters, digits and ._+- only")
        if any(ch in password for ch in ":\n\r\0"):
            raise ValueError("a passwd-file password cannot hold ':', newlines or NUL")
        path = self.users_dir / name
        changed = path.exists()
        line = f"{name}:{{PLAIN}}{password}:{self.mail_uid}:{self.mail_gid}::{self.home(name)}::\n"
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(line)
        tmp.chmod(0o644)  # read by the auth process (default_internal_user)
        tmp.replace(path)
        if changed and self.running:
            wait_for(
                lambda: self._auth_ok(name, password),
                DOVECOT_START_TIMEOUT_S,
                what=f"Dovecot accepting the new password of {name}",
                poll_s=DOVECOT_POLL_INTERVAL_S,
                context=self.log_tail,
            )

    def _auth_ok(self, name: str, password: str) -> bool:
        done = subprocess.run(
            [_binary("doveadm"), "-c", str(self.config_path), "auth", "test", name, password],
            capture_output=True,
            timeout=DOVEADM_TIMEOUT_S,
            check=False,
        )
        return done.returncode == 0

    def new_user(self, prefix: str = "user") -> ImapAccount:
        """A user with a name and password of its own, for one test."""
        account = ImapAccount(f"{prefix}-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex)
        self.add_user(account.username, account.password)
        return account

    def home(self, user: str) -> Path:
        """The home directory of `user` (its mail is in `Maildir/` below it)."""
        return self.home_root / user

    # -- doveadm ---------------------------------------------------------------

    def doveadm(self, *args: str, stdin: bytes | None = None) -> str:
        """Run `doveadm -c CONFIG ARGS…` against this server and return its stdout.

        Fails with doveadm's stderr and the server's log tail.
        """
        argv = [_binary("doveadm"), "-c", str(self.config_path), *args]
        try:
            done = subprocess.run(
                argv,
                input=stdin if stdin is not None else b"",
                capture_output=True,
                timeout=DOVEADM_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise DovecotError(
                f"{' '.join(argv)} took more than {DOVEADM_TIMEOUT_S} s\n{self.log_tail()}"
            ) from exc
        if done.returncode != 0:
            raise DovecotError(
                f"{' '.join(argv)} exited with {done.returncode}: "
                f"{done.stderr.decode(errors='replace').strip()}\n"
                f"--- {self.log_path} (tail) ---\n{self.log_tail()}"
            )
        return done.stdout.decode(errors="replace")

    def deliver(self, user: str, folder: str, raw: bytes) -> int:
        """Store `raw` in `folder` of `user` (`doveadm save`); return its UID.

        The folder must exist (INBOX always does; see `create_folder`). The
        message arrives unread, as new mail does. The UID is read back from the
        folder's UIDNEXT, so don't deliver to one folder from two threads.
        """
        self.doveadm("save", "-u", user, "-m", folder, stdin=raw)
        return self.status(user, folder).uidnext - 1

    def deliver_many(self, user: str, folder: str, messages: Iterable[bytes]) -> int:
        """Write `messages` into the Maildir of `folder` as a delivery agent would
        (tmp/ then rename into new/), for bulk loads where a doveadm process per
        message is too slow; return how many. Dovecot assigns their UIDs when it
        next looks at the folder (the next SELECT, STATUS or doveadm command).
        The folder must exist.
        """
        maildir = self._maildir(user, folder)
        count = 0
        for raw in messages:
            # The standard name (time, then M<microseconds>): Dovecot numbers new
            # files in the order of their names' times, so UIDs follow `messages`.
            now_us = time.time_ns() // 1000
            name = f"{now_us // 10**6}.M{now_us % 10**6}P{os.getpid()}Q{count}.inboxd-test"
            tmp = maildir / "tmp" / name
            tmp.write_bytes(raw)
            if self.as_root:
                os.chown(tmp, self.mail_uid, self.mail_gid)
            tmp.rename(maildir / "new" / name)
            count += 1
        return count

    def _maildir(self, user: str, folder: str) -> Path:
        # Maildir++ layout: INBOX is the Maildir itself, a folder "A/B" is ".A.B".
        base = self.home(user) / "Maildir"
        if folder.upper() == "INBOX":
            self.status(user, "INBOX")  # makes Dovecot create the Maildir, as mail_uid
            return base
        path = base / ("." + folder.replace("/", "."))
        if not (path / "new").is_dir():
            raise DovecotError(f"folder {folder!r} of {user} does not exist ({path})")
        return path

    def create_folder(self, user: str, folder: str) -> None:
        """Create (and subscribe) `folder` of `user`."""
        self.doveadm("mailbox", "create", "-s", "-u", user, folder)

    def delete_folder(self, user: str, folder: str) -> None:
        """Delete `folder` of `user` with every message in it."""
        self.doveadm("mailbox", "delete", "-s", "-u", user, folder)

    def recreate_folder(self, user: str, folder: str) -> tuple[int, int]:
        """Give `folder` a new UIDVALIDITY with the same mail; return (old, new).

        What another client or an administrator does, through Dovecot: the
        messages move to a holding folder, the folder is deleted and created
        again, and they move back — same bytes and flags, UIDs from 1 again
        under the new UIDVALIDITY (RFC 3501 §2.3.1.1). A session that has the
        folder selected is disconnected ("IMAP session state is inconsistent")
        or, depending on when Dovecot notices, keeps its old view until it
        selects the folder again. INBOX cannot be deleted: it gets a new
        UIDVALIDITY by `doveadm mailbox update` while empty, so its UIDs
        continue above the old UIDNEXT; a session that has it selected is
        disconnected.
        """
        old = self.status(user, folder).uidvalidity
        holding = f"inboxd-recreate-{uuid.uuid4().hex[:8]}"
        self.doveadm("mailbox", "create", "-u", user, holding)
        self.doveadm("move", "-u", user, holding, "mailbox", folder, "all")
        if folder.upper() == "INBOX":
            self.doveadm("mailbox", "update", "-u", user, "--uid-validity", str(old + 1), folder)
        else:
            self.doveadm("mailbox", "delete", "-u", user, folder)
            self.doveadm("mailbox", "create", "-u", user, folder)
        self.doveadm("move", "-u", user, folder, "mailbox", holding, "all")
        self.doveadm("mailbox", "delete", "-u", user, holding)
        new = self.status(user, folder).uidvalidity
        if new == old:
            raise DovecotError(f"UIDVALIDITY of {user}/{folder} stayed {old}")
        return old, new

    def expunge(self, user: str, folder: str, uid: int) -> None:
        """Expunge the message `uid` of `folder`, as another client would."""
        self.doveadm("expunge", "-u", user, "mailbox", folder, "uid", str(uid))

    def flags(self, user: str, folder: str) -> dict[int, set[str]]:
        """UID → flags of every message in `folder` (e.g. to assert no "\\Seen")."""
        out = self.doveadm("-f", "tab", "fetch", "-u", user, "uid flags", "mailbox", folder, "all")
        result: dict[int, set[str]] = {}
        for line in out.splitlines()[1:]:  # the first line names the columns
            uid, _, flags = line.partition("\t")
            result[int(uid)] = set(flags.split())
        return result

    def uids(self, user: str, folder: str) -> list[int]:
        """The UIDs of the messages in `folder`, ascending."""
        return sorted(self.flags(user, folder))

    def status(self, user: str, folder: str) -> FolderStatus:
        """MESSAGES, UIDVALIDITY, UIDNEXT and HIGHESTMODSEQ of `folder`."""
        out = self.doveadm(
            "-f",
            "tab",
            "mailbox",
            "status",
            "-u",
            user,
            "messages uidvalidity uidnext highestmodseq",
            folder,
        )
        header, values = out.splitlines()[:2]
        fields = dict(zip(header.split("\t"), values.split("\t"), strict=True))
        return FolderStatus(
            messages=int(fields["messages"]),
            uidvalidity=int(fields["uidvalidity"]),
            uidnext=int(fields["uidnext"]),
            highestmodseq=int(fields["highestmodseq"]),
        )


@pytest.fixture(scope="session")
def dovecot_server() -> Iterator[DovecotServer]:
    """The session's (the xdist worker's) Dovecot, started on first use."""
    with DovecotServer() as server:
        yield server


@pytest.fixture
def dovecot(dovecot_server: DovecotServer) -> DovecotServer:
    """The session's Dovecot, running: started again if an earlier test stopped it."""
    dovecot_server.start()
    return dovecot_server
