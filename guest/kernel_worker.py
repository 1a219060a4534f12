"""One interpreter context's worker process: holds the user's globals between runs.

Started by ``guest/interpreter.py`` as ``python3 kernel_worker.py CMD_FD EVT_FD``.
Stdlib only, and it imports nothing from the agent: it runs user code, so it
stays small and leaves ``sys.path``, ``sys.argv`` and ``__main__`` looking like
an interactive interpreter's.

Theory of operation. The agent writes one JSON line per run to CMD_FD
(``{"code", "env", "count"}``); this process answers on EVT_FD with JSON lines:
``ready`` once at start, then per run any number of ``result`` (a MIME bundle)
and at most one ``error``, and finally ``done``. User output is *not* on this
channel: fds 1 and 2 are pipes the agent reads, so ``print``, C extensions and
child processes are all captured alike. Before every event line we flush
``sys.stdout``/``sys.stderr``; the agent drains both pipes before it handles an
event, so output and events keep their order.

Interrupts. The agent sends SIGINT on timeout. Our handler raises
KeyboardInterrupt only while a run is executing, and never while an event line
is being written (it is deferred to the end of the write), so the event stream
is never cut mid-line and an idle worker ignores a late SIGINT.
"""

from __future__ import annotations

import ast
import base64
import builtins
import io
import json
import linecache
import os
import signal
import sys
import traceback
import types
import warnings

CO_COROUTINE = 0x0080  # inspect.CO_COROUTINE, without importing inspect
MAX_TEXT = 1024 * 1024  # a repr longer than this is cut (characters)
MAX_EVENT = 32 * 1024 * 1024  # a result bigger than this is replaced by a note
_HERE = os.path.abspath(__file__)
_REPRS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_latex_", "text/latex"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_json_", "application/json"),
    ("_repr_javascript_", "application/javascript"),
)
_JSON_TYPES = (dict, list, str, int, float, bool)


