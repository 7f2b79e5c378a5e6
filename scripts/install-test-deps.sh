#!/bin/sh
# Install the Debian packages the test suite starts as real processes:
#   redis-server  (the redis store tests)
#   prometheus    (the metrics proof: a real Prometheus scraping a real gateway; ships promtool)
#   postgresql    (the postgres store tests: initdb and pg_ctl, run as the `postgres` user in a
#                  temporary folder by tests/support/postgres.py; no system service is used)
#   chromium      (the console tests: a real headless browser, driven by Playwright, which
#                  cannot download its own browser builds here)
# Idempotent: does nothing when every command is already present, and runs
# `apt-get update` only when something has to be installed. Works as root, or through
# sudo when not root.
set -eu

missing=""
need() {
    # $1 = command that must exist, $2 = Debian package providing it
    if ! command -v "$1" >/dev/null 2>&1; then
        missing="$missing $2"
    fi
}

need redis-server redis-server
need prometheus prometheus
need promtool prometheus
need chromium chromium
# Debian keeps the server's programs out of the PATH, under /usr/lib/postgresql/<version>/bin.
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 && ! command -v pg_ctl >/dev/null 2>&1; then
    missing="$missing postgresql"
fi

if [ -z "$missing" ]; then
    echo "install-test-deps: nothing to do (redis-server, prometheus, promtool, chromium, postgresql present)"
    exit 0
fi

# The same package may be listed twice (prometheus provides both commands).
packages=$(printf '%s\n' $missing | sort -u | tr '\n' ' ')

if [ "$(id -u)" -eq 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1; then
    as_root="sudo"
else
    echo "install-test-deps: need root or sudo to install:$missing" >&2
    exit 1
fi

echo "install-test-deps: installing $packages"
export DEBIAN_FRONTEND=noninteractive
$as_root apt-get update -q
# --no-install-recommends: prometheus recommends node-exporter and friends, which the
# tests do not need. The package's postinst may try to start a system service; in a
# container without systemd that fails harmlessly, and the tests start their own.
# shellcheck disable=SC2086
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $packages

for cmd in redis-server prometheus promtool chromium; do
    if ! command -v "$cmd" >/dev/null 2>&1; then
        echo "install-test-deps: $cmd still missing after install" >&2
        exit 1
    fi
done
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 && ! command -v pg_ctl >/dev/null 2>&1; then
    echo "install-test-deps: postgresql (pg_ctl) still missing after install" >&2
    exit 1
fi
# Debian's package may start a cluster of its own as a system service; the tests do not use it.
echo "install-test-deps: done"
