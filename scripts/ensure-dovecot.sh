#!/usr/bin/env bash
# Make sure the test suite has Dovecot's binaries (tests/helpers/dovecot.py starts
# a private server per session on a free loopback port, with a config of its own):
# Debian's dovecot-imapd, and dovecot-core for `dovecot` and `doveadm`. Installs
# them as root when missing and fails with a clear message if it cannot.
#
# The machine's own dovecot service is never started or enabled: the packages'
# postinst would start it on ports 143/993, so a policy-rc.d that refuses every
# start is in place during the install (unless one already is), and a service
# that runs or is enabled afterwards anyway is stopped and disabled.
set -euo pipefail

PACKAGES=(dovecot-core dovecot-imapd)

have_binaries() {
    command -v dovecot >/dev/null && command -v doveadm >/dev/null \
        && [[ -x /usr/lib/dovecot/imap && -x /usr/lib/dovecot/imap-login ]]
}

fail() {
    echo "ensure-dovecot: $*" >&2
    echo "ensure-dovecot: the IMAP tests need Dovecot (Debian: apt-get install dovecot-imapd)" >&2
    exit 1
}

# Leave the system's dovecot stopped and disabled (only ever called right after
# we installed it: a dovecot someone set up on purpose is left alone).
quiet_system_service() {
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
        systemctl disable --now dovecot.socket dovecot.service >/dev/null 2>&1 || true
    else
        if [[ -x /etc/init.d/dovecot ]]; then
            /etc/init.d/dovecot stop >/dev/null 2>&1 || true
        fi
        if command -v update-rc.d >/dev/null; then
            update-rc.d dovecot disable >/dev/null 2>&1 || true
        fi
    fi
    # Whatever the init system: the master of the default config (/etc/dovecot),
    # identified by its pid file, never by a process name.
    if [[ -s /run/dovecot/master.pid ]]; then
        doveadm -c /etc/dovecot/dovecot.conf stop >/dev/null 2>&1 || true
    fi
}

if have_binaries; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    fail "dovecot-imapd is not installed and this is not root (install it, then run again)"
fi
if ! command -v apt-get >/dev/null; then
    fail "dovecot-imapd is not installed and there is no apt-get here"
fi

echo "ensure-dovecot: installing ${PACKAGES[*]}" >&2
POLICY=/usr/sbin/policy-rc.d
ours=""
if [[ ! -e $POLICY ]]; then
    # invoke-rc.d asks this before starting a service: 101 = "action forbidden".
    printf '#!/bin/sh\n# ensure-dovecot.sh: no service starts during this install\nexit 101\n' >"$POLICY"
    chmod 0755 "$POLICY"
    ours=$POLICY
fi
cleanup() { if [[ -n $ours ]]; then rm -f "$ours"; fi; }
trap cleanup EXIT

log=$(mktemp)
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${PACKAGES[@]}"; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    rm -f "$log"
    fail "apt-get install ${PACKAGES[*]} failed"
fi
rm -f "$log"
quiet_system_service

if ! have_binaries; then
    fail "installed ${PACKAGES[*]}, but dovecot, doveadm or /usr/lib/dovecot/imap is still missing"
fi
echo "ensure-dovecot: $(dovecot --version)" >&2
