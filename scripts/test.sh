#!/usr/bin/env bash
# The one test command: installs what the tests use (Debian prometheus, prometheus-alertmanager,
# postgresql, docker-compose, chromium; a virtualenv with timwatch[test]; schemathesis in .venv-fuzz),
# starts a throw-away PostgreSQL on 127.0.0.1 and runs the whole suite. Extra arguments go to
# pytest (e.g. `scripts/test.sh -k engine`).
#
#   scripts/test.sh --quick [pytest args]   the inner loop: linters, then the unit and service
#                                           tiers only, without their load tests (no stack, no
#                                           `slow` load tests, no vLLM engine tier), without the
#                                           tests inside real trainer packages (`framework`) and
#                                           on SQLite only (no `postgres`: the full suite runs
#                                           every store test on both), installing only what
#                                           those need (promtool, a compiler)
set -euo pipefail
cd "$(dirname "$0")/.."
# where the run's time goes, for CI's 30-minute budget: seconds since the start, on stderr
phase() { echo "[scripts/test.sh] ${SECONDS} s: $*" >&2; }

# Python's bytecode caches on, also where the environment turns them off: the suite starts
# hundreds of Python processes (servers, CLI commands, proxies), each of which otherwise compiles
# timwatch from source, and each pytest worker rewrites every test module's asserts again
# (collecting the quick tier: 17 s against 6 s per worker). __pycache__ is git-ignored.
unset PYTHONDONTWRITEBYTECODE

QUICK=0
if [ "${1:-}" = "--quick" ]; then
  QUICK=1
  shift
fi

need=()
# promtool: tests/unit/test_exporter.py and the proxies' metrics in tests/service
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
if [ "$QUICK" = 0 ]; then
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
  command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 \
    || need+=(prometheus-alertmanager)
  command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 \
    || need+=(docker-compose)  # only its offline `config` check of deploy/docker-compose.yml
  # headless, for tests/stack/test_report_browser.py (the incident report in a real browser)
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  # the scale-out stack test (tests/stack/test_scaleout.py): load balancer and remote-write
  # receiver
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
  command -v victoria-metrics >/dev/null 2>&1 || need+=(victoria-metrics)
fi
# the stream reader's C code (sidecar/proxy/native/_cstream.c), built by the install below: a compiler
# and Python's headers (without them the install falls back to numba; here that would fail)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
"${PYTHON:-python3}" -c 'import os, sysconfig; p = sysconfig.get_paths()["include"]
raise SystemExit(not os.path.exists(os.path.join(p, "Python.h")))' || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need[*]}" >&2
  SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
# the full suite's two other venvs, built in the background while .venv is installed and the
# linters run (each is reused while its pin matches): vLLM's CPU build outside the clone for the
# real-engine tier (~2 min and 3.4 GB when it is not cached, .ci/vllm-venv.sh), and schemathesis
# in .venv-fuzz for tests/stack/test_openapi_fuzz.py (grafana-client's niquests pulls
# urllib3-future, which replaces urllib3 where it is installed and breaks schemathesis's
# requests transport)
background=()
if [ "$QUICK" = 0 ]; then
  VLLM_OUT="$(mktemp /tmp/timwatch-vllm-venv.XXXXXX)"
  bash .ci/vllm-venv.sh > "$VLLM_OUT" &
  background+=($!)
  SCHEMATHESIS_PIN="schemathesis==4.32.5"
  if [ ! -x .venv-fuzz/bin/st ] || ! grep -qx "$SCHEMATHESIS_PIN" .venv-fuzz/pinned 2>/dev/null
  then
    (
      rm -rf .venv-fuzz && "$PY" -m venv .venv-fuzz
      .venv-fuzz/bin/python -m pip install -q "$SCHEMATHESIS_PIN"
      echo "$SCHEMATHESIS_PIN" > .venv-fuzz/pinned
    ) &
    background+=($!)
  fi
  export TIMWATCH_SCHEMATHESIS="$PWD/.venv-fuzz/bin/st"
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# numba's kernels compiled once into its cache before the tests (~50 s of one core on a fresh
# clone, in the background while the rest is installed and the linters run): otherwise the first
# processes of both workers compile the same kernels at once, each taking over a minute, while
# tests wait for their servers. Compiled fresh (a clone's empty cache), the kernels' LLVM IR is
# read there too, for tests/unit/test_kernel_refcounts.py (which otherwise compiles them all
# again, ~2 min of one worker)
TIMWATCH_KERNEL_IR="$(mktemp /tmp/timwatch-kernel-ir.XXXXXX)"
export TIMWATCH_KERNEL_IR
trap 'rm -f "$TIMWATCH_KERNEL_IR"' EXIT
warming=""
warm_up() {
  .venv/bin/python -m tests.helpers.kernel_ir --warm-up "$TIMWATCH_KERNEL_IR" &
  warming=$!
}
# the installs below are skipped while what they read is unchanged (pyproject.toml, setup.py,
# the C reader's sources, the pinned trainer packages, this script): ~7 s of the inner loop
stamp="$(cat pyproject.toml setup.py tests/requirements-*.txt "$0" \
  $(find sidecar/proxy/native -name '*.c' -o -name '*.h' | sort) | sha256sum | cut -d' ' -f1)"
