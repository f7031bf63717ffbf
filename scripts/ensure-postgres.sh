#!/usr/bin/env bash
# Make sure the test suite has a PostgreSQL server (tests/conftest.py):
# INBOXD_TEST_DSN if set; else 127.0.0.1:5432 if it answers; else start the
# machine's cluster, installing Debian's postgresql package if there is none.
# If all that fails the suite falls back to the embedded server by itself.
set -euo pipefail

answers() { (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }

if [[ -n "${INBOXD_TEST_DSN:-}" ]] || answers; then
    exit 0
fi
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "ensure-postgres: installing postgresql" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
        # a cluster we just made for tests: trust loopback, as the suite expects
        for hba in /etc/postgresql/*/main/pg_hba.conf; do
            sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
        done
    fi
fi
if command -v pg_ctlcluster >/dev/null && ls /etc/postgresql/ >/dev/null 2>&1; then
    for version in $(ls /etc/postgresql); do
        pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null || true
    done
fi
for _ in $(seq 1 30); do
    answers && break
    sleep 1  # waiting for a server we just started; polled with a deadline
done
if answers; then
    # the suite connects as postgres without a password (trust on loopback)
    su postgres -c "psql -qc 'select 1'" >/dev/null 2>&1 || true
    exit 0
fi
echo "ensure-postgres: no server on 127.0.0.1:5432; tests will use the embedded one" >&2
