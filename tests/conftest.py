"""Fixtures shared by every tier: the app in process, ``timwatch serve`` subprocesses and a real
PostgreSQL.

API tests talk to the app in this process (`app_factory`, `app`: `tests.helpers.inproc`) on a real
store. What needs a process uses ``python -m timwatch serve`` subprocesses on free 127.0.0.1 ports
(`tests.helpers.procs`): the session's `shared_server` (tests that share it use `fresh_run` ids),
a test module's `server` (its tests use their own run names), or `server_factory` for one with its
own database or flags. PostgreSQL comes from
``TIMWATCH_TEST_PG_URL`` (``.ci/start-postgres.sh`` prints one); each test that asks for it gets a
fresh database. With ``CI`` or ``TIMWATCH_REQUIRE_PG`` set, a missing PostgreSQL fails the test
instead of skipping it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import logs
from tests.helpers.pg import fresh_database
from tests.helpers.procs import (
    ServerProc,
    free_port,
    server_env,
    shared_server_proc,
    sqlite_server_proc,
)

if TYPE_CHECKING:  # the app's modules load on first use, not for every test session
    from tests.helpers.inproc import InProcessApp


@pytest.fixture(autouse=True)
def _logging_as_found() -> None:
    """The process's logging manager back before every test (`tests.helpers.logs`: AReaL
    replaces it when its code runs)."""
    logs.restore()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProc]]:
    """Start servers: ``server_factory(db=None, args=[...], env={...}, token=None)``."""
    started: list[ServerProc] = []

    def make(
        db: str | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        token: str | None = None,
        start: bool = True,
    ) -> ServerProc:
        db = db or f"sqlite:///{tmp_path / f'tw-{len(started)}.db'}"
        srv = ServerProc(
            db=db,
            port=free_port(),
            args=list(args or []),
            env=server_env(env),
            log=tmp_path / f"server-{len(started)}.log",
            token=token,
        )
        started.append(srv)
        return srv.start() if start else srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def _module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = sqlite_server_proc(tmp_path_factory.mktemp("module-server"), "tw")
    yield srv
    srv.stop()


@pytest.fixture
def server(_module_server: ServerProc) -> ServerProc:
    """The test module's server on its own SQLite file, writes open: started on first use and
    again if a test left it dead. The module's tests share its data: each uses its own runs."""
    return _module_server.running()


@pytest.fixture(scope="session")
def _shared_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = shared_server_proc(tmp_path_factory.mktemp("shared-server"))
    yield srv.start()
    srv.stop()


@pytest.fixture
def shared_server(_shared_server_session: ServerProc) -> ServerProc:
    """The one server process of the session (`tests.helpers.procs.shared_server_proc`), started
    on first use and again if a test left it dead. Its data outlives the test: use `fresh_run`."""
    return _shared_server_session.running()


@pytest.fixture
def app_factory(tmp_path: Path) -> Iterator[Callable[..., InProcessApp]]:
    """In-process apps: ``app_factory(db=None, clock=None, **settings)``, by default on a fresh
    SQLite file and the system clock (a `tests.helpers.clock.FakeClock` moves only when the
    test advances it); each one's lifespan ends (closing its store) when the test does."""
    from tests.helpers.inproc import in_process
    from timwatch.monitor import Settings

    with ExitStack() as stack:
        made = 0

        def make(db: str | None = None, clock: Any = None, **settings: Any) -> InProcessApp:
            nonlocal made
            db = db or f"sqlite:///{tmp_path / f'app-{made}.db'}"
            made += 1
            app = in_process(Settings(db_url=db, **settings), clock=clock)
            return stack.enter_context(app)

        yield make


@pytest.fixture
def app(app_factory: Callable[..., InProcessApp]) -> InProcessApp:
    """An in-process app on a fresh SQLite file, no tokens: ``with app.client() as c``."""
    return app_factory()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test (dropped afterwards)."""
    with fresh_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return str(request.getfixturevalue("pg_url"))


# The files that take a worker longest (from ``--durations``), collected first so that the
# two workers start them early and the short files fill in around them (``--dist loadfile``
# hands out files in collection order); collected last, one ran alone at the end.
LONGEST_FIRST = (
    "stack/test_openapi_fuzz.py",
    "unit/test_kernel_refcounts.py",
    "service/test_report.py",
    "stack/test_stack_integration.py",
    "service/test_durability.py",
    "stack/test_scaleout.py",
    "stack/test_demo.py",
    "service/test_doc_snippets.py",
    "service/test_hostile.py",
    "service/test_cli_errors.py",
    "service/test_serving.py",
)


#: how a test module marks itself `framework` (it runs inside a real trainer package)
FRAMEWORK_MARK = "pytestmark = pytest.mark.framework"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "… not framework"`` (the quick tier) a module marked `framework` is not
    imported at all: each imports its trainer package at its top (verl alone ~3 s of CPU), and
    every xdist worker collects every module, so deselecting its tests after import would still
    cost each worker those seconds."""
    if "not framework" not in (config.option.markexpr or ""):
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    text = collection_path.read_text(encoding="utf-8")
    return True if f"\n{FRAMEWORK_MARK}" in text else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tier markers: everything under tests/stack is ``slow``; a test on PostgreSQL is
    ``postgres`` (so ``-m "not slow"`` or ``-m "not postgres"`` select quick subsets). Then
    the `LONGEST_FIRST` files move to the front, in that order (the rest keep theirs)."""
    here = Path(__file__).resolve().parent
    rank = {str(here / name): i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(Path(str(item.fspath)).resolve()), len(rank)))
    stack = here / "stack"
    for item in items:
        if stack in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        on_pg = "pg_url" in getattr(item, "fixturenames", ()) or (
            callspec is not None  # a store parameter (`db_url`, a module's server) on PostgreSQL
            and any(isinstance(v, str) and v == "postgresql" for v in callspec.params.values())
        )
        if on_pg:
            item.add_marker(pytest.mark.postgres)
