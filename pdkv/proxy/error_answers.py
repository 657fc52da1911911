"""What the proxy tells a client when a request fails, and what it keeps to itself. Pure.

A client gets the OpenAI error shape, `{"error": {"message", "type", "code",
"cause", "request_id"}}`, and a message that names the stage that failed
(prefill or decode) and the backend's own words (vLLM's "prompt too long",
say) with every address taken out: backend URLs, side-channel and transfer
addresses are the deployment's, not the client's. The whole story, addresses
and upstream bodies included, goes to the proxy's log and to the request's
record (`ProxyTiming.detail`, served at /pdkv/requests/{id}).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from pdkv.proxy.http import UpstreamError

_json_encode = msgspec.json.Encoder().encode

# A URL of any scheme (http://p1:8100/v1, tcp://[::1]:5555), then a bare IPv4 address with an
# optional port, then a bracketed IPv6 one with its port. Quotes and backslashes end a match, so
# redacting inside a JSON body keeps it JSON; so does trailing punctuation ("...:8100: refused").
_ADDRESS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'\\<>]*[^\s\"'\\<>.,:;!?)]"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
    r"|\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\](?::\d+)?"
)
REDACTED = "<address>"

# What the client is told when an exchange ended without an HTTP answer, by UpstreamError.cause;
# the error's own text names the backend, so it goes only to the detail.
_NO_ANSWER = {
    "connect": "could not connect to the {stage} server",
    "timeout": "the {stage} server did not answer in time",
    "disconnect": "the {stage} server dropped the connection mid-answer",
    "cancelled": "the proxy cancelled the {stage} request",
    "unreachable": "the {stage} server became unreachable",
}


def redact(text: str) -> str:
    """`text` with every URL and IP address replaced by REDACTED."""
    return _ADDRESS.sub(REDACTED, text)


def redact_body(body: bytes) -> bytes:
    """An upstream body as the client may see it: unchanged unless it holds an address."""
    text = body.decode("utf-8", "replace")
    cleaned = redact(text)
    return body if cleaned == text else cleaned.encode()


def message_of(body: bytes) -> str:
    """The message of an OpenAI-style error body, else its first 200 characters (not redacted)."""
    body = body.strip().split(b"\n", 1)[0]
    try:
        err = msgspec.json.decode(body)
        if isinstance(err, dict) and isinstance(err.get("error"), dict):
            return str(err["error"].get("message", ""))[:200]
    except msgspec.DecodeError:
        pass
    return body[:200].decode("utf-8", "replace")


def is_error_event(chunks: list[bytes]) -> bool:
    """D's first stream bytes are an error event, not a token."""
    head = b"".join(chunks)[:64].lstrip()
    return head.startswith(b"data: {") and b'"error"' in b"".join(chunks)[:200]


def no_answer_message(stage: str, error: UpstreamError) -> str:
    """The client's message for a `stage` ("prefill" or "decode") exchange that got no HTTP answer."""
    what = _NO_ANSWER.get(error.cause, "the {stage} server failed ({cause})")
    return f"{stage} failed: " + what.format(stage=stage, cause=error.cause)


def status_message(stage: str, status: int, body: bytes) -> str:
    """The client's message for a `stage` backend that answered `status` with `body`."""
    said = redact(message_of(body))
    if 400 <= status < 500:  # about the request itself: the client can act on the backend's words
        return f"{stage} refused the request ({status}): {said}"
    return f"{stage} failed: the {stage} server answered {status}: {said}"


def error_body(status: int, message: str, cause: str, request_id: str | None = None) -> bytes:
    """The OpenAI-shaped error body; `message` must already be fit for the client."""
    err: dict[str, Any] = {"message": message, "type": "pdkv_proxy_error", "code": status, "cause": cause}
    if request_id:
        err["request_id"] = request_id
    return _json_encode({"error": err})
