#!/usr/bin/env bash
# Stop the throw-away PostgreSQL cluster that start-postgres.sh made in DIR, and remove DIR.
#   bash .ci/stop-postgres.sh /tmp/timwatch-pg.XXXXXX
set -euo pipefail
PGDIR="${1:?usage: stop-postgres.sh PGDIR}"
BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)"
if [ -f "$PGDIR/postmaster.pid" ]; then
  if [ "$(id -u)" = "0" ]; then
    runuser -u postgres -- "$BIN/pg_ctl" -D "$PGDIR" stop -m fast -w
  else
    "$BIN/pg_ctl" -D "$PGDIR" stop -m fast -w
  fi
fi
rm -rf "$PGDIR"