class Kernel:
    def __init__(self, events: io.BufferedWriter) -> None:
        self.events = events
        self.executing = False
        self.sending = False
        self.pending_interrupt = False
        self.loop = None  # an asyncio loop, made on the first top-level ``await``
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        main.__dict__["display"] = self.display
        sys.modules["__main__"] = main  # pickle and multiprocessing find user classes here
        self.ns = main.__dict__

    # -- events -------------------------------------------------------------------

    def send(self, event: dict) -> None:
        line = _dumps(event)
        if len(line) > MAX_EVENT and event.get("type") == "result":
            note = f"<result of {len(line)} bytes omitted: over {MAX_EVENT} bytes>"
            line = _dumps({"type": "result", "result": {"text/plain": note,
                           "is_main_result": event["result"].get("is_main_result", False)}})
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass  # the user replaced or closed it; the pipes still work
        self.sending = True
        try:
            self.events.write(line + b"\n")
            self.events.flush()
        finally:
            self.sending = False
        if self.pending_interrupt and self.executing:
            self.pending_interrupt = False
            raise KeyboardInterrupt

    def on_sigint(self, signum: int, frame: object) -> None:
        if not self.executing:
            return  # idle: a late interrupt must not kill the context
        if self.sending:
            self.pending_interrupt = True
            return
        raise KeyboardInterrupt

    def display(self, obj: object) -> None:
        """``display(obj)`` in user code: send ``obj`` as a (non-main) result now."""
        self.send({"type": "result", "result": bundle(obj, main=False)})

    # -- one run ------------------------------------------------------------------

    def run(self, req: dict) -> None:
        signal.signal(signal.SIGINT, self.on_sigint)  # user code may have replaced it
        saved = _apply_env(req.get("env") or {})
        error = None
        self.executing = True
        try:
            try:
                self._execute(req["code"], int(req.get("count", 0)))
            finally:
                self.executing = False
        except BaseException as exc:  # KeyboardInterrupt and SystemExit included
            error = _error_of(exc)
        finally:
            self.pending_interrupt = False
            _restore_env(saved)
        if error is not None:
            self.send({"type": "error", "error": error})
        self.send({"type": "done"})

    def _execute(self, code: str, count: int) -> None:
        filename = f"<cell-{count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            body, last = _split(code, filename)
        except SyntaxError as exc:
            raise exc.with_traceback(None) from None  # the parser's frames are not the user's
        if body is not None:
            self._eval(body)
        value = self._eval(last) if last is not None else None
        self._patch_pyplot()
        if value is not None:
            self.ns["_"] = value
            self.send({"type": "result", "result": bundle(value, main=True)})
        self.send_figures(skip=value)

    def _eval(self, code: types.CodeType) -> object:
        value = eval(code, self.ns)
        if code.co_flags & CO_COROUTINE:  # top-level ``await``
            if self.loop is None:
                import asyncio

                self.loop = asyncio.new_event_loop()
            value = self.loop.run_until_complete(value)
        return value

    # -- matplotlib -----------------------------------------------------------------

    def send_figures(self, skip: object = None) -> None:
        """Send every open pyplot figure as a PNG and close it (no-op without matplotlib)."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            if fig is not skip:
                self.send({"type": "result", "result": bundle(fig, main=False)})
        plt.close("all")

    def _patch_pyplot(self) -> None:
        # plt.show() sends the figures at that point (like Jupyter's inline backend);
        # until pyplot is first imported there is nothing to patch.
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is not None and getattr(plt.show, "__agentbox__", False) is False:
            def show(*args: object, **kwargs: object) -> None:
                self.send_figures()

            show.__agentbox__ = True  # type: ignore[attr-defined]
            plt.show = show


def bundle(value: object, main: bool) -> dict:
    """The MIME bundle for ``value``: text/plain always, richer forms when it offers them."""
    data: dict = {}
    if not isinstance(value, type):  # a class's _repr_html_ is an unbound function
        for attr, mime in _REPRS:
            rich = _call_repr(value, attr)
            if rich is not None:
                data[mime] = rich
        png = _figure_png(value)
        if png is not None:
            data["image/png"] = png
    if type(value) in _JSON_TYPES:
        try:
            if len(json.dumps(value, allow_nan=False)) <= MAX_TEXT:
                data["application/json"] = value
        except (TypeError, ValueError, RecursionError):
            pass  # not JSON: only the repr
    text = _safe_repr(value)
    data["text/plain"] = text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."
    data["is_main_result"] = main
    return data


def _call_repr(value: object, attr: str) -> object:
    method = getattr(value, attr, None)
    if not callable(method):
        return None
    try:
        out = method()
    except Exception:
        return None
    if isinstance(out, tuple):  # IPython allows (data, metadata)
        out = out[0] if out else None
    if isinstance(out, bytes):
        return base64.b64encode(out).decode("ascii")
    return out if isinstance(out, (str, dict, list)) else None


def _figure_png(value: object) -> str | None:
    if not type(value).__module__.startswith("matplotlib") or not hasattr(value, "savefig"):
        return None
    buf = io.BytesIO()
    try:
        value.savefig(buf, format="png", bbox_inches="tight")
    except Exception:
        return None  # the text/plain repr still goes out
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<repr failed: {type(exc).__name__}: {exc}>"


def _split(code: str, filename: str) -> tuple[types.CodeType | None, types.CodeType | None]:
    """Compile ``code`` as (everything but a trailing expression, that expression).

    Like Jupyter, a trailing ``;`` after the last expression hides its value.
    """
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _silenced(code, tree.body[-1]):
        last = ast.Expression(tree.body.pop().value)
    # dont_inherit: this module's ``from __future__`` imports must not apply to user code.
    body = compile(tree, filename, "exec", flags=flags, dont_inherit=True) if tree.body else None
    if last is None:
        return body, None
    return body, compile(last, filename, "eval", flags=flags, dont_inherit=True)


def _silenced(code: str, node: ast.expr) -> bool:
    lines = code.splitlines()
    if node.end_lineno is None or node.end_col_offset is None:
        return False
    rest = lines[node.end_lineno - 1].encode()[node.end_col_offset:].decode(errors="replace")
    return rest.lstrip().startswith(";")


def _error_of(exc: BaseException) -> dict:
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    _drop_worker_frames(report, set())
    text = "".join(report.format())
    return {"name": type(exc).__name__, "value": _safe_str(exc), "traceback": text}


def _drop_worker_frames(report: traceback.TracebackException, seen: set[int]) -> None:
    """The worker's own frames (exec, the SIGINT handler) are noise to the user."""
    if id(report) in seen:
        return
    seen.add(id(report))
    frames = [f for f in report.stack if f.filename != _HERE]
    report.stack = traceback.StackSummary.from_list(frames)
    for linked in (report.__cause__, report.__context__):
        if linked is not None:
            _drop_worker_frames(linked, seen)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__name__}>"


def _apply_env(env: dict) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return saved


def _restore_env(saved: dict) -> None:
    for key, old in saved.items():
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _dumps(event: dict) -> bytes:
    # default=repr: a _repr_json_ that returns odd objects still produces a line.
    return json.dumps(event, default=repr).encode("utf-8", "surrogateescape")


def _prepare_process() -> None:
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(_HERE):
        sys.path[0] = ""  # user imports resolve against the cwd, not the agent's directory
    sys.argv = [""]
    # Line-buffered: a print() reaches the pipe as one write, at its newline (a partial
    # line goes at the next event, flush() or the end of the run).
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    # Agg cannot show windows; plt.show() is patched to send figures instead.
    warnings.filterwarnings("ignore", message=".*(non-interactive|non-GUI backend).*")
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main() -> None:
    cmd_fd, evt_fd = int(sys.argv[1]), int(sys.argv[2])
    for fd in (cmd_fd, evt_fd):
        os.set_inheritable(fd, False)  # user subprocesses must not hold our channel
    _prepare_process()
    commands = os.fdopen(cmd_fd, "rb")
    kernel = Kernel(os.fdopen(evt_fd, "wb"))
    kernel.send({"type": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    for line in commands:  # EOF: the agent closed the context (or died)
        if line.strip():
            kernel.run(json.loads(line))
    os._exit(0)  # skip atexit and finalizers of user objects: the context is gone


if __name__ == "__main__":
    main()
