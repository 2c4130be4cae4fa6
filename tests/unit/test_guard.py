"""The guard's parts without a server: the ``Timwatch-Page`` header codec, the tap's `Guard`
(when its action runs, what leaves it) and the service's `PageBoard` (Alertmanager's webhook
payloads, version 4). A real server and a real Alertmanager: tests/service/test_guard.py and
tests/stack/test_guard_alertmanager.py."""

from __future__ import annotations

import json
import pickle
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from timwatch.monitor.core.errors import ConfigError, InputError, RunPaged, TimwatchError
from timwatch.monitor.core.page import PAGE_HEADER, Page, format_page, parse_page
from timwatch.monitor.service.pages import PageBoard, parse_time
from timwatch.sidecar.tap import MarkerFile
from timwatch.sidecar.tap.guard import Guard

FIRING = {PAGE_HEADER.lower(): "firing; alerts=TimwatchMismatchKLRising; since=1700000000.5"}

names = st.lists(st.from_regex(r"[A-Za-z0-9_:]{1,20}", fullmatch=True), max_size=4)


@given(names, st.one_of(st.none(), st.floats(0, 4e9)))
def test_header_round_trips(alerts: list[str], since: float | None) -> None:
    page = Page(tuple(sorted(set(alerts))), None if since is None else round(since, 3))
    back = parse_page(format_page(page))
    assert back is not None and back.alerts == page.alerts
    assert back.since == pytest.approx(page.since, abs=1e-3) if since is not None else True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("resolved", None),
        ("firing", Page(())),
        ("FIRING; alerts=B,A,A; since=12.5", Page(("A", "B"), 12.5)),
        ("firing; alerts=A,bad name,x{y}; since=nan", Page(("A",), None)),
        ("firing; since=soon", Page((), None)),
    ],
)
def test_header_parse_hand_cases(value: str | None, expected: Page | None) -> None:
    assert parse_page(value) == expected


def test_raise_runs_once_per_page_and_again_after_it_clears() -> None:
    g = Guard("r", "raise")
    g.check(0)  # nothing seen yet
    g.observe({})
    g.check(1)
    g.observe(FIRING)
    with pytest.raises(RunPaged) as err:
        g.check(2)
    assert isinstance(err.value, TimwatchError) and isinstance(err.value, RuntimeError)
    assert err.value.alerts == ("TimwatchMismatchKLRising",) and err.value.since == 1700000000.5
    assert "run r is paged (TimwatchMismatchKLRising)" in str(err.value)
    g.observe(FIRING)  # still the same page: the loop that caught it goes on
    g.check(3)
    g.observe({})  # cleared, then a new page
    g.check(4)
    g.observe(FIRING)
    with pytest.raises(RunPaged):
        g.check(5)
    assert g.pages == 2 and g.errors == 0


def test_run_paged_survives_pickling() -> None:
    """Ray pickles a worker's exception for the driver (verl, OpenRLHF, SkyRL): unpickled, it is
    the same `RunPaged` (before, it pickled its message only and did not unpickle, so Ray handed
    the driver an `UnserializableException`)."""
    err = RunPaged("grpo-7b", ("TimwatchMismatchKLRising",), 1700000000.5)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RunPaged and str(back) == str(err)
    assert (back.run, back.alerts, back.since) == (
        "grpo-7b",
        ("TimwatchMismatchKLRising",),
        1700000000.5,
    )


def test_without_an_action_the_page_is_only_recorded() -> None:
    g = Guard("r", None)
    g.observe(FIRING)
    g.check(1)
    assert g.page == Page(("TimwatchMismatchKLRising",), 1700000000.5) and g.pages == 0


def test_a_failing_callback_is_logged_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Page] = []

    def boom(page: Page) -> None:
        seen.append(page)
        raise OSError("disk full")

    g = Guard("r", boom)
    g.observe(FIRING)
    g.check(7)
    assert len(seen) == 1 and g.errors == 1 and "OSError: disk full" in (g.last_error or "")
    assert "on_page action failed" in caplog.text


def test_a_callback_may_ask_to_stop_by_raising_run_paged() -> None:
    def stop(page: Page) -> None:
        raise RunPaged("r", page.alerts, page.since)

    g = Guard("r", stop)
    g.observe(FIRING)
    with pytest.raises(RunPaged):
        g.check(1)


