#!/usr/bin/env bash
# Make sure a PostgreSQL server answers on 127.0.0.1:5432 (the test suite's database server).
# Starts the local Debian cluster when it is down; a no-op when KMQ_TEST_POSTGRES_URL points
# elsewhere or the server already answers.
set -euo pipefail

if [[ -n "${KMQ_TEST_POSTGRES_URL:-}" ]]; then
  exit 0
fi

answers() {
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -q -h 127.0.0.1 -p 5432
  else
    (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null
  fi
}

if answers; then
  exit 0
fi

if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  echo "PostgreSQL is not answering on 127.0.0.1:5432 and pg_ctlcluster is not installed." >&2
  echo "Install PostgreSQL (apt-get install postgresql) or set KMQ_TEST_POSTGRES_URL." >&2
  exit 1
fi

version="$(ls /etc/postgresql | sort -V | tail -n1)"
echo "Starting PostgreSQL ${version}/main ..."
pg_ctlcluster --skip-systemctl-redirect "${version}" main start || true

for _ in $(seq 1 60); do
  if answers; then
    echo "PostgreSQL is up."
    exit 0
  fi
  sleep 0.5
done
echo "PostgreSQL did not come up on 127.0.0.1:5432 within 30 s." >&2
exit 1
