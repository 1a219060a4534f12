"""``box.builds``: templates built from a Dockerfile (``/v1/templates/builds``).

(``agentbox.builds`` is generated from ``async_builds.py`` by sdk/python/gen_sync.py.)

``build`` packs the context directory as a tar (the Dockerfile in it, or added from
``dockerfile``), starts the build, follows its NDJSON log (each event handed to
``on_event``) and returns the finished ``TemplateBuild``; a failed build raises
``TemplateBuildError`` carrying the build (its ``error`` says which step, with the exit
code). Docs: docs/templates.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from agentbox import _calls
from agentbox._build_context import pack_context
from agentbox._transport import AsyncTransport
from agentbox.exceptions import TemplateBuildError
from agentbox.models import TemplateBuild


class AsyncBuilds:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def build(self, name: str, context: str | Path = ".",
                    dockerfile: str | Path | None = None, *,
                    on_event: Callable[[dict[str, Any]], None] | None = None,
                    wait: bool = True) -> TemplateBuild:
        """Build template ``name`` from ``context`` (a directory); ``dockerfile``: a path
        (default ``CONTEXT/Dockerfile``). ``wait=False`` returns as soon as it started."""
        body, path_in_tar = pack_context(Path(context), dockerfile)
        started = TemplateBuild.from_dict(
            (await self._t.json(_calls.start_build(name, path_in_tar, body)))["build"])
        if not wait:
            return started
        async for event in self.logs(started.id):
            if on_event is not None:
                on_event(event)
        done = await self.get(started.id)
        if done.state != "ready":
            raise TemplateBuildError(done)
        return done

    async def get(self, build_id: str) -> TemplateBuild:
        return TemplateBuild.from_dict((await self._t.json(_calls.get_build(build_id)))["build"])

    def logs(self, build_id: str) -> AsyncIterator[dict[str, Any]]:
        """The build's events so far, then new ones until it ends."""
        return self._t.events(_calls.build_log(build_id))