def test_marker_file_is_written_whole(tmp_path: Path) -> None:
    marker = tmp_path / "STOP"
    g = Guard("grpo-7b", MarkerFile(marker))
    g.observe({})
    g.check(1)
    assert not marker.exists()
    g.observe(FIRING)
    g.check(9)
    assert json.loads(marker.read_text()) == {
        "run": "grpo-7b", "alerts": ["TimwatchMismatchKLRising"], "since": 1700000000.5,
        "step": 9,
    }  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["STOP"]


def test_on_page_must_be_raise_or_callable() -> None:
    with pytest.raises(ValueError, match="on_page"):
        Guard("r", "stop")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the service's board


def alert(status: str, run: str | None, name: str = "A", sev: str = "page", **kw: Any) -> Any:
    labels = {"alertname": name, "severity": sev, **({"run": run} if run else {})}
    return {"status": status, "labels": labels, **kw}


def payload(*alerts: Any) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "alerts": list(alerts)}


def test_board_pages_and_clears_by_fingerprint() -> None:
    b = PageBoard()
    t = "2026-12-05T21:00:00.5Z"
    got = b.apply(payload(
        alert("firing", "r1", "B", fingerprint="f1", startsAt=t),
        alert("firing", "r1", "A", fingerprint="f2", startsAt="2026-12-05T22:00:00+01:00"),
        alert("firing", "r2", "A", sev="warning"),
        alert("firing", None),
    ))  # fmt: skip
    assert got == {"firing": 2, "resolved": 0, "ignored": 2, "paged": ["r1"]}
    # 21:00:00.5Z and 22:00+01:00 are the same hour: since is the earlier, 21:00:00 UTC
    assert b.page("r1") == Page(("A", "B"), 1796504400.0)
    assert b.page("r2") is None
    assert b.apply(payload(alert("resolved", "r1", "B", fingerprint="f1")))["paged"] == ["r1"]
    assert b.page("r1") == Page(("A",), 1796504400.0)
    got = b.apply(payload(alert("resolved", "r1", "A", fingerprint="f2")))
    assert got["paged"] == [] and b.page("r1") is None


def test_board_keys_alerts_without_fingerprint_by_labels() -> None:
    b = PageBoard(severity="critical")
    b.apply(payload(alert("firing", "r", sev="critical", startsAt="2026-01-01T00:00:00Z")))
    assert b.page("r") == Page(("A",), datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp())
    b.apply(payload(alert("resolved", "r", sev="critical")))
    assert b.page("r") is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body"),
        ({"version": "3", "alerts": []}, "version"),
        ({"version": "4", "alerts": {}}, "alerts"),
        (payload(alert("firing", "r"), 5), "alerts[1]"),
        (payload(alert("firing", "r"), alert("pending", "r")), "alerts[1].status"),
        (payload({"status": "firing", "labels": {"run": 3}}), "alerts[0].labels"),
        (payload(alert("firing", "r"), alert("firing", "r", startsAt="yesterday")),
         "alerts[1].startsAt"),
        (payload(alert("firing", "r", startsAt="2026-12-05T21:00:00")), "alerts[0].startsAt"),
        (payload(alert("firing", "r", startsAt=None)), "alerts[0].startsAt"),
        (payload(alert("firing", "r", fingerprint=7)), "alerts[0].fingerprint"),
        (payload(alert("firing", "r", fingerprint=None)), "alerts[0].fingerprint"),
    ],
)  # fmt: skip
def test_board_refuses_a_bad_payload_whole(body: Any, field: str) -> None:
    b = PageBoard()
    with pytest.raises(InputError) as err:
        b.apply(body)
    assert err.value.field == field
    assert b.page("r") is None  # the valid first alert was not applied


@pytest.mark.parametrize(
    "text",
    ["2026-12-05T21:00:00Z", "2026-12-05T21:00:00.123456789Z", "2026-12-05T22:30:00+01:30",
     "2026-12-05T19:00:00.25-02:00"],
)  # fmt: skip
def test_parse_time_against_datetime(text: str) -> None:
    # the same instants written by hand: 21:00:00 UTC (+ the fraction)
    frac = {"2026-12-05T21:00:00.123456789Z": 0.123456789, "2026-12-05T19:00:00.25-02:00": 0.25}
    expected = datetime(2026, 12, 5, 21, tzinfo=timezone.utc).timestamp() + frac.get(text, 0.0)
    assert parse_time(text) == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------- plug-ins: the one entry point


