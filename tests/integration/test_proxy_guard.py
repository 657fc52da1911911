"""The proxy's HTTP surfaces guarded: API keys on /v1/*, the admin key on /pdkv/* and /metrics, TLS on its
listener, and limits on what a request may send. Real servers on 127.0.0.1 (the stub P/D deployment of
test_proxy_app); a self-signed certificate made with `cryptography`."""

from __future__ import annotations

import datetime
import socket
import ssl
from pathlib import Path

import httpx
import pytest
from support.proxy_stubs import REQUEST, Deployment

from pdkv.deploy.run.status import collect_status
from pdkv.errors import ConfigError
from pdkv.proxy.guard import HttpGuard, load_guard, server_ssl

GUARD = HttpGuard(api_keys=("sk-one", "sk-two"), admin_key="adm-1")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys_guard_v1_and_the_admin_key_guards_pdkv_and_metrics():
    with Deployment(guard=GUARD) as dep, httpx.Client(base_url=dep.url, timeout=10, trust_env=False) as c:
        body = {**REQUEST, "stream": False}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["cause"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
        assert c.post("/v1/completions", json=body, headers=bearer("sk-wrong")).status_code == 401
        assert not dep.prefills[0].seen and not dep.decodes[0].seen  # refused before any backend saw it
        for key in ("sk-one", "sk-two"):
            assert c.post("/v1/completions", json=body, headers=bearer(key)).status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers=bearer("sk-one")).status_code == 200
        for path in ("/metrics", "/pdkv/requests", "/pdkv/requests/x"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=bearer("sk-one")).status_code == 401, path  # an API key is not the admin key
        assert c.get("/metrics", headers=bearer("adm-1")).status_code == 200
        recent = c.get("/pdkv/requests", headers=bearer("adm-1")).json()
        assert len(recent) == 2
        assert c.get("/health").status_code == 200  # probes stay open
        # pdkv status reads the proxy's figures with the admin key, and gets none without it.
        assert collect_status(proxy_url=dep.url, admin_key="adm-1").proxy is not None
        assert collect_status(proxy_url=dep.url, admin_key="wrong").proxy is None


def test_without_keys_every_route_is_open_as_before():
    with Deployment() as dep, httpx.Client(base_url=dep.url, timeout=10, trust_env=False) as c:
        assert c.post("/v1/completions", json={**REQUEST, "stream": False}).status_code == 200
        assert c.get("/metrics").status_code == 200 and c.get("/pdkv/requests").status_code == 200


def test_keys_load_from_flags_file_and_env(tmp_path: Path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-file-1\n\nsk-file-2\n")
    g = load_guard(["sk-flag"], f, None, env={"PDKV_API_KEY": "sk-env-1, sk-env-2", "PDKV_ADMIN_KEY": "adm"})
    assert g.api_keys == ("sk-flag", "sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2") and g.admin_key == "adm"
    with pytest.raises(ConfigError, match="cannot read the API key file"):
        load_guard(None, tmp_path / "missing", None, env={})
    with pytest.raises(ConfigError, match="empty"):
        load_guard([" "], None, None, env={})


def _raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_oversized_requests_answer_413_414_431_and_the_listener_goes_on():
    with Deployment() as dep:
        many = b"".join(b"x-h%d: v\r\n" % i for i in range(200))
        assert _raw(dep.url, b"GET /health HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n").startswith(b"HTTP/1.1 431 ")
        big = b"x-big: " + b"a" * 70_000 + b"\r\n"
        assert _raw(dep.url, b"GET /health HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n").startswith(b"HTTP/1.1 431 ")
        assert _raw(dep.url, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nhost: x\r\n\r\n").startswith(b"HTTP/1.1 414 ")
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (65 * 2**20)
        assert _raw(dep.url, head + b"{" + b" " * (65 * 2**20 - 1)).startswith(b"HTTP/1.1 413 ")
        assert httpx.get(dep.url + "/health", timeout=5, trust_env=False).status_code == 200
        assert not dep.prefills[0].seen


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return certfile, keyfile


def test_tls_on_the_listener(tmp_path: Path):
    certfile, keyfile = _self_signed(tmp_path)
    with Deployment(ssl=server_ssl(certfile, keyfile), guard=GUARD) as dep:
        assert dep.url.startswith("https://")
        trust = ssl.create_default_context(cafile=str(certfile))
        with httpx.Client(base_url=dep.url, verify=trust, timeout=10, trust_env=False) as c:
            r = c.post("/v1/completions", json={**REQUEST, "stream": False}, headers=bearer("sk-one"))
            assert r.status_code == 200 and r.json()["choices"][0]["text"]
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS listener gets no answer
            httpx.get(dep.url.replace("https://", "http://") + "/health", timeout=3, trust_env=False)
    with pytest.raises(ConfigError, match="cannot load the TLS certificate"):
        server_ssl(keyfile, None)
