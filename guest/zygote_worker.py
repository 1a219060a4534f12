"""The warm zygote behind Python ``execute``: imports once, forks a fresh child per call.

Started by ``guest/zygote.py`` as ``python3 -u zygote_worker.py CTL_FD [MODULE ...]``.
Stdlib only, and nothing from the agent: its children run user code, and they
must look like ``python3 -u FILE`` did it.

Theory of operation. At start we import the template's modules (``MODULE ...``),
then answer on CTL_FD, a SOCK_SEQPACKET socket: one JSON message ``ready``, then
per request ``{"id", "script", "cwd", "env", "status"}`` (with the exec's stdout and
stderr write ends as SCM_RIGHTS) we fork and answer ``{"id", "pid"}`` (or ``{"id",
"error"}``), and when that child exits ``{"pid", "returncode"}`` (``-N`` for
signal N, as asyncio reports it). We are the children's parent, so we reap them:
each gets a pidfd, which we select on with the socket (no SIGCHLD handler, so
the children inherit no signal state of ours).

Nothing leaks between calls because the zygote itself never runs user code:
every call starts from a copy of the same untouched process. The child makes
itself look like a fresh interpreter: a new session (its pgid is its pid, so the
agent's ``killpg`` on timeout reaches its whole tree), stdin /dev/null, fds 1/2
the exec's pipes, every other fd closed, the request's cwd and exact env, a new
``__main__``, ``sys.argv``/``sys.path[0]`` as for a script, and random state
reseeded: a golden snapshot holds this process, so every clone of it would
otherwise draw the same ``random``/numpy numbers. The import caches are kept
(see ``prepare_late``).

Staleness: a package installed after we started (pip into a site dir, a new user
site) would be invisible to our children though a fresh ``python3`` sees it. We
remember the mtimes of the ``sys.path`` directories; when one changes we refuse
new forks (``{"id", "stale": true}``) and exit once our children are done. The
agent then runs that call with plain ``python3`` and starts a new zygote.

The spare. Forking costs more than a short script: the fork copies our page
tables, and afterwards both processes take a copy-on-write fault for every page
they write (dozens of milliseconds under emulation). So whenever no child of ours
is alive we fork one *spare* child ahead of need, at idle priority (SCHED_IDLE:
it takes only CPU nobody else wants, typically while the host relays the last
answer). We tell the agent ``{"type": "forking"}`` first, then
``{"type": "spare", "pid", "watch"}`` with the spare's socket (SCM_RIGHTS), or
``{"type": "no-spare"}`` if the fork failed. The spare does the part of the
set-up that needs no request (new session, stdin /dev/null, other fds closed),
walks through what a run writes (``rehearse``) unless a request is already
waiting, and waits on that socket. The agent sends a request straight to it (the
same message as to us; we are not woken) after raising it to the normal policy,
and checks ``watch`` (our staleness mtimes) first; a request that comes while a
spare is being forked waits for it rather than forking a second child. If the
agent closes the socket instead, the spare exits unused. It is still our child:
we reap it and report its returncode like any other. A request that finds no
spare (two at once, or a stale zygote) comes to us and forks as before.

Early completion. Under emulation a child's exit (the kernel tearing down its
copy-on-write address space) and our reaping cost more than running ``print(1)``.
So a child that finishes its script normally first writes its exit status
(decimal ASCII) to the request's ``status`` file (on tmpfs), then points its fds
1 and 2 at /dev/null, then exits: once both output pipes reach EOF the agent
reads the file and can answer while the kernel still tears the process down. A
child that dies otherwise (a signal, ``os._exit``, ``exec``) writes nothing, and
one whose output pipes stay open (a background process holds them) is not read
early: those are known from our ``returncode`` message. Only the child itself
reports (not a process the user's code forked that returns through
``run_script``). No fd is added to the child: it sees only 0, 1 and 2.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib
import importlib.machinery
import json
import os
import select
import signal
import site
import socket
import sys
import threading  # loaded here, not in each child's shutdown
import time
import types
import warnings

MAX_MESSAGE = 256 * 1024
CANNOT_START = 120  # a child's exit status when its set-up failed
SPARE_BACKOFF = 1.0  # seconds before the next spare after a child could not start
TOP_FD = 1 << 20  # closerange end: the kernel clamps it to what is open
FORK_WARNS = sys.version_info >= (3, 12)  # about forking with C threads (DeprecationWarning)


def watched_dirs() -> dict[str, int]:
    """The directories whose change means a fresh python3 would see other packages."""
    paths = [p for p in sys.path if p] + [site.getusersitepackages()]
    return {p: _mtime(p) for p in dict.fromkeys(paths)}


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def fork() -> int:
    """``os.fork``, quiet about threads (3.12+ warns when C extensions started some)."""
    if not FORK_WARNS:
        return os.fork()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


class Zygote:
    """Every write the zygote makes after a fork costs it a copy-on-write fault (its
    pages are shared with the child), so the per-fork path is kept short: epoll
    directly (no selectors), replies formatted as bytes (no json)."""

    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.ctl_fd = ctl.fileno()
        self.poll = select.epoll()
        self.poll.register(self.ctl_fd, select.EPOLLIN)
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.watch = watched_dirs()  # (our sys.path is fixed: only the mtimes can change)
        self.stale = False
        self.spare_after = 0.0  # monotonic time before which no spare is forked

    def send(self, msg: dict) -> None:
        self.ctl.send(json.dumps(msg).encode())

    def serve(self) -> None:
        self.send({"type": "ready", "pid": os.getpid(), "python": sys.executable})
        while self.children or not self.stale:
            wait = None
            if not self.children and not self.stale:  # none alive: no spare, no exec
                wait = self.spare_after - time.monotonic()
                if wait <= 0:
                    wait = None
                    self.fork_spare()
            for fd, _ in self.poll.poll(-1 if wait is None else wait):
                if fd == self.ctl_fd:
                    if not self.receive():
                        return  # the agent is gone: our children are init's now
                else:
                    self.reap(fd)

    def receive(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.ctl, MAX_MESSAGE, 2)
        except InterruptedError:
            return True
        if not data:
            return False
        try:
            req = json.loads(data)
            if req.get("retire"):  # the agent has a newer zygote: finish and exit
                self.stale = True
            else:
                self.start(req, fds)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def start(self, req: dict, fds: list[int]) -> None:
        if self.stale or any(_mtime(p) != m for p, m in self.watch.items()):
            self.stale = True
            self.send({"id": req["id"], "stale": True})
            return
        req_id = int(req["id"])
        try:
            pid = fork()
        except OSError as exc:
            self.send({"id": req_id, "error": f"fork: {exc}"})
            return
        if pid == 0:
            self.become_child(req, fds)  # never returns
        self.watch_child(pid)
        self.ctl.send(b'{"id": %d, "pid": %d}' % (req_id, pid))

    def watch_child(self, pid: int) -> None:
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.poll.register(pidfd, select.EPOLLIN)

    def reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.poll.unregister(pidfd)  # (before the close: a younger child may hold a copy)
        os.close(pidfd)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code == CANNOT_START:  # no spare loop if they all fail
            self.spare_after = time.monotonic() + SPARE_BACKOFF
        self.ctl.send(b'{"pid": %d, "returncode": %d}' % (pid, code))

    def fork_spare(self) -> None:
        """Fork a spare child and hand the agent its socket (``{"type": "spare"}``).
        At idle priority, the fork and the spare's rehearsal alike: a request that
        arrives meanwhile goes first."""
        try:
            self.send({"type": "forking"})
        except OSError:
            return  # the agent is gone (serve sees the EOF)
        background()
        try:
            if not self._fork_spare():
                self.send({"type": "no-spare"})
        finally:
            foreground()

    def _fork_spare(self) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = fork()
        except OSError:
            ours.close()
            theirs.close()
            return False
        if pid == 0:
            ours.close()
            self.become_spare(theirs)  # never returns
        theirs.close()
        self.watch_child(pid)
        msg = {"type": "spare", "pid": pid, "watch": self.watch}
        try:
            socket.send_fds(self.ctl, [json.dumps(msg).encode()], [ours.fileno()])
        except OSError:
            pass  # the agent is gone; the spare sees EOF and exits
        ours.close()
        return True

    def become_spare(self, sock: socket.socket) -> None:
        """A child forked ahead of need: set up what needs no request, then wait on
        ``sock`` (the agent holds its other end) for one; EOF: exit unused."""
        try:
            self.poll.close()
            self.ctl.close()
            for pidfd in self.children:
                os.close(pidfd)
            fd = os.dup2(sock.detach(), SPARE_FD)
            prepare_early(keep=SPARE_FD)
            if not select.select([fd], [], [], 0)[0]:  # no request waiting yet
                rehearse()
            sock = socket.socket(fileno=fd)
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            sock.close()
            if not data or len(fds) != 2:
                os._exit(0)
            foreground()  # (normally the agent has raised us already)
            req = json.loads(data)
            prepare_late(req, *fds)
        except BaseException as exc:
            try:
                os.write(2, f"agentbox zygote: cannot start: {exc!r}\n".encode())
            finally:
                os._exit(CANNOT_START)
        self.run_child(req)

    def become_child(self, req: dict, fds: list[int]) -> None:
        try:
            out, err = fds
            self.poll.close()
            self.ctl.close()
            for pidfd in self.children:
                os.close(pidfd)
            os.dup2(out, 1)  # before the fds above 2 are closed
            os.dup2(err, 2)
            prepare_early()
            prepare_late(req, 1, 2, just_forked=True)
        except BaseException as exc:  # nothing of ours may run on in the child
            try:
                os.write(2, f"agentbox zygote: cannot start: {exc!r}\n".encode())
            finally:
                os._exit(CANNOT_START)
        self.run_child(req)

    def run_child(self, req: dict) -> None:
        me = os.getpid()
        code = run_script(req["script"])
        if os.getpid() == me and req.get("status"):  # not a process the user's code forked
            report(code, req["status"])
        os._exit(code)


SPARE_FD = 3  # a spare's request socket until it has its request
ZYGOTE_ENV: dict[str, str] = {}  # ours once preloaded (never changed): every child's to start


def prepare_early(keep: int | None = None) -> None:
    """The request-independent half of ``python3``'s start: own session, stdin
    /dev/null, every fd above 2 closed (but ``keep``)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    if keep is None:
        os.closerange(3, TOP_FD)
    else:
        os.closerange(3, keep)
        os.closerange(keep + 1, TOP_FD)


