"""Follow a key or prefix from a revision, every change exactly once, across reconnects.

A ``Watcher`` owns one named task that holds a ``/v3/watch`` stream open on one endpoint.
When the stream breaks (the member died, lost its leader, the network went) it reopens on
the next endpoint from the revision after the last one delivered, and drops anything at or
below it, so ``on_batch`` sees each revision once and in order. Progress notices advance the
position too. Errors in the stream (etcd's or ours) count as a break, and so does silence: a
member cut off by the network never closes our TCP stream, so after ``probe_after`` seconds
without a message the watcher asks that same member for a linearizable read (which needs a
leader) and moves on if it cannot answer. If the
history was compacted the watcher stops with ``Compacted``
(``exception``) and calls ``on_error``: the owner re-lists and starts a new watcher.

``on_batch`` and ``on_error`` are synchronous (state changes are; I/O happens elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError, Compacted
from gateway.cluster.etcd import EtcdClient
from gateway.cluster import tasks

log = logging.getLogger(__name__)


class Watcher:
    def __init__(self, client: EtcdClient, key: bytes | str, range_end: bytes | None,
                 start_revision: int, on_batch: Callable[[tuple[wire.Event, ...]], None], *,
                 name: str, on_error: Callable[[BaseException], None] | None = None,
                 retry_delay: float = 0.1, probe_after: float = 2.0) -> None:
        if start_revision < 1:
            raise ValueError("start_revision must be >= 1")
        self.client, self.key, self.range_end = client, key, range_end
        self.name, self.on_batch, self.on_error = name, on_batch, on_error
        self.retry_delay, self.probe_after = retry_delay, probe_after
        self._last_message = 0.0
        self.next_revision = start_revision  # the first revision not yet delivered
        self.exception: BaseException | None = None
        self.reconnects = 0
        self.ready = asyncio.Event()  # set while a stream is open and created
        self._index = client.order()[0]
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        state = "running" if self._task and not self._task.done() else "stopped"
        return f"<Watcher {self.name} {state} next={self.next_revision}>"

    @property
    def streaming_from(self) -> str:
        """The endpoint the current (or next) stream is on."""
        return self.client.endpoints[self._index]

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"etcd-watch:{self.name}")

    async def aclose(self, timeout: float = 2.0) -> None:
        """Idempotent: stop the task and wait (bounded) for it to end."""
        task, self._task = self._task, None
        await tasks.stop(task, timeout)

    def deliver(self, batch: wire.WatchBatch) -> None:
        """Apply one stream message (sans-IO: tests drive it directly)."""
        self._last_message = _now()
        if batch.canceled and batch.compact_revision:
            raise Compacted(batch.compact_revision)
        if batch.created:
            self.ready.set()
            return
        fresh = tuple(e for e in batch.events if e.kv.mod_revision >= self.next_revision)
        if fresh:
            self.next_revision = max(e.kv.mod_revision for e in fresh) + 1
            self.on_batch(fresh)
        elif not batch.events and not batch.canceled and batch.revision >= self.next_revision:
            self.next_revision = batch.revision + 1  # a progress notice: nothing before it
        if batch.canceled:
            raise _StreamEnded("watch canceled by the server")

    async def _run(self) -> None:
        try:
            while True:
                await self._one_stream()
                self.ready.clear()
                self.reconnects += 1
                self._index = (self._index + 1) % len(self.client.endpoints)
                await asyncio.sleep(self.retry_delay)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # Compacted, or a bug in on_batch
            self.exception = exc
            log.warning("watch %s stopped: %r", self.name, exc)
            if self.on_error is not None:
                self.on_error(exc)
        finally:
            self.ready.clear()

    async def _one_stream(self) -> None:
        """One stream until it breaks, ends, or its member stops answering probes."""
        self._last_message = _now()
        reader = asyncio.create_task(self._read(), name=f"etcd-watch-read:{self.name}")
        try:
            while not reader.done():
                await asyncio.wait({reader}, timeout=self.probe_after)
                if reader.done() or _now() - self._last_message < self.probe_after:
                    continue
                if not await self.client.probe(self._index, timeout=self.probe_after):
                    log.info("watch %s: %s stopped answering", self.name,
                             self.client.endpoints[self._index])
                    return
                self._last_message = _now()
            reader.result()
        finally:
            reader.cancel()
            await asyncio.wait({reader})  # never raises the reader's error, nor eats our cancel

    async def _read(self) -> None:
        body = wire.watch_body(self.key, self.range_end, self.next_revision)
        try:
            async for batch in self.client.watch_stream(self._index, body):
                self.deliver(batch)
        except Compacted:
            raise
        except (_StreamEnded, ClusterError) as exc:  # the stream broke: the caller reconnects
            log.info("watch %s on %s broke: %s", self.name,
                     self.client.endpoints[self._index], exc)


def _now() -> float:
    return time.monotonic()


class _StreamEnded(Exception):
    pass