def test_on_page_from_env(tmp_path: Path) -> None:
    from timwatch.sidecar.tap.guard import on_page_from_env

    assert on_page_from_env(None) is None and on_page_from_env("  ") is None
    assert on_page_from_env("raise") == "raise"
    marker = on_page_from_env(f"marker:{tmp_path / 'STOP'}")
    assert isinstance(marker, MarkerFile) and marker.path == tmp_path / "STOP"
    for bad in ("stop", "marker:", "Raise"):
        with pytest.raises(ConfigError, match="TIMWATCH_ON_PAGE must be 'raise' or 'marker:PATH'"):
            on_page_from_env(bad)


def test_tap_from_env_reads_the_four_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one reading of the environment behind every plug-in's tap (verl, AReaL, OpenRLHF,
    SkyRL): no TIMWATCH_URL, no tap (and nothing else is read); else TIMWATCH_RUN (the
    framework's name when unset or empty), TIMWATCH_TOKEN and TIMWATCH_ON_PAGE."""
    from timwatch.sidecar.tap.env import tap_from_env

    url = "http://127.0.0.1:9"
    assert tap_from_env("verl", {}) is None
    assert tap_from_env("verl", {"TIMWATCH_URL": "", "TIMWATCH_ON_PAGE": "stop"}) is None
    with pytest.raises(ConfigError, match="TIMWATCH_ON_PAGE must be 'raise' or 'marker:PATH'"):
        tap_from_env("verl", {"TIMWATCH_URL": url, "TIMWATCH_ON_PAGE": "stop"})
    cases = [
        ({}, "areal", None, None),
        ({"TIMWATCH_RUN": "r7", "TIMWATCH_TOKEN": "t0k", "TIMWATCH_ON_PAGE": "raise"},
         "r7", "Bearer t0k", "raise"),
        ({"TIMWATCH_RUN": "", "TIMWATCH_ON_PAGE": f"marker:{tmp_path / 'STOP'}"},
         "areal", None, MarkerFile),
    ]  # fmt: skip
    for extra, run, auth, on_page in cases:
        tap = tap_from_env("areal", {"TIMWATCH_URL": url + "/", **extra})
        assert tap is not None
        try:
            assert (tap.url, tap.run, tap._headers.get("Authorization")) == (url, run, auth)
            if on_page is MarkerFile:
                assert isinstance(tap._guard.on_page, MarkerFile)
                assert tap._guard.on_page.path == tmp_path / "STOP"
            else:
                assert tap._guard.on_page == on_page
        finally:
            tap.close(0, finish=False)
    monkeypatch.setenv("TIMWATCH_URL", url)  # by default, the process's environment
    monkeypatch.setenv("TIMWATCH_ON_PAGE", "raise")
    monkeypatch.delenv("TIMWATCH_RUN", raising=False)
    tap = tap_from_env("skyrl")
    assert tap is not None
    try:
        assert tap.run == "skyrl" and tap._guard.on_page == "raise"
    finally:
        tap.close(0, finish=False)


def test_verl_workers_tap_takes_on_page_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from timwatch.sidecar.integrations import verl_hooks

    monkeypatch.setenv("TIMWATCH_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("TIMWATCH_ON_PAGE", "raise")
    monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", None)
    backend = verl_hooks.worker_backend()
    assert backend is not None
    try:
        guard = backend.tap._guard  # type: ignore[attr-defined]
        assert guard.on_page == "raise"
        guard.observe(FIRING)
        with pytest.raises(RunPaged):
            backend.tap.check_page(3)  # type: ignore[attr-defined]
    finally:
        backend.tap.close(0, finish=False)  # type: ignore[attr-defined]
        monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", None)
    # a bad value stops the worker's first update, as it stops every plug-in's: no tap is made
    monkeypatch.setenv("TIMWATCH_ON_PAGE", "Raise")
    with pytest.raises(ConfigError, match="TIMWATCH_ON_PAGE"):
        verl_hooks.worker_backend()
    assert verl_hooks._WORKER_BACKEND is None