if [ "$(cat .venv/installed.sha256 2>/dev/null)" != "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # --no-compile: pip byte-compiles every module it installs (torch, transformers, ray: tens of
  # thousands; 103 s for both installs here against 59 s without), while the tests import a
  # fraction of them and write those .pyc files on first import
  .venv/bin/python -m pip install -q --no-compile -e '.[test]'
  warm_up  # needs only timwatch and numba: beside the trainer packages' install
  # the real trainer packages for their plug-ins' tests, without their own requirements (they
  # would replace torch==2.13.0): each with only what its imports need, pinned, in one call
  # (verl, TRL, AReaL's PPO actor, OpenRLHF, skyrl: tests/requirements-*.txt). Before the
  # linters: mypy must find the plug-ins' imports of trl and verl (it reads them as Any)
  .venv/bin/python -m pip install -q --no-compile --no-deps -r tests/requirements-verl.txt \
    -r tests/requirements-trl.txt -r tests/requirements-areal.txt \
    -r tests/requirements-openrlhf.txt -r tests/requirements-skyrl.txt
  echo "$stamp" > .venv/installed.sha256
fi
[ -n "$warming" ] || warm_up  # .venv was up to date
phase "packages and .venv installed"
if [ "$QUICK" = 0 ]; then  # the quick tier runs no postgres test
  if [ -z "${TIMWATCH_TEST_PG_URL:-}" ]; then
    # a fresh cluster in a new directory for this run, stopped and removed when the script exits
    PGDIR="$(mktemp -d /tmp/timwatch-pg-tests.XXXXXX)"
    stop_pg() {
      bash .ci/stop-postgres.sh "$PGDIR" >/dev/null 2>&1 || true
    }
    trap 'stop_pg; rm -f "$TIMWATCH_KERNEL_IR"' EXIT
    pg_url="$(PGDIR="$PGDIR" bash .ci/start-postgres.sh | tail -n1)"
    [ -n "$pg_url" ] || { echo "PostgreSQL did not start" >&2; exit 1; }
    export TIMWATCH_TEST_PG_URL="$pg_url"
  fi
  echo "PostgreSQL for the tests: $TIMWATCH_TEST_PG_URL" >&2
  export TIMWATCH_REQUIRE_PG=1  # a PostgreSQL test that would skip fails instead
fi
# the proxies read streams with the C code: a build that failed is an error, not numba quietly
export TIMWATCH_NATIVE=1

.venv/bin/ruff check timwatch monitor sidecar dashboards alerts tests benchmarks
.venv/bin/ruff format --check -q timwatch monitor sidecar dashboards alerts tests benchmarks
# the packages of [tool.mypy]: timwatch, with its linked sub-packages. Its cache lives outside the
# clone, like the vLLM venv, one per checkout path: on an empty cache mypy analyses torch,
# SQLAlchemy, numpy and the rest of what the code imports (22-26 s here; the trainer packages'
# trees are read as Any, see [tool.mypy]), 3 s with the cache. mypy checks each cached module
# against its source's hash, so a cache left by an earlier commit or another venv is re-read
# only where it still matches.
MYPY_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/timwatch/mypy-$(pwd -P | sha256sum | cut -c1-12)"
export MYPY_CACHE_DIR
.venv/bin/mypy
phase "linters done"
wait "$warming"
phase "kernels compiled"
if [ "$QUICK" = 0 ]; then
  for pid in "${background[@]}"; do wait "$pid"; done
  TIMWATCH_VLLM_PYTHON="$(tail -n1 "$VLLM_OUT")"
  rm -f "$VLLM_OUT"
  export TIMWATCH_VLLM_PYTHON TIMWATCH_REQUIRE_VLLM=1
  phase "vLLM and schemathesis venvs ready"
fi
if [ "$QUICK" = 1 ]; then
  # three workers: the quick tier's service tests mostly wait on their servers (175 s against
  # 189 s with two, same checkout, idle machine)
  .venv/bin/python -m pytest -p no:cacheprovider -n "${TIMWATCH_TEST_WORKERS:-3}" \
    --dist loadfile -m "not vllm and not slow and not framework and not postgres" \
    tests/unit tests/service "$@"
  phase "quick tier (unit + service) done"
  exit 0
fi
# three workers (a test file stays on one worker, so its module fixtures are shared): most tests
# wait on subprocesses, Prometheus or PostgreSQL (main pass 412 s against 469 s with two, same
# commit, 2-core machine). The vLLM tier stays after it: run beside the main pass, both slowed
# (667 s and 563 s) and the tier's in-flight reload tests failed.
.venv/bin/python -m pytest -p no:cacheprovider -n "${TIMWATCH_TEST_WORKERS:-3}" --dist loadfile \
  -m "not vllm" "$@"
phase "main pass done"
# the real-engine tier (tests/engine) after the rest, on one worker: one vLLM server at a time
# (exit 5: the arguments selected none of its tests). Without arguments it collects tests/engine
# alone: collecting the whole suite to deselect all but its 19 tests took 21 s against 8 s
# (the trainer packages' imports)
engine_args=("$@")
[ $# -gt 0 ] || engine_args=(tests/engine)
.venv/bin/python -m pytest -p no:cacheprovider -n 0 -m vllm "${engine_args[@]}" || [ $? -eq 5 ]
phase "vLLM tier done"
