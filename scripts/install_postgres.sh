#!/usr/bin/env bash
# PostgreSQL for the PostgreSQL backend's tests (they start their own throwaway server with initdb): Debian's
# `postgresql` package, installed when missing and when this machine can (root, or sudo without a password).
# Nothing else needs it: without it those tests are skipped, saying why, and set-up goes on.
set -uo pipefail

if command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "PostgreSQL is not installed and this machine has no apt-get: the PostgreSQL tests will be skipped"
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "PostgreSQL is not installed and installing it needs root: the PostgreSQL tests will be skipped" \
    "(sudo apt-get install postgresql)"
  exit 0
fi
echo "installing PostgreSQL (apt-get install postgresql) for the PostgreSQL backend's tests"
export DEBIAN_FRONTEND=noninteractive
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1; then
  "${as_root[@]}" apt-get update -q >/dev/null 2>&1
  if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends postgresql >/dev/null; then
    echo "apt-get could not install PostgreSQL: the PostgreSQL tests will be skipped"
    exit 0
  fi
fi
# The package may start a cluster of its own; the tests start theirs, so leave no server running.
"${as_root[@]}" service postgresql stop >/dev/null 2>&1 || true
exit 0
