"""The proxy's own tokenizer for the kv-aware policy: a model's tokenizer.json and chat template, no engine round trip.

Asking an engine's /tokenize is exact by construction (the engine's own code)
but costs an HTTP round trip to an API server that is busy serving; on the
routing benchmark's 2-core machine that added tens of milliseconds to every
request's time to first token (docs/bench.md). With `--tokenizer DIR` the proxy
renders and encodes itself, as vLLM does by default:

- /v1/completions: the prompt string encoded with special tokens (the
  request's `add_special_tokens`, default true); token-id prompts as given;
- /v1/chat/completions: the model's chat template (tokenizer_config.json)
  rendered with Jinja's sandbox the way transformers renders it (trim_blocks,
  lstrip_blocks, loopcontrols, raise_exception, tojson, strftime_now; the
  special tokens as variables), `add_generation_prompt` default true, then
  encoded without special tokens (the template holds them).

Anything it cannot render the same way (tools, documents, a request's own
template or template arguments, non-text content parts) returns None and the
caller asks the engine. The router's self-check compares this tokenizer's
output with the engine's for one chat and one prompt at start-up and stops
using it on a mismatch. `tokenizers` and `jinja2` are imported only when a
tokenizer is configured (vLLM depends on both).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from pdkv.errors import ConfigError

_ASK_ENGINE = ("tools", "documents", "chat_template", "chat_template_kwargs", "continue_final_message", "mm_processor_kwargs")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None



def completion_prompt(body: dict[str, Any]) -> list[int] | str | None:
    """A completions body's one prompt: its token ids as given, its text, or None (several prompts, or none)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None

class LocalTokenizer:
    """Token ids of a request's prompt from a model folder (tokenizer.json, tokenizer_config.json)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs the `tokenizers` package", hint="pip install tokenizers jinja2") from None
        try:
            self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").exists() else {}
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception type
            raise ConfigError(f"cannot load a tokenizer from {folder}: {exc}", hint="point --tokenizer at the model's folder") from None
        self.folder = folder
        self._specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        self._template = self._compile(template) if isinstance(template, str) else None

    @staticmethod
    def _compile(source: str) -> Any:
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError("--tokenizer needs the `jinja2` package for chat templates", hint="pip install jinja2") from None

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(source)

    def completion(self, body: dict[str, Any]) -> list[int] | None:
        prompt = completion_prompt(body)
        if not isinstance(prompt, str):
            return prompt
        return self._tok.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True))).ids

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if self._template is None or not isinstance(messages, list) or any(k in body for k in _ASK_ENGINE):
            return None
        flat = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):  # vLLM's default content format joins text parts with newlines
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    return None
                content = "\n".join(p["text"] for p in content)
            flat.append({**m, "content": content})
        try:
            text = self._template.render(messages=flat, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                                         **{k: v for k, v in self._specials.items() if v is not None})
        except Exception:  # noqa: BLE001 - a template error here is the engine's to report; ask it
            return None
        return self._tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False))).ids

    def token_ids(self, body: dict[str, Any], endpoint: str) -> list[int] | None:
        return self.chat(body) if endpoint.endswith("/chat/completions") else self.completion(body)
