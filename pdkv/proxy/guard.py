"""Who may use the proxy's HTTP surfaces, and its TLS context. Pure apart from reading key and cert files.

- the API (/v1/*): when API keys are set, `Authorization: Bearer <one of them>`, as vLLM's --api-key;
- the admin surface (/pdkv/*, /metrics): when the admin key is set, `Authorization: Bearer <admin key>`;
- /health stays open (load balancers and `pdkv up` probe it).

Keys come from `--api-key` (repeatable), `--api-key-file` (one key a line, `#` comments) and env
PDKV_API_KEY (comma-separated); the admin key from `--admin-key` or env PDKV_ADMIN_KEY.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdkv.auth import bearer_ok
from pdkv.errors import ConfigError
from pdkv.proxy_api import ADMIN_KEY_ENV, ADMIN_PREFIXES, API_KEY_ENV


@dataclass(frozen=True)
class HttpGuard:
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None

    def refusal(self, path: str, authorization: str | None) -> str | None:
        """Why a request for `path` with this Authorization header is refused (answer 401), or None."""
        if path.startswith(ADMIN_PREFIXES):
            if self.admin_key and not bearer_ok(authorization, self.admin_key):
                return f"{path} needs the proxy's admin key (Authorization: Bearer ...)"
        elif path.startswith("/v1/") and self.api_keys and not bearer_ok(authorization, self.api_keys):
            return "a valid API key is needed (Authorization: Bearer ...)"
        return None


def load_guard(api_keys: list[str] | None = None, api_key_file: Path | None = None, admin_key: str | None = None,
               env: dict[str, str] | None = None) -> HttpGuard:
    """The guard from flags and environment; ConfigError for an unreadable key file or an empty key."""
    env = os.environ if env is None else env
    keys = [k.strip() for k in api_keys or ()]
    keys += [k.strip() for k in env.get(API_KEY_ENV, "").split(",") if k.strip()]
    if api_key_file is not None:
        try:
            lines = api_key_file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {api_key_file}: {exc.strerror or exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if any(not k for k in keys):
        raise ConfigError("an API key is empty", hint="give each --api-key a value")
    admin = admin_key if admin_key is not None else env.get(ADMIN_KEY_ENV) or None
    if admin is not None and not admin.strip():
        raise ConfigError("the admin key is empty")
    return HttpGuard(tuple(dict.fromkeys(keys)), admin)


def server_ssl(certfile: Path | None, keyfile: Path | None) -> Any:
    """An ssl.SSLContext for the listener, or None without a certificate; ConfigError if the pair does not load."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile")
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(certfile), str(keyfile) if keyfile is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {certfile}: {exc}") from None
    return ctx
