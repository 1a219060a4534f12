"""The dashboard's terminal screen (gateway/http/dashboard/static/screen.js), run in headless
Chromium: what a shell and full-screen programs print becomes the right text, escape
sequences split across frames included, and output is never parsed as HTML."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from gateway.http import dashboard
from tests.browser import browser_page

# (name, rows, cols, writes, expected lines, expected cursor [row, col] or None)
CASES = [
    ("lines", 5, 20, ["hello\r\nworld"], ["hello", "world"], [1, 5]),
    ("autowrap", 5, 5, ["abcdefg"], ["abcde", "fg"], [1, 2]),
    ("wrap waits for the next character", 5, 5, ["abcde\r\n"], ["abcde", ""], [1, 0]),
    ("cursor position and erase to end of line", 5, 20, ["xxxxx\x1b[1;3H\x1b[K"], ["xx"], [0, 2]),
    ("erase display", 3, 10, ["a\r\nb\r\nc", "\x1b[2J\x1b[H", "z"], ["z"], [0, 1]),
    ("scrolling keeps a scrollback", 3, 10, ["1\r\n2\r\n3\r\n4"], ["1", "2", "3", "4"], None),
    ("alternate screen hides and restores the main one", 3, 10,
     ["main\r\n", "\x1b[?1049h", "full"], ["full"], None),
    ("leaving the alternate screen", 3, 10,
     ["main\r\n", "\x1b[?1049h", "full", "\x1b[?1049l"], ["main", ""], [1, 0]),
    ("a sequence split across frames", 3, 10, ["ab\x1b[", "2", "J\x1b[1;1", "Hc"], ["c"], [0, 1]),
    ("delete and insert characters", 3, 10, ["abcdef\r\x1b[2P", "\x1b[@-"], ["-cdef"], [0, 1]),
    ("backspace-space-backspace (readline)", 3, 10, ["abc\b \b"], ["ab"], [0, 2]),
    ("colours and titles are dropped", 3, 20,
     ["\x1b]0;title\x07\x1b[1;31mred\x1b[0m ok"], ["red ok"], [0, 6]),
    ("scroll region: insert line", 4, 10, ["1\r\n2\r\n3\r\n4", "\x1b[2;4r\x1b[2;1H\x1b[L"],
     ["1", "", "2", "3"], [1, 0]),
    ("reverse index at the top scrolls down", 3, 10, ["a\r\nb", "\x1b[H\x1bM"], ["", "a", "b"],
     [0, 0]),
]

RUN = """async (cases) => {
  const { Screen } = await import('/dashboard/screen.js');
  return cases.map(([name, rows, cols, writes]) => {
    const s = new Screen(rows, cols);
    for (const w of writes) s.write(w);
    return [s.lines(), [s.r, s.c]];
  });
}"""

RENDER = """async () => {
  const { Screen } = await import('/dashboard/screen.js');
  const s = new Screen(5, 60);
  const pre = document.createElement('pre');
  document.body.append(pre);
  s.write('<img src=x onerror="window.__pwned=1"><b>bold</b>\\r\\n$ ');
  s.render(pre);
  return [pre.textContent, pre.querySelectorAll('img, b').length,
          pre.querySelector('.cursor').textContent, window.__pwned === undefined];
}"""


@pytest.mark.timeout(60)
async def test_screen(aiohttp_server):
    app = web.Application()
    dashboard.setup(app)
    server = await aiohttp_server(app)
    async with browser_page() as (page, watch):
        await page.goto(str(server.make_url("/dashboard")))
        got = await page.evaluate(RUN, [list(c[:4]) for c in CASES])
        failures = []
        for (name, _, _, _, lines, cursor), (got_lines, got_cursor) in zip(CASES, got, strict=True):
            if got_lines != lines or (cursor is not None and got_cursor != cursor):
                failures.append(f"{name}: {json.dumps(got_lines)} at {got_cursor}, "
                                f"want {json.dumps(lines)} at {cursor}")
        assert not failures, "\n".join(failures)
        text, elements, cursor, safe = await page.evaluate(RENDER)
        assert text.startswith('<img src=x onerror="window.__pwned=1"><b>bold</b>\n$ ')
        assert elements == 0 and safe and cursor == " "
