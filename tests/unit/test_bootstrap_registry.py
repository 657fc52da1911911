from __future__ import annotations

import msgspec
import pytest

from pdkv.bootstrap.client import backoff_delay, normalize_url
from pdkv.bootstrap.registry import BootstrapRegistry, ConflictKind, Outcome
from pdkv.errors import RegistryConflict
from pdkv.wire import EngineEntry, RegisterRequest, split_worker_addr


def req(engine="eng-a", dp=0, tp=0, pp=0, addr="tcp://10.0.0.1:5000") -> RegisterRequest:
    return RegisterRequest(engine_id=engine, dp_rank=dp, tp_rank=tp, pp_rank=pp, addr=addr)


def wire(registry: BootstrapRegistry) -> dict:
    return msgspec.json.decode(msgspec.json.encode(registry.query()))


def test_query_has_vllms_shape_with_string_keys_in_numeric_order():
    r = BootstrapRegistry()
    r.register(req(dp=10, addr="tcp://h:10"))
    r.register(req(engine="eng-b", dp=2, tp=1, addr="tcp://h:21"))
    r.register(req(engine="eng-b", dp=2, tp=0, pp=1, addr="tcp://h:201"))
    r.register(req(engine="eng-b", dp=2, tp=0, pp=0, addr="tcp://h:200"))
    assert wire(r) == {
        "2": {"engine_id": "eng-b", "worker_addr": {"0": {"0": "tcp://h:200", "1": "tcp://h:201"}, "1": {"0": "tcp://h:21"}}},
        "10": {"engine_id": "eng-a", "worker_addr": {"0": {"0": "tcp://h:10"}}},
    }
    assert list(wire(r)) == ["2", "10"]
    assert r.engine_count == 2 and r.worker_count == 4


def test_identical_reregistration_is_unchanged_and_keeps_version():
    r = BootstrapRegistry()
    assert r.register(req()) is Outcome.CREATED
    version = r.version
    assert r.register(req()) is Outcome.UNCHANGED
    assert r.version == version


def test_other_engine_on_taken_dp_rank_conflicts_naming_both():
    r = BootstrapRegistry()
    r.register(req(engine="eng-a", addr="tcp://h:1"))
    before = wire(r)
    conflict = r.check(req(engine="eng-b", addr="tcp://h:2"))
    assert conflict is not None and conflict.kind is ConflictKind.ENGINE
    assert conflict.holder == "eng-a" and conflict.holder_addrs == ("tcp://h:1",)
    with pytest.raises(RegistryConflict) as info:
        r.register(req(engine="eng-b", addr="tcp://h:2"))
    assert info.value.status == 409
    assert "'eng-a'" in info.value.message and "'eng-b'" in info.value.message and "dp_rank=0" in info.value.message
    assert wire(r) == before


def test_other_addr_for_taken_rank_conflicts_naming_both_addresses():
    r = BootstrapRegistry()
    r.register(req(addr="tcp://h:1"))
    with pytest.raises(RegistryConflict) as info:
        r.register(req(addr="tcp://h:2"))
    assert "tcp://h:1" in info.value.message and "tcp://h:2" in info.value.message
    assert r.check(req(addr="tcp://h:2")).kind is ConflictKind.ADDR


def test_evicting_the_exact_conflict_replaces_the_whole_dead_engine():
    r = BootstrapRegistry()
    r.register(req(engine="old", tp=0, addr="tcp://h:1"))
    r.register(req(engine="old", tp=1, addr="tcp://h:2"))
    newcomer = req(engine="new", tp=0, addr="tcp://h:3")
    conflict = r.check(newcomer)
    assert conflict.holder_addrs == ("tcp://h:1", "tcp://h:2")
    assert r.register(newcomer, evict=conflict) is Outcome.REPLACED
    assert wire(r) == {"0": {"engine_id": "new", "worker_addr": {"0": {"0": "tcp://h:3"}}}}
    assert r.register(req(engine="new", tp=1, addr="tcp://h:4")) is Outcome.CREATED


def test_evicting_a_dead_address_keeps_the_engines_other_workers():
    r = BootstrapRegistry()
    r.register(req(tp=0, addr="tcp://h:1"))
    r.register(req(tp=1, addr="tcp://h:2"))
    moved = req(tp=0, addr="tcp://h:9")
    assert r.register(moved, evict=r.check(moved)) is Outcome.REPLACED
    assert wire(r)["0"]["worker_addr"] == {"0": {"0": "tcp://h:9"}, "1": {"0": "tcp://h:2"}}


def test_eviction_for_a_stale_conflict_is_refused():
    r = BootstrapRegistry()
    r.register(req(engine="old", addr="tcp://h:1"))
    stale = r.check(req(engine="new", addr="tcp://h:3"))
    # While the caller probed "old", it left and "other" took the rank: the eviction no longer applies.
    r.deregister("old")
    r.register(req(engine="other", addr="tcp://h:5"))
    with pytest.raises(RegistryConflict, match="'other'"):
        r.register(req(engine="new", addr="tcp://h:3"), evict=stale)


