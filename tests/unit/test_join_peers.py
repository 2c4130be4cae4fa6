"""The join across several proxies (`timwatch.sidecar.proxy.join.peers`): the take answer's codec,
and a `Joiner` whose peers are other real `CaptureStore`s reached through `take_records` (the HTTP
path between real proxy processes is tests/stack/test_proxy_peers.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.unit.test_join import Clock, Sink, record, sample
from timwatch.sidecar.proxy.capture import CaptureStore
from timwatch.sidecar.proxy.join.joiner import Joiner
from timwatch.sidecar.proxy.join.peers import (
    PeerClient,
    decode_records,
    encode_records,
    parse_keys,
    take_records,
)
from timwatch.sidecar.proxy.records import RolloutRecord


def test_take_answer_round_trips_every_field() -> None:
    full = RolloutRecord(
        rid="r-1",
        input_ids=(1, 2, 2**40),
        output_ids=(5, 6, 7, 8),
        logp=(-0.25, -1e-300, -7.5, 0.0),
        versions=("step-3", "step-3", None, "step-4"),
        finish_reason="length",
        weight_version="step-4",
        entropy_lower=(0.1, 0.2, 0.3, 0.4),
        entropy_tail=(1.0, 2.0, 3.0, 4.0),
        entropy_source="topk",
        created=12.5,
        engine="sglang",
        sampling={"temperature": 0.7},
        logprobs_mode="raw_logprobs",
    )
    bare = RolloutRecord("é", None, (), (), (), None, None)
    x = record("x", [9])
    got = decode_records(encode_records([(3, full), (0, bare), (7, x)]))
    assert got == [(3, full), (0, bare), (7, x)]
    assert decode_records(encode_records([])) == []
    # each record owns its arrays: none keeps the whole answer's buffer alive through a view
    for _, rec in got:
        arrays = (rec.input_ids, rec.output_ids, rec.logp, rec.entropy_lower, rec.entropy_tail)
        assert all(a.flags.owndata for a in arrays if a is not None), rec.rid


@pytest.mark.parametrize("cut", [1, 8, -1])
def test_take_answer_refuses_bytes_it_did_not_write(cut: int) -> None:
    data = encode_records([(0, record("a", [1, 2, 3]))])
    with pytest.raises(ValueError):
        decode_records(data[:cut])
    with pytest.raises(ValueError):
        decode_records(data + b"\0")


def test_take_keys_are_validated_by_index() -> None:
    assert parse_keys({"keys": ["a", [1, 2]]}) == ["a", [1, 2]]
    for bad, where in (({"keys": ["a", ""]}, "keys[1]"), ({"keys": [[1, -2]]}, "keys[0]")):
        with pytest.raises(ValueError, match=where.replace("[", r"\[")):
            parse_keys(bad)
    with pytest.raises(ValueError, match="keys must be a list"):
        parse_keys({"keys": "a"})


class Peers:
    """Peers as other proxies' stores, taken through the code a peer's endpoint runs."""

    def __init__(self, *stores: CaptureStore) -> None:
        self.stores, self.calls, self.down = list(stores), 0, False

    def __call__(self, keys: list[Any]) -> tuple[dict[int, RolloutRecord], list[RolloutRecord]]:
        self.calls += 1
        found: dict[int, RolloutRecord] = {}
        surplus: list[RolloutRecord] = []
        if self.down:
            return found, surplus
        for store in self.stores:
            for i, rec in decode_records(encode_records(take_records(store, keys))):
                (surplus.append(rec) if i in found else found.__setitem__(i, rec))
        return found, surplus


def three_proxies(**kw: Any) -> tuple[list[CaptureStore], Sink, Joiner, Peers, Clock]:
    clock = Clock()
    stores = [CaptureStore(ttl_s=100.0, clock=clock) for _ in range(3)]
    sink, peers = Sink(), Peers(*stores[1:])
    joiner = Joiner(stores[0], sink, default_run="r0", clock=clock, peers=peers, **kw)
    return stores, sink, joiner, peers, clock


def test_a_report_split_over_three_proxies_is_the_batch_one_proxy_would_forward() -> None:
    ids = {f"s{k}": [10 + k, 20 + k, 30 + k][: 1 + k % 3] for k in range(9)}
    report = {"step": 4, "policy_version": 4, "samples": [sample(r, v) for r, v in ids.items()]}
    single_store, single = CaptureStore(ttl_s=100.0), Sink()
    for rid, v in ids.items():
        single_store.add(record(rid, v))
    Joiner(single_store, single, default_run="r0").submit(report)

    stores, sink, joiner, peers, _ = three_proxies()
    for k, (rid, v) in enumerate(ids.items()):
        stores[k % 3].add(record(rid, v))
    answer = joiner.submit(report)
    assert answer["status"] == "forwarded" and answer["joined"] == 9
    assert peers.calls == 1  # one fan-out for the whole report
    ((one,), (got,)) = single.calls, sink.calls
    assert got["arrays"].keys() == one["arrays"].keys()
    for name, arr in one["arrays"].items():
        np.testing.assert_array_equal(got["arrays"][name], arr, err_msg=name)
    assert joiner.counters["peer_joined_samples"] == 6
    assert all(len(s) == 0 for s in stores)


def test_local_samples_never_ask_the_peers() -> None:
    stores, sink, joiner, peers, _ = three_proxies()
    stores[0].add(record("a", [1, 2]))
    assert joiner.submit({"step": 1, "samples": [sample("a", [1, 2])]})["status"] == "forwarded"
    assert peers.calls == 0
    joiner.sweep()
    assert peers.calls == 0  # nothing pending: the sweep asks nobody either


def test_samples_no_peer_holds_are_counted_unjoined_once_and_the_rest_forwarded() -> None:
    stores, sink, joiner, peers, clock = three_proxies(report_ttl_s=5.0)
    stores[0].add(record("here", [1]))
    stores[2].add(record("there", [2, 3]))
    held = (("here", [1]), ("there", [2, 3]), ("gone", [4]))
    report = {"step": 2, "samples": [sample(r, v) for r, v in held]}
    answer = joiner.submit(report)
    assert answer["status"] == "pending" and answer["missing"] == ["gone"]
    assert answer["joined"] == 2
    clock.t = 1.0
    joiner.sweep()  # asks again: still nobody holds "gone"
    assert peers.calls == 2 and not sink.calls
    clock.t = 6.0
    joiner.sweep()
    (call,) = sink.calls
    assert call["arrays"]["cu_seqlens"].tolist() == [0, 1, 3]
    assert joiner.counters["unjoined_samples"] == 1
    assert joiner.counters["expired_reports"] == 1
    assert joiner.counters["pending_reports"] == 0


def test_a_record_captured_late_on_a_peer_joins_on_the_next_sweep() -> None:
    stores, sink, joiner, peers, clock = three_proxies(report_ttl_s=5.0)
    peers.down = True
    assert joiner.submit({"step": 3, "samples": [sample("late", [5, 6])]})["status"] == "pending"
    stores[1].add(record("late", [5, 6]))
    joiner.sweep()  # the peer is still down: nothing joins, nothing is lost
    assert not sink.calls and len(stores[1]) == 1
    peers.down = False
    clock.t = 1.0
    joiner.sweep()
    (call,) = sink.calls
    assert call["arrays"]["token_ids"].tolist() == [5, 6]
    assert joiner.counters["unjoined_samples"] == 0 and joiner.counters["pending_reports"] == 0


def test_a_record_two_peers_hold_is_kept_locally_not_lost() -> None:
    stores, sink, joiner, _, _ = three_proxies()
    stores[1].add(record("p1", [7, 7]))
    stores[2].add(record("p2", [7, 7]))  # same sampled ids, captured on another proxy
    joiner.submit({"step": 1, "samples": [sample(None, [7, 7])]})
    assert len(sink.calls) == 1
    assert [r.rid for r in stores[0].snapshot()] == ["p2"]  # the surplus moved here
    joiner.submit({"step": 2, "samples": [sample(None, [7, 7])]})
    assert len(sink.calls) == 2 and len(stores[0]) == 0


def test_a_replayed_batch_id_answers_from_memory_and_takes_nothing_twice() -> None:
    stores, sink, joiner, peers, _ = three_proxies()
    stores[1].add(record("a", [1]))
    report = {"step": 1, "batch_id": "b-1", "samples": [sample("a", [1])]}
    first = joiner.submit(report)
    again = joiner.submit(report)
    assert first["status"] == again["status"] == "forwarded" and again["replayed"]
    assert peers.calls == 1 and len(sink.calls) == 1


def test_peer_client_skips_its_own_address_and_survives_a_dead_peer() -> None:
    client = PeerClient(
        ["http://127.0.0.1:1/", "http://127.0.0.1:9", "HTTP://127.0.0.1:9"],
        timeout_s=0.5,
        self_url="http://127.0.0.1:9",
    )
    try:
        assert client.urls == ["http://127.0.0.1:1"]
        assert client(["a", [1, 2]]) == ({}, [])  # nothing listens on port 1: refused
        stats = client.stats()["http://127.0.0.1:1"]
        assert stats["requests"] == stats["errors"] == 1 and stats["last_error"]
    finally:
        client.close()


def test_peer_without_monitor_is_refused_by_the_command() -> None:
    from typer.testing import CliRunner

    from timwatch.sidecar.cli import sidecar_app

    args = ["sglang", "--upstream", "http://127.0.0.1:1", "--peer", "http://127.0.0.1:2"]
    result = CliRunner().invoke(sidecar_app, args)
    assert result.exit_code == 2
    assert "--peer needs --monitor" in result.output


def test_peers_raising_leave_the_report_pending_not_failed() -> None:
    stores, sink, joiner, _, clock = three_proxies(report_ttl_s=5.0)

    def broken(keys: list[Any]) -> Any:
        raise RuntimeError("peer pool gone")

    joiner.peers = broken
    stores[0].add(record("here", [1, 2]))
    answer = joiner.submit({"step": 1, "samples": [sample("here", [1, 2]), sample("x", [3])]})
    assert answer["status"] == "pending" and answer["joined"] == 1
    clock.t = 6.0
    joiner.sweep()
    (call,) = sink.calls  # what this proxy held still reaches the monitor
    assert call["arrays"]["token_ids"].tolist() == [1, 2]
    assert joiner.counters["unjoined_samples"] == 1
