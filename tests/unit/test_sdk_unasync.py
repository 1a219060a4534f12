"""The sync SDK modules are generated from their asyncio sources (sdk/python/gen_sync.py):
the committed files must be exactly what the generator writes, and the two APIs match."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

GEN = Path(__file__).resolve().parents[2] / "sdk" / "python" / "gen_sync.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_sync", GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_sync_modules_are_the_generated_ones():
    gen = _generator()
    for path, text in gen.generated().items():
        assert path.read_text() == text, (
            f"{path.name} differs from what sdk/python/gen_sync.py generates from its async "
            "source: edit the async module, then run `python sdk/python/gen_sync.py`")


def test_sync_and_async_apis_have_the_same_methods():
    gen = _generator()
    for src, dst in gen.MODULES.items():
        amod = importlib.import_module("agentbox." + src.removesuffix(".py"))
        smod = importlib.import_module("agentbox." + dst.removesuffix(".py"))
        for name, acls in inspect.getmembers(amod, inspect.isclass):
            if not name.startswith("Async") or acls.__module__ != amod.__name__:
                continue
            scls = getattr(smod, name.removeprefix("Async"))
            amethods = {n for n, f in vars(acls).items() if callable(f) or isinstance(f, property)}
            smethods = {n for n, f in vars(scls).items() if callable(f) or isinstance(f, property)}
            rename = {"__aiter__": "__iter__", "__anext__": "__next__", "aclose": "close",
                      "__aenter__": "__enter__", "__aexit__": "__exit__"}
            assert {rename.get(n, n) for n in amethods} == smethods, name
            for method in amethods - set(rename):
                afunc = getattr(acls, method)
                if inspect.iscoroutinefunction(afunc):
                    assert not inspect.iscoroutinefunction(getattr(scls, method)), method


def test_the_rules_unasync_the_constructs_the_sources_use():
    gen = _generator()
    src = ("import asyncio\n"
           "class AsyncThing:\n"
           "    async def go(self, a: int,\n"
           "                 b: int) -> AsyncIterator[int]:\n"
           "        async with contextlib.aclosing(self._t.events(c)) as events:\n"
           "            async for e in events:\n"
           "                await maybe_await(notify(cb, e))\n"
           "        await asyncio.sleep(1)\n"
           "        return (await self.info()).state, f(await self.g())\n"
           "    def __aiter__(self): ...  # unasync: drop\n"
           "    # unasync: add x = AsyncThing  # verbatim\n")
    assert gen.unasync(src, "x.py").splitlines()[1:] == [
        "import time",
        "class Thing:",
        "    def go(self, a: int,",
        "           b: int) -> Iterator[int]:",
        "        with contextlib.closing(self._t.events(c)) as events:",
        "            for e in events:",
        "                notify(cb, e)",
        "        time.sleep(1)",
        "        return self.info().state, f(self.g())",
        "    x = AsyncThing  # verbatim",
    ]