def test_deregister_removes_every_rank_of_the_engine_and_only_it():
    r = BootstrapRegistry()
    r.register(req(engine="a", dp=0, tp=0, addr="tcp://h:1"))
    r.register(req(engine="a", dp=0, tp=1, addr="tcp://h:2"))
    r.register(req(engine="a", dp=1, addr="tcp://h:3"))
    r.register(req(engine="b", dp=2, addr="tcp://h:4"))
    assert r.deregister("a") == 3
    assert list(wire(r)) == ["2"]
    version = r.version
    assert r.deregister("a") == 0
    assert r.version == version
    # The rank is free again for a restarted engine with a new id.
    assert r.register(req(engine="a2", dp=0, addr="tcp://h:5")) is Outcome.CREATED


def test_probe_failures_in_a_row_drop_the_engine_and_success_resets():
    r = BootstrapRegistry()
    r.register(req(engine="a", addr="tcp://h:1"))
    assert not r.record_probe(0, "a", alive=False, max_failures=3)
    assert not r.record_probe(0, "a", alive=False, max_failures=3)
    assert not r.record_probe(0, "a", alive=True, max_failures=3)
    assert not r.record_probe(0, "a", alive=False, max_failures=3)
    assert not r.record_probe(0, "a", alive=False, max_failures=3)
    assert r.record_probe(0, "a", alive=False, max_failures=3)
    assert r.query() == {}


def test_probe_result_for_a_replaced_engine_is_ignored():
    r = BootstrapRegistry()
    r.register(req(engine="a", addr="tcp://h:1"))
    r.deregister("a")
    r.register(req(engine="b", addr="tcp://h:2"))
    assert not r.record_probe(0, "a", alive=False, max_failures=1)
    assert r.query() == {"0": EngineEntry(engine_id="b", worker_addr={"0": {"0": "tcp://h:2"}})}


def test_holders_lists_each_engines_distinct_addresses():
    r = BootstrapRegistry()
    r.register(req(engine="a", dp=1, tp=0, addr="tcp://h:2"))
    r.register(req(engine="a", dp=1, tp=1, addr="tcp://h:1"))
    assert r.holders() == [(1, "a", ("tcp://h:1", "tcp://h:2"))]


@pytest.mark.parametrize(
    ("addr", "expected"),
    [("tcp://127.0.0.1:5555", ("127.0.0.1", 5555)), ("tcp://[::1]:80", ("::1", 80)), ("tcp://node-3.local:65535", ("node-3.local", 65535))],
)
def test_split_worker_addr_accepts(addr, expected):
    assert split_worker_addr(addr) == expected


@pytest.mark.parametrize(
    "addr",
    ["http://h:1", "tcp://h", "tcp://h:0", "tcp://h:65536", "tcp://:1", "tcp://::1:80", "tcp://[::1]80", "tcp://h:1/x", "tcp://*:5555",
     "tcp://a b:1", "tcp://h:-1", ""],
)
def test_split_worker_addr_rejects(addr):
    with pytest.raises(ValueError, match="tcp://host:port"):
        split_worker_addr(addr)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"engine_id":"e","dp_rank":-1,"tp_rank":0,"pp_rank":0,"addr":"tcp://h:1"}', "dp_rank"),
        (b'{"engine_id":"e","dp_rank":"0","tp_rank":0,"pp_rank":0,"addr":"tcp://h:1"}', "dp_rank"),
        (b'{"engine_id":"e","dp_rank":0,"tp_rank":true,"pp_rank":0,"addr":"tcp://h:1"}', "tp_rank"),
        (b'{"engine_id":"","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"tcp://h:1"}', "engine_id"),
        (b'{"engine_id":"e","dp_rank":0,"tp_rank":0,"pp_rank":0}', "addr"),
        (b'{"engine_id":"e","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"h:1"}', "tcp://host:port"),
    ],
)
def test_register_request_decoding_rejects_bad_fields(body, needle):
    with pytest.raises(msgspec.ValidationError, match=needle):
        msgspec.json.decode(body, type=RegisterRequest)


def test_register_request_decodes_what_vllm_sends():
    # vLLM posts pydantic's model_dump(): exactly these five keys.
    body = b'{"engine_id":"7c1d","dp_rank":0,"tp_rank":1,"pp_rank":0,"addr":"tcp://10.1.2.3:41234"}'
    assert msgspec.json.decode(body, type=RegisterRequest) == req(engine="7c1d", tp=1, addr="tcp://10.1.2.3:41234")


@pytest.mark.parametrize(
    ("given", "expected"),
    [("10.0.0.2:8998", "http://10.0.0.2:8998"), ("http://h:1/", "http://h:1"), (" https://h:1 ", "https://h:1"), ("http://[::1]:8998", "http://[::1]:8998")],
)
def test_client_urls_are_normalized(given, expected):
    assert normalize_url(given) == expected


def test_client_backoff_doubles_and_is_capped():
    assert [backoff_delay(i) for i in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
