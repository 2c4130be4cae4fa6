#!/usr/bin/env bash
# Start a throw-away PostgreSQL cluster on 127.0.0.1 for the store tests and benchmarks.
# Installs Debian's `postgresql` if it is missing, initialises a cluster in $PGDIR (default
# /tmp/timwatch-pg), listens on 127.0.0.1 only (a free port unless $PGPORT is set), trusts local
# connections and creates database `timwatch`. The last line printed on stdout is the SQLAlchemy
# URL, e.g. `export TIMWATCH_TEST_PG_URL=$(bash .ci/start-postgres.sh | tail -n1)`.
# Stop (and remove) it with: bash .ci/stop-postgres.sh "$PGDIR".
set -euo pipefail

PGDIR="${PGDIR:-/tmp/timwatch-pg}"

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "installing postgresql" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
fi
BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)"

as_pg() {
  if [ "$(id -u)" = "0" ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

if [ -z "${PGPORT:-}" ]; then
  PGPORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
fi

if [ -f "$PGDIR/postmaster.pid" ] && as_pg "$BIN/pg_ctl" -D "$PGDIR" status >/dev/null 2>&1; then
  as_pg "$BIN/pg_ctl" -D "$PGDIR" stop -m fast >&2
fi
rm -rf "$PGDIR"
mkdir -p "$PGDIR"
if [ "$(id -u)" = "0" ]; then chown postgres:postgres "$PGDIR"; fi

as_pg "$BIN/initdb" -D "$PGDIR" -U postgres --auth=trust --encoding=UTF8 --locale=C.UTF-8 >&2
as_pg "$BIN/pg_ctl" -D "$PGDIR" -l "$PGDIR/server.log" -w -t 60 \
  -o "-c listen_addresses=127.0.0.1 -p $PGPORT -k $PGDIR -c fsync=on" start >&2
as_pg "$BIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U postgres timwatch >&2

echo "postgresql+psycopg://postgres@127.0.0.1:$PGPORT/timwatch"
