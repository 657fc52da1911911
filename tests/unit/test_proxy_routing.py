"""The proxy's pure core: backend specs, config, policies, pairing, request rewriting."""

from __future__ import annotations

import copy

import pytest

from pdkv.errors import ConfigError
from pdkv.proxy.config import Policy, build_config, parse_decode, parse_prefill
from pdkv.proxy.rewrite import decode_request, prefill_headers, prefill_request
from pdkv.proxy.routing import Chooser, PrefillTarget

TARGET = PrefillTarget("http://10.0.0.2:8100", "http://10.0.0.2:8998", 1, 2, "engine-abc")


def test_prefill_bootstrap_defaults_to_same_host_on_8998(monkeypatch):
    monkeypatch.delenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", raising=False)
    spec = parse_prefill("http://10.0.0.2:8100")
    assert spec.url == "http://10.0.0.2:8100"
    assert spec.bootstrap_url == "http://10.0.0.2:8998"


def test_prefill_bootstrap_port_from_environment(monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "9100")
    assert parse_prefill("10.0.0.2:8100").bootstrap_url == "http://10.0.0.2:9100"


def test_prefill_explicit_bootstrap_url_or_port():
    assert parse_prefill("http://p1:8100,http://boot:7000").bootstrap_url == "http://boot:7000"
    assert parse_prefill("http://p1:8100, 7001").bootstrap_url == "http://p1:7001"
    assert parse_prefill("http://[::1]:8100,7002").bootstrap_url == "http://[::1]:7002"


@pytest.mark.parametrize("bad", ["ftp://x:1", "https://p:8100", "http://"])
def test_bad_backend_urls_are_config_errors(bad):
    with pytest.raises(ConfigError):
        parse_decode(bad)


def test_build_config_merges_file_and_flags():
    file_values = {"prefill": ["http://p1:8100"], "decode": ["http://d1:8200", "http://d2:8200"], "port": 9000,
                   "policy": "least-outstanding", "prefill-timeout": 30}
    cfg = build_config([], [], file_values=file_values, port=9100)
    assert cfg.port == 9100  # the command line wins
    assert cfg.policy is Policy.LEAST_OUTSTANDING
    assert cfg.prefill_timeout == 30
    assert [d for d in cfg.decode] == ["http://d1:8200", "http://d2:8200"]
    flags = build_config(["http://p9:1"], [], file_values=file_values)
    assert [p.url for p in flags.prefill] == ["http://p9:1"]


def test_build_config_refuses_missing_backends_and_bad_values():
    with pytest.raises(ConfigError, match="no prefill"):
        build_config([], ["http://d:1"])
    with pytest.raises(ConfigError, match="no decode"):
        build_config(["http://p:1"], [])
    with pytest.raises(ConfigError, match="policy"):
        build_config(["http://p:1"], ["http://d:1"], policy="random")
    with pytest.raises(ConfigError, match="prefill-timeout"):
        build_config(["http://p:1"], ["http://d:1"], prefill_timeout=0)


