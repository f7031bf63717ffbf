"""`inboxd connect gmail|outlook --tenant T --mailbox M`: sign in, keep the refresh token.

What both providers share lives here: the options (--tenant, --mailbox, --out,
--force), finding the mailbox and its provider table in the tenant file, refusing
an existing --out before anyone signs in, writing the token file and printing the
line for the tenant file. `connect outlook` signs in with the device authorization
grant (connect_outlook.py); `connect gmail` with the flow below.

The Gmail flow for installed applications with a loopback redirect and PKCE
(developers.google.com/identity/protocols/oauth2/native-app; RFC 7636 S256):

    1. listen on 127.0.0.1, an ephemeral port or --port (so an SSH tunnel from the
       operator's computer can be opened first on a headless VM): the redirect_uri.
       --manual listens nowhere: the browser's redirect fails to load, and the
       operator pastes the address it shows (code and state) into the command
    2. print the consent URL (client_id, redirect_uri, response_type=code, the
       gmail.readonly scope, access_type=offline + prompt=consent so that Google
       issues a refresh token even to a returning user, state, code_challenge,
       login_hint = the mailbox address); the operator opens it in a browser
    3. wait, at most --timeout seconds, for the browser's redirect; refuse a wrong
       state (a forged or stale redirect), report an `error=` answer
    4. exchange the code at the tenant's token_url with the code_verifier
    5. ask Gmail whose mailbox the token opens: a consent given for another
       account is refused, nothing is written
    6. write the refresh token to a 0600 file (--out; default next to the tenant
       file), owned by --owner when given (the daemon's user: run as root, the file
       would otherwise be root's and unreadable by the daemon), never over an
       existing file without --force; check the written file's owner and mode, and
       print the `refresh_token = "file:…"` line for the mailbox's table and the
       next step

gmail.readonly is the narrowest scope that covers everything the door calls:
getProfile, messages.list/get with format=raw (gmail.metadata has no bodies),
history.list and users.watch ("Authorization scopes" of each method's reference).

The tenant file is read raw (its `[gmail]`/`[outlook]` table and the mailbox's
address), not through load_tenants: a mailbox that has no refresh_token yet — the
reason to run this command — may make its file invalid for `inboxd run`.

The token file is written readable by its owner only from its first byte, and takes
its name in one step (`_write_secret`): nobody sees it half-written or world-readable.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import aiohttp
import anyio
from aiohttp import web

from inboxd.adapters.gmail.config import GmailSettings
from inboxd.adapters.gmail.errors import GmailConfigError
from inboxd.adapters.outlook.config import OutlookSettings
from inboxd.adapters.outlook.errors import OutlookConfigError
from inboxd.daemon.commands import connect_outlook
from inboxd.daemon.commands.common import EXIT_OK, EXIT_USAGE, CommandError, Subparsers, emit_json
from inboxd.daemon.config.main import ConfigError, load_main, load_tenants
from inboxd.daemon.config.reader import Options, Reader

#: Google's consent page (OAuth 2.0 for installed apps, "Step 2").
DEFAULT_AUTH_URL = "https://accounts.google.com/o/oauth2/v2/auth"
GMAIL_SCOPE = "https://www.googleapis.com/auth/gmail.readonly"
#: Long enough to sign in with a second factor; an abandoned run still ends.
DEFAULT_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 30.0
CALLBACK_PATH = "/"
#: The redirect port of --manual without --port: any loopback port works for a Desktop
#: OAuth client (Google's native-app guide); nothing is expected to listen on it on the
#: operator's computer, so the redirect stops in the address bar, ready to copy.
MANUAL_REDIRECT_PORT = 8976
# The provider table's parser and its error, by provider (= table name).
_SETTINGS: dict[str, tuple[Any, type[ValueError]]] = {
    "gmail": (GmailSettings, GmailConfigError),
    "outlook": (OutlookSettings, OutlookConfigError),
}


def register(subparsers: Subparsers, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "connect",
        help="connect a provider mailbox (OAuth sign-in, refresh token kept in a file)",
        description="Connect a mailbox of a tenant file to its provider account.",
    )
    providers = parser.add_subparsers(dest="provider", metavar="PROVIDER", required=True)
    gmail = providers.add_parser(
        "gmail",
        parents=[parent],
        help="Gmail: OAuth consent, refresh token written to a 0600 file",
        description="Print Google's consent URL, wait for the browser's redirect to "
        "127.0.0.1, and write the mailbox's refresh token to a file only you can read; "
        'then put the printed refresh_token = "file:…" line in the mailbox\'s table.',
    )
    _mailbox_arguments(gmail, "gmail")
    gmail.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for the browser (default: %(default)g)",
    )
    gmail.add_argument(
        "--port",
        type=_port,
        default=0,
        help="loopback port of the redirect (default: any free one); fix it to open an SSH "
        "tunnel first: ssh -L PORT:127.0.0.1:PORT this-host",
    )
    gmail.add_argument(
        "--manual",
        action="store_true",
        help="listen nowhere: after consent, paste the address the browser was sent to "
        "(for a machine whose loopback your browser cannot reach)",
    )
    gmail.add_argument(
        "--auth-url",
        default=DEFAULT_AUTH_URL,
        help="authorization endpoint (default: Google's; tests use a fake)",
    )
    outlook = providers.add_parser(
        "outlook",
        parents=[parent],
        help="Outlook / Microsoft 365: device code sign-in, refresh token written to a 0600 file",
        description="Print Microsoft's sign-in page and code, wait (up to the code's "
        "lifetime, 15 minutes) for someone to sign in there with access to the mailbox, "
        "and write the delegated refresh token to a file only you can read; then put the "
        'printed refresh_token = "file:…" line in the mailbox\'s table. Ctrl-C stops '
        f"waiting. ({connect_outlook.ENV_TEST_POLL_SCALE} is for tests only.)",
    )
    _mailbox_arguments(outlook, "outlook")


def _mailbox_arguments(parser: argparse.ArgumentParser, provider: str) -> None:
    parser.add_argument("--tenant", required=True, help=f"tenant id (its file has [{provider}])")
    parser.add_argument("--mailbox", required=True, help=f'mailbox id (provider = "{provider}")')
    parser.add_argument(
        "--out",
        type=Path,
        help="refresh token file (default: TENANT.MAILBOX.refresh-token next to the tenant file)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--owner",
        metavar="USER",
        help="make the token file USER's (the daemon's user, e.g. inboxd; needs root), "
        "still readable by that user only",
    )
    parser.set_defaults(handler=run)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}")
    return port


def _owner(name: str | None) -> tuple[int, int] | None:
    """(uid, gid) of --owner: the user's and their primary group's."""
    if name is None:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise CommandError(f"--owner {name}: no such user", EXIT_USAGE) from None
    if os.geteuid() not in (0, entry.pw_uid):
        raise CommandError(f"--owner {name}: only root can give a file to another user", EXIT_USAGE)
    return entry.pw_uid, entry.pw_gid


async def run(args: argparse.Namespace) -> int:
    if args.config is None:
        raise CommandError("connect needs --config FILE (the main config)", EXIT_USAGE)
    scale = connect_outlook.poll_scale(os.environ) if args.provider == "outlook" else 1.0
    target, out = await anyio.to_thread.run_sync(_plan, args)
    owner = _owner(args.owner)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if isinstance(target.settings, OutlookSettings):
            refresh = await connect_outlook.device_flow(target.settings, session, wait_scale=scale)
        else:
            refresh = await _consent(args, target, session)
    await anyio.to_thread.run_sync(
        lambda: _write_secret(out, refresh, force=args.force, owner=owner)
    )
    line = f'refresh_token = "file:{out}"'
    if args.json:
        command = f"connect {args.provider}"
        emit_json({"command": command, "status": "ok", "file": str(out), "line": line})
    else:
        whose = f", owner {args.owner}" if args.owner else ""
        print(
            f"refresh token written to {out} (mode 0600{whose}); in mailbox {args.mailbox!r} put:"
        )
        print(line)
        print(
            f"Next: put that line in mailbox {args.mailbox!r} of {target.tenant_file}, run "
            f"'inboxd check-config {args.config}', then reload the daemon "
            "('systemctl reload inboxd', or SIGHUP); 'inboxd status' shows the mailbox "
            "syncing.",
            file=sys.stderr,
        )
    return EXIT_OK


class _Target:
    def __init__(
        self, tenant_file: Path, settings: GmailSettings | OutlookSettings, address: str
    ) -> None:
        self.tenant_file = tenant_file
        self.settings = settings
        self.address = address


def _plan(args: argparse.Namespace) -> tuple[_Target, Path]:
    """The mailbox to connect and the file to write (refused early when it exists,
    so nobody signs in for nothing)."""
    target = _find_mailbox(args.config, args.tenant, args.mailbox, args.provider)
    name = f"{args.tenant}.{args.mailbox}.refresh-token"
    out: Path = (args.out or target.tenant_file.parent / name).expanduser().absolute()
    if out.exists() and not args.force:
        raise CommandError(f"{out} exists: pass --force to replace it", EXIT_USAGE)
    if not out.parent.is_dir():
        raise CommandError(f"{out.parent}: no such directory (for --out)", EXIT_USAGE)
    return target, out


def _find_mailbox(config: Path, tenant_id: str, mailbox_id: str, provider: str) -> _Target:
    """The tenant's `[provider]` table, parsed, and the mailbox's address; CommandError
    (exit 2) naming the file and key when either cannot serve."""
    parse, config_error = _SETTINGS[provider]
    try:
        main = load_main(config)
    except ConfigError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from exc
    for path in load_tenants(main).files:
        r = Reader(path, Options(check_secrets=False, environ=None))
        raw = r.read_toml()
        if raw is None or raw.get("id") != tenant_id:
            continue
        table = raw.get(provider)
        if not isinstance(table, dict):
            raise CommandError(
                f"{path}: {provider}: tenant {tenant_id!r} has no [{provider}] table", EXIT_USAGE
            )
        frozen = r.freeze(table, provider)
        if r.problems:
            raise CommandError(str(r.problems[0]), EXIT_USAGE)
        try:
            settings = parse.from_settings(frozen)
        except config_error as exc:
            raise CommandError(f"{path}: {provider}.{exc}", EXIT_USAGE) from exc
        if isinstance(settings, GmailSettings) and (
            settings.client_id is None or settings.client_secret is None
        ):
            raise CommandError(
                f"{path}: gmail.client_id: consent needs the OAuth client", EXIT_USAGE
            )
        for i, box in enumerate(raw.get("mailboxes") or []):
            if isinstance(box, dict) and box.get("id") == mailbox_id:
                address = box.get("address")
                if box.get("provider") != provider or not isinstance(address, str):
                    raise CommandError(
                        f'{path}: mailboxes[{i}]: needs provider = "{provider}" and an address',
                        EXIT_USAGE,
                    )
                return _Target(path, settings, address.strip())
        raise CommandError(f"{path}: no mailbox {mailbox_id!r} in tenant {tenant_id!r}", EXIT_USAGE)
    raise CommandError(f"no tenant {tenant_id!r} in {main.tenants_dir}", EXIT_USAGE)


async def _consent(
    args: argparse.Namespace, target: _Target, session: aiohttp.ClientSession
) -> str:
    settings = target.settings
    assert isinstance(settings, GmailSettings)
    assert settings.client_id is not None and settings.client_secret is not None
    verifier = secrets.token_urlsafe(64)  # 86 chars of RFC 7636's unreserved alphabet
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
    state = secrets.token_urlsafe(24)
    if args.manual:
        port = args.port or MANUAL_REDIRECT_PORT
        redirect_uri = f"http://127.0.0.1:{port}{CALLBACK_PATH}"
        url = _consent_url(
            args.auth_url, settings.client_id, redirect_uri, target, state, challenge
        )
        answer = await _pasted_answer(url, target.address, state, args.timeout)
    else:
        answer, redirect_uri = await _redirected_answer(args, settings, target, state, challenge)
    if "code" not in answer:
        raise CommandError(f"consent not given: {answer.get('error', 'no code')[:100]}")
    form = {
        "grant_type": "authorization_code",
        "code": answer["code"],
        "redirect_uri": redirect_uri,
        "client_id": settings.client_id,
        "client_secret": settings.client_secret.reveal(),
        "code_verifier": verifier,
    }
    tokens = await _post_json(session, settings.token_url, form)
    refresh, access = tokens.get("refresh_token"), tokens.get("access_token")
    if not isinstance(refresh, str) or not isinstance(access, str):
        raise CommandError("the token endpoint issued no refresh token: connect again")
    await _check_account(session, settings, access, target.address)
    return refresh


def _consent_url(
    auth_url: str, client_id: str, redirect_uri: str, target: _Target, state: str, challenge: bytes
) -> str:
    query = {
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "response_type": "code",
        "scope": GMAIL_SCOPE,
        "access_type": "offline",
        "prompt": "consent",
        "login_hint": target.address,
        "state": state,
        "code_challenge": challenge.decode().rstrip("="),
        "code_challenge_method": "S256",
    }
    return f"{auth_url}{'&' if '?' in auth_url else '?'}{urlencode(query)}"


async def _redirected_answer(
    args: argparse.Namespace,
    settings: GmailSettings,
    target: _Target,
    state: str,
    challenge: bytes,
) -> tuple[dict[str, str], str]:
    """The redirect's query, received on 127.0.0.1 (--port or a free port), and the
    redirect_uri; CommandError when the port is taken or nothing came in time."""
    assert settings.client_id is not None
    answer: dict[str, str] = {}
    arrived = anyio.Event()

    async def callback(request: web.Request) -> web.Response:
        # Only the redirect carrying our state counts; anything else (a stale tab,
        # a page probing localhost) is refused without ending the wait.
        if not hmac.compare_digest(request.query.get("state", ""), state):
            return web.Response(status=400, text="inboxd: unexpected request (state)\n")
        answer.update(request.query)
        arrived.set()
        return web.Response(text="inboxd: done, you can close this window.\n")

    app = web.Application()
    app.router.add_get(CALLBACK_PATH, callback)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, "127.0.0.1", args.port).start()
        except OSError as exc:
            raise CommandError(
                f"cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc} "
                "(choose another --port)"
            ) from exc
        redirect_uri = f"http://127.0.0.1:{runner.addresses[0][1]}{CALLBACK_PATH}"
        url = _consent_url(
            args.auth_url, settings.client_id, redirect_uri, target, state, challenge
        )
        print(f"Open this URL in a browser and allow access for {target.address}:", file=sys.stderr)
        print(url, file=sys.stderr, flush=True)
        with anyio.move_on_after(args.timeout):
            await arrived.wait()
    finally:
        await runner.cleanup()
    if not arrived.is_set():
        raise CommandError(f"no answer from the browser within {args.timeout:g} s")
    return answer, redirect_uri


async def _pasted_answer(url: str, address: str, state: str, timeout_s: float) -> dict[str, str]:
    """--manual: print the consent URL, read the address the browser was sent to from
    standard input; CommandError for a wrong state, no input or no input in time."""
    print(f"Open this URL in a browser and allow access for {address}:", file=sys.stderr)
    print(url, file=sys.stderr)
    print(
        "The browser then opens a 127.0.0.1 address that does not load. Copy that whole "
        "address from the address bar and paste it here:",
        file=sys.stderr,
        flush=True,
    )
    pasted = await _read_line(timeout_s)
    if pasted is None:
        raise CommandError(f"nothing pasted within {timeout_s:g} s")
    text = pasted.strip()
    query = urlsplit(text).query if "://" in text else text.lstrip("?")
    answer = {key: values[-1] for key, values in parse_qs(query).items()}
    if not answer:
        raise CommandError("that is not the address the browser was sent to (no code, no state)")
    if not hmac.compare_digest(answer.get("state", ""), state):
        raise CommandError("that address belongs to another sign-in (state): connect again")
    return answer


async def _read_line(timeout_s: float) -> str | None:
    """One line of standard input, None when none came within `timeout_s`. Read on the
    event loop, not in a thread: a thread blocked in readline would keep the process
    alive after a timeout until someone pressed Enter."""
    fd = sys.stdin.fileno()
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return sys.stdin.readline()  # a file cannot be waited on, and never blocks
    buffer = b""
    with anyio.move_on_after(timeout_s):
        while b"\n" not in buffer:
            await anyio.wait_readable(fd)
            chunk = os.read(fd, 4096)
            if not chunk:
                break  # end of input
            buffer += chunk
        return buffer.decode(errors="replace")
    return None


async def _post_json(session: aiohttp.ClientSession, url: str, form: dict[str, str]) -> Any:
    try:
        async with session.post(url, data=form) as response:
            body = await response.json(content_type=None)
            status = response.status
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise CommandError(f"token endpoint {url}: {type(exc).__name__}") from exc
    if status != 200 or not isinstance(body, dict):
        error = body.get("error", "?") if isinstance(body, dict) else "?"
        raise CommandError(f"token endpoint {url} answered {status} {str(error)[:60]}")
    return body


async def _check_account(
    session: aiohttp.ClientSession, settings: GmailSettings, access: str, address: str
) -> None:
    """Refuse a consent given for another account than the mailbox's (the browser
    may have been signed in as someone else)."""
    url = f"{settings.api_url}/gmail/v1/users/me/profile"
    try:
        async with session.get(url, headers={"Authorization": f"Bearer {access}"}) as response:
            profile = await response.json(content_type=None)
            status = response.status
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise CommandError(f"Gmail getProfile: {type(exc).__name__}") from exc
    got = profile.get("emailAddress") if isinstance(profile, dict) else None
    if status != 200 or not isinstance(got, str):
        raise CommandError(f"Gmail getProfile answered {status}")
    if got.strip().lower() != address.lower():
        raise CommandError(
            f"consent was given for {got}, not {address}: connect again and choose {address}"
        )


def _write_secret(
    path: Path, value: str, *, force: bool, owner: tuple[int, int] | None = None
) -> None:
    """Write `value` to `path`, readable by its owner only (0600) from the first byte,
    owned by `owner` (uid, gid) when given; the file's mode and owner are checked
    once it has its name.

    The value goes to a temporary file next to `path` (created 0600, O_EXCL, synced),
    which then takes the name in one step: os.link, which fails when `path` exists,
    so without `force` an existing file is never touched; os.replace with `force`.
    Nobody ever sees `path` half-written, and a crash leaves it as it was."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o600)  # exactly 0600, whatever the umask
            if owner is not None:
                os.fchown(fh.fileno(), *owner)
            fh.write(value + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if force:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)
        _check_secret_file(path, owner)
    except FileExistsError:
        raise CommandError(f"{path} exists: pass --force to replace it", EXIT_USAGE) from None
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)  # after os.link; gone already after os.replace


def _check_secret_file(path: Path, owner: tuple[int, int] | None) -> None:
    """The written file is what the daemon's user needs: a regular file, 0600, its
    owner's (a filesystem that ignores modes or owners, e.g. some mounts, is caught)."""
    info = os.stat(path, follow_symlinks=False)
    uid = os.geteuid() if owner is None else owner[0]
    if not stat.S_ISREG(info.st_mode) or stat.S_IMODE(info.st_mode) != 0o600 or info.st_uid != uid:
        raise CommandError(
            f"{path} was written but is mode {stat.S_IMODE(info.st_mode):o}, owner uid "
            f"{info.st_uid} (wanted 0600, uid {uid}): choose another --out"
        )