def prepare_late(req: dict, out: int, err: int, just_forked: bool = False) -> None:
    """The rest, from the request: what ``python3 -u SCRIPT`` would have started as.
    ``just_forked``: forked for this request (not a spare, which may have been forked
    before the golden snapshot was taken): ``random`` reseeded itself at the fork."""
    if (out, err) != (1, 2):
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
    os.chdir(req["cwd"])
    set_environ(req["env"])
    script = req["script"]
    sys.argv[:] = [script]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    # The import caches are not invalidated: as in any python3, a directory's cached
    # listing is used only while its mtime is unchanged, and a change to one of our
    # sys.path directories makes the zygote stale (``watched_dirs``). Invalidating them
    # cost ~3 ms per call under emulation and a re-listing of every directory at the
    # child's first import.
    reseed(random_too=not just_forked)


def background() -> None:
    """SCHED_IDLE: run only when nothing else in the guest wants the CPU."""
    _policy(os.SCHED_IDLE)


def foreground() -> None:
    """Back to the normal policy (what a fresh ``python3`` has)."""
    _policy(os.SCHED_OTHER)


def _policy(policy: int) -> None:
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        pass  # not permitted: the spare merely competes for the CPU


def rehearse() -> None:
    """Walk a spare through what running a script writes (a compile, an exec, the
    environ, the random state) while it waits, so that the
    copy-on-write faults those pages cost are taken now rather than during the
    request. Its output goes to the zygote's stdout (/dev/null)."""
    scratch = types.ModuleType("__main__")
    scratch.__dict__.update(__builtins__=builtins)
    exec(compile("print(end='')\n", "<spare>", "exec"), scratch.__dict__)
    set_environ(dict(ZYGOTE_ENV))
    reseed()


