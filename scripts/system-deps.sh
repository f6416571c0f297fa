#!/usr/bin/env bash
# The Debian packages `make test` runs for real, installed only when missing:
#   chromium    /usr/bin/chromium, the console's browser tests (never a browser of Playwright's own)
#   postgresql  the PostgreSQL 15 server: initdb and pg_ctl under /usr/lib/postgresql/15/bin, for
#               the throwaway clusters of the database tests
# Present already: returns at once, touching nothing. Missing: one `apt-get update`, then one
# `apt-get install`, as root directly or through `sudo -n`; with neither, it fails with the
# command to run. SYSTEM_DEPS_ROOT moves the checks under another root (its own tests).
set -euo pipefail

root="${SYSTEM_DEPS_ROOT:-}"
missing=()

# Where tests/support/browser.py looks.
[ -x "$root/usr/bin/chromium" ] || missing+=(chromium)

# Where tests/support/postgres.py looks: on PATH, else Debian's versioned directories.
has_pg_binary() {
    local name="$1" found
    if [ -z "$root" ] && command -v "$name" >/dev/null 2>&1; then
        return 0
    fi
    for found in "$root"/usr/lib/postgresql/*/bin/"$name"; do
        [ -x "$found" ] && return 0
    done
    return 1
}
if ! has_pg_binary initdb || ! has_pg_binary pg_ctl; then
    missing+=(postgresql)
fi

[ "${#missing[@]}" -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "make test needs ${missing[*]} (/usr/bin/chromium; PostgreSQL's initdb and pg_ctl)" \
        "and installs them only with apt-get, which this machine lacks: install them yourself" >&2
    exit 1
fi
command_line="apt-get update && apt-get install -y ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    as_root=(sudo -n)
else
    echo "make test needs the Debian packages ${missing[*]} and cannot install them (not root," \
        "no password-less sudo): run  sudo sh -c '$command_line'  and make test again" >&2
    exit 1
fi

echo "installing the Debian packages the tests use: ${missing[*]}"
apt() {
    local output
    if ! output=$("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "$@" 2>&1); then
        printf '%s\n' "$output" >&2
        echo "apt-get $* failed (above); the packages: ${missing[*]}" >&2
        exit 1
    fi
}
apt update -qq
apt install -y -qq "${missing[@]}"
