"""What the proxy tells a client: the stage that failed and the backend's own words, never an address."""

from __future__ import annotations

import json

import pytest

from pdkv.proxy.error_answers import error_body, message_of, no_answer_message, redact, redact_body, status_message
from pdkv.proxy.http import UpstreamError


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("cannot connect to http://127.0.0.1:8100: refused", "cannot connect to <address>: refused"),
        ("bootstrap http://p1.internal:8998/query failed", "bootstrap <address> failed"),
        ("side channel tcp://[::1]:5555 silent", "side channel <address> silent"),
        ("write to 10.0.0.7:15432 failed", "write to <address> failed"),
        ("peer [fe80::1]:4000 gone", "peer <address> gone"),
        ("prompt too long: 9000 tokens > 8192", "prompt too long: 9000 tokens > 8192"),
    ],
)
def test_redact_takes_out_urls_and_ip_addresses_only(text, want):
    assert redact(text) == want


def test_redact_body_keeps_json_and_leaves_clean_bodies_alone():
    clean = b'{"error": {"message": "prompt too long"}}'
    assert redact_body(clean) is clean
    dirty = json.dumps({"error": {"message": "engine at http://127.0.0.1:8200/v1 died", "hint": "10.1.2.3"}}).encode()
    assert json.loads(redact_body(dirty)) == {"error": {"message": "engine at <address> died", "hint": "<address>"}}


@pytest.mark.parametrize("cause", ["connect", "timeout", "disconnect", "cancelled", "something-new"])
@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_no_answer_message_names_the_stage_not_the_backend(stage, cause):
    message = no_answer_message(stage, UpstreamError(cause, "cannot connect to http://127.0.0.1:8100: ('127.0.0.1', 8100)"))
    assert message.startswith(f"{stage} failed: ") and "127.0.0.1" not in message and "http" not in message


def test_status_message_passes_the_backends_words_without_addresses():
    body = b'{"error": {"message": "too long for http://127.0.0.1:8100", "type": "BadRequestError"}}'
    assert status_message("prefill", 400, body) == "prefill refused the request (400): too long for <address>"
    assert status_message("decode", 503, b"upstream 127.0.0.1:9 down\n") == (
        "decode failed: the decode server answered 503: upstream <address> down"
    )
    assert message_of(b"not json at all") == "not json at all"


def test_error_body_is_openai_shaped():
    err = json.loads(error_body(502, "prefill failed: x", "prefill_connect", "r-1"))["error"]
    assert err == {"message": "prefill failed: x", "type": "pdkv_proxy_error", "code": 502, "cause": "prefill_connect", "request_id": "r-1"}
    assert "request_id" not in json.loads(error_body(404, "no route", "bad_request"))["error"]
