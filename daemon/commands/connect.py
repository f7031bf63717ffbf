"""`inboxd connect gmail|outlook --tenant T --mailbox M`: sign in, keep the refresh token.

What both providers share lives here: the options (--tenant, --mailbox, --out,
--force), finding the mailbox and its provider table in the tenant file, refusing
an existing --out before anyone signs in, writing the token file and printing the
line for the tenant file. `connect outlook` signs in with the device authorization
grant (connect_outlook.py); `connect gmail` with the flow below.

The Gmail flow for installed applications with a loopback redirect and PKCE
(developers.google.com/identity/protocols/oauth2/native-app; RFC 7636 S256):

    1. listen on 127.0.0.1, ephemeral port: the redirect_uri
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
       file), never over an existing file without --force, and print the
       `refresh_token = "file:…"` line for the mailbox's table

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
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import anyio
from aiohttp import web

from inboxd.adapters.gmail.config import GmailSettings
from inboxd.adapters.gmail.errors import GmailConfigError
from inboxd.adapters.outlook.config import OutlookSettings
from inboxd.adapters.outlook.errors import OutlookConfigError
from inboxd.daemon.commands import connect_outlook
from inboxd.daemon.commands.common import EXIT_OK, EXIT_USAGE, CommandError, emit_json
from inboxd.daemon.config import ConfigError, load_main, load_tenants
from inboxd.daemon.config_reader import Options, Reader

#: Google's consent page (OAuth 2.0 for installed apps, "Step 2").
DEFAULT_AUTH_URL = "https://accounts.google.com/o/oauth2/v2/auth"
GMAIL_SCOPE = "https://www.googleapis.com/auth/gmail.readonly"
#: Long enough to sign in with a second factor; an abandoned run still ends.
DEFAULT_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 30.0
CALLBACK_PATH = "/"
# The provider table's parser and its error, by provider (= table name).
_SETTINGS: dict[str, tuple[Any, type[ValueError]]] = {
    "gmail": (GmailSettings, GmailConfigError),
    "outlook": (OutlookSettings, OutlookConfigError),
}


def register(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
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
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    if args.config is None:
        raise CommandError("connect needs --config FILE (the main config)", EXIT_USAGE)
    scale = connect_outlook.poll_scale(os.environ) if args.provider == "outlook" else 1.0
    target, out = await anyio.to_thread.run_sync(_plan, args)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if isinstance(target.settings, OutlookSettings):
            refresh = await connect_outlook.device_flow(target.settings, session, wait_scale=scale)
        else:
            refresh = await _consent(args, target, session)
    await anyio.to_thread.run_sync(lambda: _write_secret(out, refresh, force=args.force))
    line = f'refresh_token = "file:{out}"'
    if args.json:
        command = f"connect {args.provider}"
        emit_json({"command": command, "status": "ok", "file": str(out), "line": line})
    else:
        print(f"refresh token written to {out} (mode 0600); in mailbox {args.mailbox!r} put:")
        print(line)
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
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        redirect_uri = f"http://127.0.0.1:{runner.addresses[0][1]}{CALLBACK_PATH}"
        query = {
            "client_id": settings.client_id,
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
        url = f"{args.auth_url}{'&' if '?' in args.auth_url else '?'}{urlencode(query)}"
        print(f"Open this URL in a browser and allow access for {target.address}:", file=sys.stderr)
        print(url, file=sys.stderr, flush=True)
        with anyio.move_on_after(args.timeout):
            await arrived.wait()
    finally:
        await runner.cleanup()
    if not arrived.is_set():
        raise CommandError(f"no answer from the browser within {args.timeout:g} s")
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


def _write_secret(path: Path, value: str, *, force: bool) -> None:
    """Write `value` to `path`, readable by its owner only (0600) from the first byte.

    The value goes to a temporary file next to `path` (created 0600, O_EXCL, synced),
    which then takes the name in one step: os.link, which fails when `path` exists,
    so without `force` an existing file is never touched; os.replace with `force`.
    Nobody ever sees `path` half-written, and a crash leaves it as it was."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o600)  # exactly 0600, whatever the umask
            fh.write(value + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if force:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)
    except FileExistsError:
        raise CommandError(f"{path} exists: pass --force to replace it", EXIT_USAGE) from None
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)  # after os.link; gone already after os.replace