def test_round_robin_cycles():
    c = Chooser(Policy.ROUND_ROBIN)
    assert [c.choose([9, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_outstanding_takes_the_idlest_and_spreads_ties():
    c = Chooser(Policy.LEAST_OUTSTANDING)
    assert c.choose([3, 1, 2]) == 1
    assert c.choose([3, 1, 2]) == 1
    ties = [c.choose([0, 0]) for _ in range(4)]
    assert sorted(ties) == [0, 0, 1, 1]


CLIENT = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
    "stop": ["\n\n", "###"],
    "stop_token_ids": [151645],
    "temperature": 0.7,
}


def test_prefill_copy_ends_by_length_and_never_stops_early():
    before = copy.deepcopy(CLIENT)
    p = prefill_request(CLIENT, "xfer-r1")
    assert CLIENT == before  # the client's body is not touched
    assert p["max_tokens"] == 1 and p["min_tokens"] == 1 and p["stream"] is False
    for gone in ("stop", "stop_token_ids", "stream_options"):
        assert gone not in p
    assert p["kv_transfer_params"] == {"transfer_id": "xfer-r1", "do_remote_decode": True, "do_remote_prefill": False}
    assert p["temperature"] == 0.7 and p["prompt"] == "hello"


def test_prefill_copy_of_a_chat_request_caps_max_completion_tokens():
    p = prefill_request({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50}, "t")
    assert p["max_completion_tokens"] == 1 and p["max_tokens"] == 1


def test_decode_copy_keeps_the_clients_request_and_names_the_prefill_engine():
    d = decode_request(CLIENT, "xfer-r1", TARGET)
    assert d["max_tokens"] == 64 and d["stream"] is True and d["stop"] == ["\n\n", "###"]
    assert d["kv_transfer_params"] == {
        "transfer_id": "xfer-r1",
        "remote_bootstrap_addr": "http://10.0.0.2:8998",
        "remote_engine_id": "engine-abc",
        "do_remote_decode": False,
        "do_remote_prefill": True,
    }
    assert "kv_transfer_params" not in CLIENT


def test_prefill_headers_carry_the_dp_rank_only_for_dp_engines():
    assert prefill_headers("r1", TARGET) == [("X-Request-Id", "r1"), ("X-data-parallel-rank", "1")]
    single = PrefillTarget("http://p:1", "http://p:8998", 0, 1, "e")
    assert prefill_headers("r2", single) == [("X-Request-Id", "r2")]


def test_n_choices_are_one_prefill_that_n_decode_requests_pull():
    body = {"model": "m", "prompt": "hi", "n": 3, "max_tokens": 9}
    p = prefill_request(body, "xfer-1")
    assert p["n"] == 1 and p["max_tokens"] == 1
    assert p["kv_transfer_params"] == {"transfer_id": "xfer-1", "do_remote_decode": True, "do_remote_prefill": False, "pulls": 3}
    assert decode_request(body, "xfer-1", TARGET)["n"] == 3
    # n = 1 (or unset) leaves P's params exactly vLLM's contract.
    assert "pulls" not in prefill_request({"prompt": "hi"}, "xfer-2")["kv_transfer_params"]
    assert "pulls" not in prefill_request({"prompt": "hi", "n": 1}, "xfer-3")["kv_transfer_params"]


def test_beam_search_is_refused_by_name():
    from pdkv.proxy.rewrite import unsupported_field

    assert "use_beam_search" in unsupported_field({"use_beam_search": True})
    assert unsupported_field({"use_beam_search": False, "n": 4}) is None


def test_a_members_registry_alone_is_enough_backends_and_its_url_is_checked():
    cfg = build_config([], [], members=["10.0.0.1:8998"])
    assert cfg.members == ("http://10.0.0.1:8998",) and cfg.prefill == () and cfg.decode == ()
    with pytest.raises(ConfigError, match="no prefill server") as info:
        build_config([], ["http://d:1"])
    assert "--members" in (info.value.hint or "")
    with pytest.raises(ConfigError, match="members registry URL"):
        build_config([], [], members=["ftp://x"])


def test_the_binding_reaches_p_as_a_commitment_and_d_as_the_secret():
    from pdkv.auth import binding_matches, new_binding

    secret, commitment = new_binding()
    p = prefill_request(CLIENT, "xfer-b", commitment)["kv_transfer_params"]
    d = decode_request(CLIENT, "xfer-b", TARGET, secret)["kv_transfer_params"]
    assert p == {"transfer_id": "xfer-b", "do_remote_decode": True, "do_remote_prefill": False, "decode_binding": commitment}
    assert d["binding"] == secret and secret not in str(p)
    assert binding_matches(d["binding"], p["decode_binding"])
    assert not binding_matches(new_binding()[0], commitment)
    assert not binding_matches("not hex", commitment)