def set_environ(env: dict[str, str]) -> None:
    """Make ``os.environ`` exactly ``env``, touching only what differs (each change is
    a putenv/unsetenv; most requests share nearly all of the zygote's own, and many
    all of it: one dict comparison, no walk through ``os.environ``'s Python mapping)."""
    if env == ZYGOTE_ENV:
        return
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def report(code: int, path: str) -> None:
    """Tell the agent the script is done (see *Early completion*): status, then EOF."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, str(code).encode())
        finally:
            os.close(fd)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        background()  # what is left is the kernel tearing us down: the answer goes first
    except OSError:
        pass  # the agent gets our returncode from the zygote instead


def reseed(random_too: bool = True) -> None:
    """Fresh random state per child: ``random`` (and numpy's global RNG if loaded).
    ``random_too=False``: not ``random``, whose own at-fork hook has just reseeded it."""
    random = sys.modules.get("random") if random_too else None
    if random is not None:
        random.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def read_file(path: str) -> bytes:
    """The whole file, read with plain syscalls (no io objects: cheaper in a child)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def run_script(path: str) -> int:
    """Run ``path`` as ``__main__`` and return the exit status python3 would have."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(read_file(path), path, "exec"), main.__dict__)
    except SystemExit as exc:
        status = exit_status(exc)
    except BaseException as exc:
        tb = exc.__traceback__
        # Drop our own frame (the exec above); a SyntaxError has no frame of the script.
        exc.__traceback__ = tb.tb_next if tb is not None else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = 1
        if isinstance(exc, KeyboardInterrupt):
            status = -signal.SIGINT
    return finish(status)


def exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def finish(status: int) -> int:
    """What interpreter shutdown does before exit: threads, atexit, flushing."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if status < 0:  # killed by SIGINT, as python3 re-raises it
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


def main(argv: list[str]) -> None:
    ctl = socket.socket(fileno=int(argv[1]))
    del sys.path[0]  # our own directory: user modules must not find the agent's
    for name in argv[2:]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing module costs speed, not correctness
            print(f"agentbox zygote: cannot preload {name}: {exc!r}", file=sys.stderr)
    # Everything loaded so far goes to the permanent generation: a child's collections then
    # never walk (and so never copy-on-write) the zygote's pages; user objects still collect.
    gc.collect()
    gc.freeze()
    ZYGOTE_ENV.update(os.environ)  # after the imports: one may have set a variable
    Zygote(ctl).serve()


if __name__ == "__main__":
    main(sys.argv)
