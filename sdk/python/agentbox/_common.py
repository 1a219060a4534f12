"""Small pure helpers shared by the sync and async sandbox classes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from agentbox.exceptions import InvalidArgumentError
from agentbox.models import CodeContext, ServerInfo

DEFAULT_TEMPLATE = "python"


def pick_template(template: str | None, environment: str | None) -> str | None:
    """``environment`` is an alias of ``template`` (the seed examples use it)."""
    if environment is not None and template not in (None, DEFAULT_TEMPLATE, environment):
        raise InvalidArgumentError(f"template={template!r} and environment={environment!r} "
                                   "disagree; give one of them")
    return environment if environment is not None else template


def preview_url(info: ServerInfo | None, base_url: str, sandbox_id: str, port: int) -> str:
    """The URL under which the gateway serves ``port`` of a sandbox.

    From the server's ``preview_url_template`` (``GET /v1/info``), else
    ``{scheme}://{port}-{id}.localhost[:{gateway port}]``.
    """
    if not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidArgumentError(f"port must be 1-65535, not {port!r}")
    template = info.preview_url_template if info else None
    if not template:
        parts = urlsplit(base_url)
        suffix = f":{parts.port}" if parts.port else ""
        template = f"{parts.scheme or 'http'}://{{port}}-{{id}}.localhost{suffix}"
    return template.replace("{port}", str(port)).replace("{id}", sandbox_id)


def with_token(url: str, token: str) -> str:
    """``url`` carrying the preview token once (the gateway answers with a cookie)."""
    parts = urlsplit(url)
    base = url if parts.path or parts.query else url + "/"
    return f"{base}{'&' if parts.query else '?'}token={quote(token, safe='')}"


def session_url(info: ServerInfo | None, base_url: str, name: str,
                given: str | None = None) -> str:
    """A session's URL: from ``session_url_template`` (``GET /v1/info``), else the one the
    server gave, else ``{scheme}://{name}.sessions.localhost[:{gateway port}]``."""
    template = info.session_url_template if info else None
    if template:
        return template.replace("{name}", name)
    if given:
        return given
    parts = urlsplit(base_url)
    suffix = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme or 'http'}://{name}.sessions.localhost{suffix}"


def host_of(url: str) -> str:
    return urlsplit(url).netloc


def ws_url(base_url: str, path: str) -> str:
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://"):] + path
    return "ws://" + base_url.split("://", 1)[-1] + path


def context_name(context: str | CodeContext | None) -> str | None:
    return context.name if isinstance(context, CodeContext) else context


def run_callbacks(on_stdout: Callable[..., Any] | None, on_stderr: Callable[..., Any] | None,
                  on_result: Callable[..., Any] | None,
                  on_error: Callable[..., Any] | None) -> dict[str, Any]:
    return {"stdout": on_stdout, "stderr": on_stderr, "result": on_result, "error": on_error}


def suppress_on_unwind(exc_type: Any) -> bool:
    """While an exception is already propagating, cleanup errors are not worth
    masking it for."""
    return exc_type is not None
