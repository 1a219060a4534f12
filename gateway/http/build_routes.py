"""Template builds over HTTP (docs/templates.md).

    POST /v1/templates/builds?name=NAME[&dockerfile=PATH]   body: the build context as a tar
        -> 202 {"build": {...}}                              (the Dockerfile is in the tar)
    GET  /v1/templates/builds/{id}                          -> {"build": {...}}
    GET  /v1/templates/builds/{id}/log                      -> NDJSON events, follows the build

The context is streamed to disk, bounded by ``[build] max_context_bytes`` (413 beyond), and
unpacked with tarfile's ``data`` filter (no absolute paths, no ``..``, no links out, no
devices), bounded again in members and unpacked size.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from gateway.http import wire
from gateway.http.sandbox_routes import json_response
from gateway.builds.service import BuildService
from gateway.builds.builtin import BuiltinBuilds
from gateway.config import Config
from gateway.errors import BadRequest, PayloadTooLarge, Unavailable
from gateway.http.middleware import current_key
from gateway.sandbox.goldens import Golden, ensure_golden
from gateway.sandbox.service import SandboxService
from guest.protocol import validate_path

log = logging.getLogger(__name__)

BUILDS_KEY = web.AppKey("builds", BuildService)
MAX_CONTEXT_KEY = web.AppKey("max_context", int)
MAX_MEMBERS = 10000
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789._-")

routes = web.RouteTableDef()


def _builds(request: web.Request) -> BuildService:
    service = request.app.get(BUILDS_KEY)
    if service is None:
        raise Unavailable("template builds are not available on this host (no backend)",
                          code="builds_unavailable")
    return service


def validate_name(name: str | None) -> str:
    if not name or len(name) > 63 or not set(name) <= NAME_CHARS or not name[0].isalnum():
        raise BadRequest("a template name is 1-63 characters of [a-z0-9._-], starting with a "
                         "letter or digit", code="bad_template_name")
    return name


@routes.post("/v1/templates/builds")
async def start_build(request: web.Request) -> web.Response:
    tenant = current_key(request).id
    name = validate_name(request.query.get("name"))
    dockerfile = request.query.get("dockerfile", "Dockerfile")
    validate_path("/" + dockerfile)
    service = _builds(request)
    root = service.cache.parent / "build-contexts" / f"ctx-{secrets.token_hex(8)}"
    try:
        await _receive(request, root, request.app[MAX_CONTEXT_KEY])
        path = (root / "ctx" / dockerfile).resolve()
        if not path.is_relative_to((root / "ctx").resolve()) or not path.is_file():
            raise BadRequest(f"the context has no file {dockerfile!r}", code="bad_dockerfile")
        text = path.read_text(errors="replace")
        build = service.start(tenant, name, text, root / "ctx",
                              cleanup=lambda: shutil.rmtree(root, ignore_errors=True))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return json_response(wire.BuildResponse(build=build.view()), status=202)


async def _receive(request: web.Request, root: Path, limit: int) -> None:
    root.mkdir(parents=True)
    size = 0
    with open(root / "context.tar", "wb") as f:
        async for chunk in request.content.iter_chunked(256 * 1024):
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the build context is larger than {limit} bytes")
            f.write(chunk)
    await asyncio.to_thread(unpack, root / "context.tar", root / "ctx", limit * 4)


def unpack(tar_path: Path, dest: Path, max_bytes: int) -> None:
    dest.mkdir()
    try:
        with tarfile.open(tar_path) as tar:
            members = tar.getmembers()
            if len(members) > MAX_MEMBERS:
                raise BadRequest(f"the build context has more than {MAX_MEMBERS} entries",
                                 code="bad_context")
            if sum(m.size for m in members if m.isfile()) > max_bytes:
                raise PayloadTooLarge("the build context unpacks to more than "
                                      f"{max_bytes} bytes")
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise BadRequest(f"the build context is not a usable tar: {exc}",
                         code="bad_context") from exc
    tar_path.unlink()


@routes.get("/v1/templates/builds/{build_id}")
async def get_build(request: web.Request) -> web.Response:
    build = _builds(request).get(current_key(request).id, request.match_info["build_id"])
    return json_response(wire.BuildResponse(build=build.view()))


@routes.get("/v1/templates/builds/{build_id}/log")
async def build_log(request: web.Request) -> web.StreamResponse:
    build = _builds(request).get(current_key(request).id, request.match_info["build_id"])
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    async for event in build.follow():
        await resp.write(orjson.dumps(event) + b"\n")
    await resp.write_eof()
    return resp


# -- wiring (the seam to the template catalog) ----------------------------------------------

def resolve_base(service: SandboxService) -> Callable[[str, str], Golden]:
    """FROM: the golden a template name means for a tenant (a built-in, an alias of one, or
    one of the tenant's own templates)."""
    def resolve(tenant: str, name: str) -> Golden:
        return service.resolve_template(tenant, name)[1]
    return resolve


def register_template(service: SandboxService) -> Callable[..., dict[str, Any]]:
    """Make a built golden the tenant's template ``name``: a hard-linked copy of the cached
    golden in a catalog directory of its own (deleting the template never touches the
    cache), registered in the catalog (gateway.templates.catalog)."""
    def register(tenant: str, name: str, golden_dir: Path, base: Path) -> dict[str, Any]:
        service.templates.check_new(tenant, name)  # before any copying
        template_id, dest = service.templates.new_dir()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp")
        try:
            shutil.copytree(golden_dir, tmp, copy_function=os.link)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            # parent: its layers stand on the FROM golden's disk, which must outlive it (a
            # tenant template is kept while this one is; `images gc` keeps the built-in build).
            return wire.encode(service.templates.add(tenant, name, dest, "dockerfile",
                                                     parent=base, template_id=template_id))
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
    return register


def attach(app: web.Application, config: Config, service: SandboxService) -> BuildService:
    """Create the build services for a started daemon (called from gateway.http.app)."""
    data = config.server.data_dir
    builds = BuildService(service.backend, data / "build-cache", resolve_base(service),
                          register_template(service),
                          hosts=config.build.registry_hosts, ca_bundle=config.build.ca_bundle,
                          step_timeout=config.build.step_timeout,
                          build_timeout=config.build.build_timeout,
                          cache_max_bytes=config.build.cache_max_mib << 20)
    app[BUILDS_KEY] = builds
    pending = [n for n in config.sandbox.templates if n not in service.goldens]
    if config.build.background_builtins and pending:
        async def make_golden(image: Any, progress: Callable[[str], None]) -> Golden:
            return await ensure_golden(image, service.backend, progress=progress,
                                       build_slot=len(config.sandbox.templates))

        def ready(name: str, golden: Golden) -> None:
            service.goldens[name] = golden

        service.builtin_builds = BuiltinBuilds(pending, config.server.images_dir, None,
                                               make_golden, ready)
        service.builtin_builds.start()
        log.info("building in the background: %s", ", ".join(pending))
    return builds


async def detach(app: web.Application, service: SandboxService) -> None:
    if service.builtin_builds is not None:
        await service.builtin_builds.aclose()
    builds = app.get(BUILDS_KEY)
    if builds is not None:
        await builds.aclose()
