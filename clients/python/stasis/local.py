"""Run a ``stasis serve`` on this machine: for development, examples and
tests.

``LocalServer`` starts the server on a state directory, waits until it
serves (its address on stdout, then /healthz, both bounded by a deadline),
and can kill it as a preemption would: ``preempt()`` sends SIGKILL to the
server and to every local sandbox of its state directory (their keeper,
bubblewrap and init, each checked by its start time), as a lost machine
loses them all, which is what ``stasis run --crash`` does. A new
``start()`` on the same directory finds the episodes lost, for a restore.
``close()`` leaves nothing running and removes the gateway's socket
directory (/tmp/stasis-gw-HASH).

Linux only (it reads /proc). It kills only processes it started, or that
the server it started started (named by the state directory's files).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .client import Client


def _poll(proc: subprocess.Popen, deadline: float, what: str, ready, tail=lambda: "") -> object:
    """Call ready() every 50 ms until it returns something other than None,
    and return that; fail when proc exits first or the deadline passes.
    what names the wait in the error, tail adds to it (a log's end)."""
    while True:
        v = ready()
        if v is not None:
            return v
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}{tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within the deadline{tail()}")
        time.sleep(0.05)  # poll interval, bounded by the deadline

__all__ = ["LocalServer", "ScriptedModel", "ProcessIdentity", "BIN_ENV", "find_binary", "gateway_socket_dir"]

BIN_ENV = "STASIS_BIN"
"""The environment variable naming the stasis binary to run."""


@dataclass(frozen=True)
class ProcessIdentity:
    """A PID and its start time (clock ticks since boot): a PID that was
    reused is not the same process."""

    pid: int
    start_time: int

    def alive(self) -> bool:
        st = _stat(self.pid)
        return st is not None and st[1] == self.start_time and st[0] not in ("Z", "X")


def _stat(pid: int) -> Optional[tuple[str, int]]:
    """The state and start time of a process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            b = f.read()
    except OSError:
        return None
    rest = b[b.rfind(b")") + 2 :].split()
    # rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    return rest[0].decode(), int(rest[19])


def identity_of(pid: int) -> Optional[ProcessIdentity]:
    st = _stat(pid)
    return ProcessIdentity(pid, st[1]) if st else None


def find_binary(binary: Optional[str] = None) -> str:
    """The stasis binary: binary, else $STASIS_BIN, else stasis on $PATH."""
    b = binary or os.environ.get(BIN_ENV) or shutil.which("stasis")
    if not b:
        raise FileNotFoundError(f"no stasis binary: give one, set ${BIN_ENV}, or put stasis on $PATH (make build makes bin/stasis)")
    b = os.path.abspath(b)
    if not os.access(b, os.X_OK):
        raise FileNotFoundError(f"{b}: not an executable (make build makes bin/stasis)")
    return b


def gateway_socket_dir(state_dir: str) -> str:
    """/tmp/stasis-gw-HASH: where every server on state_dir serves its
    gateway to the sandboxes (server.GatewaySocket)."""
    h = hashlib.sha256(os.path.abspath(state_dir).encode()).hexdigest()[:16]
    return os.path.join("/tmp", "stasis-gw-" + h)


class LocalServer:
    """A ``stasis serve`` child on state_dir.

    ``listen`` defaults to a unix socket in state_dir (or, when that path is
    too long for one, a free loopback port). ``args`` are more serve flags
    (e.g. ["--api-token-file", F]); ``env`` its environment (default this
    one's). The server's stderr is appended to STATE/serve.log.
    """

    def __init__(
        self,
        state_dir: str,
        *,
        binary: Optional[str] = None,
        listen: Optional[str] = None,
        args: Sequence[str] = (),
        env: Optional[dict[str, str]] = None,
        start_timeout: float = 90.0,
    ):
        self.state_dir = os.path.abspath(state_dir)
        self.binary = find_binary(binary)
        if listen is None:
            sock = os.path.join(self.state_dir, "api.sock")
            listen = "unix:" + sock if len(sock) < 100 else "127.0.0.1:0"
        self.listen = listen
        self.args = list(args)
        self.env = env
        self.start_timeout = start_timeout
        self.address: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.started: list[ProcessIdentity] = []  # every server process this started
        self.sandbox_processes: set[ProcessIdentity] = set()  # every sandbox process seen
        self.starts = 0

    def __enter__(self) -> "LocalServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def log_path(self) -> str:
        return os.path.join(self.state_dir, "serve.log")

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def start(self) -> str:
        """Start the server and wait until it serves; returns its address."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the server is running already")
        os.makedirs(self.state_dir, exist_ok=True)
        self.starts += 1
        out_path = os.path.join(self.state_dir, f"serve-{self.starts}.out")
        cmd = [self.binary, "serve", "--listen", self.listen, "--state", self.state_dir, *self.args]
        with open(out_path, "wb") as out, open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=log, env=self.env, close_fds=True)
        ident = identity_of(self.proc.pid)
        if ident:
            self.started.append(ident)
        deadline = time.monotonic() + self.start_timeout
        try:
            # Once serving, serve prints its address: one line on stdout.
            def printed():
                with open(out_path, "rb") as f:
                    first = f.read()
                return first.split(b"\n", 1)[0].decode().strip() if b"\n" in first else None

            tail = lambda: "; its log:\n" + self.log_tail()
            addr = _poll(self.proc, deadline, "stasis serve printed no address", printed, tail)
            self.address = addr
            # Then it answers /healthz.
            c = Client(addr, retries=0, timeout=5.0)

            def healthy():
                try:
                    return True if c.healthz() else None
                except Exception:
                    return None

            _poll(self.proc, deadline, "stasis serve did not answer /healthz", healthy, tail)
        except BaseException:
            self.kill()
            raise
        return addr

    def client(self, **kw) -> Client:
        """A Client of this server (kw: Client's arguments)."""
        if self.address is None:
            raise RuntimeError("the server has not started")
        return Client(self.address, **kw)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the server (not its sandboxes), and wait for it."""
        if self.proc is None:
            return
        self._note_sandboxes()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server, SIGKILL after timeout. It leaves its
        sandboxes running (for the next server on the directory)."""
        if self.proc is None:
            return
        self._note_sandboxes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # --- sandboxes ---------------------------------------------------------------

    def _sandbox_dirs(self) -> list[str]:
        root = os.path.join(self.state_dir, "local", "sandboxes", "local")
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return []
        return [os.path.join(root, n) for n in sorted(names) if os.path.isdir(os.path.join(root, n))]

    @staticmethod
    def _keeper(d: str) -> list[ProcessIdentity]:
        try:
            with open(os.path.join(d, "keeper.json")) as f:
                k = json.load(f)
        except (OSError, ValueError):
            return []
        out = []
        for role in ("init", "bwrap", "keeper"):
            i = k.get(role) or {}
            if i.get("pid", 0) > 0:
                out.append(ProcessIdentity(int(i["pid"]), int(i.get("start_time", 0))))
        return out

    def _note_sandboxes(self) -> None:
        for d in self._sandbox_dirs():
            self.sandbox_processes.update(self._keeper(d))

    def crash_sandboxes(self, timeout: float = 15.0) -> int:
        """SIGKILL every local sandbox of the state directory, as a crash of
        the machine would (no clean shutdown; their directories stay), and
        remove their control groups. Returns how many it killed."""
        n = 0
        for d in self._sandbox_dirs():
            ids = self._keeper(d)
            self.sandbox_processes.update(ids)
            if any(i.alive() for i in ids):
                n += 1
            _kill_and_wait(ids, timeout)
            _remove_cgroups(d, timeout)
        return n

    def preempt(self) -> int:
        """What a preemption does: SIGKILL to the server and every sandbox.
        Returns how many sandboxes it killed."""
        self.kill()
        return self.crash_sandboxes()

    # --- leaving nothing behind ---------------------------------------------------

    def _strays(self) -> list[ProcessIdentity]:
        """Processes that name the state directory on their command line
        (a sandbox's keeper does) and are still alive."""
        out = []
        needle = self.state_dir.encode()
        mine = _ancestors()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in mine:
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if needle + b"\0" in cmd or needle + b"/" in cmd:
                i = identity_of(int(name))
                if i and i.alive():
                    out.append(i)
        return out

    def leftovers(self) -> list[ProcessIdentity]:
        """Every process this started (the servers, the sandboxes seen, any
        naming the state directory) that is still alive."""
        self._note_sandboxes()
        seen = set(self.started) | self.sandbox_processes | set(self._strays())
        return sorted((i for i in seen if i.alive()), key=lambda i: i.pid)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the server and kill what it left: its sandboxes, then any
        process that names the state directory; remove the gateway's socket
        directory. The state directory stays (the caller made it)."""
        self.stop(timeout)
        self.crash_sandboxes()
        _kill_and_wait(self._strays(), 10.0)
        sock_dir = gateway_socket_dir(self.state_dir)
        if os.path.isdir(sock_dir):
            shutil.rmtree(sock_dir, ignore_errors=True)


class ScriptedModel:
    """``stasis model``: the scripted model (the one serve embeds) as a
    server of its own, solving the built-in tasks, slowed by ``token_delay``
    per generated token so that a checkpoint can fall mid-episode (as
    ``stasis run`` does). Like a trainer's inference server it outlives the
    environment server's preemptions: give its ``url`` to serve's
    ``--model-upstream``."""

    def __init__(self, *, binary: Optional[str] = None, token_delay: str = "2ms", tasks: str = "builtin", args: Sequence[str] = (), log_path: Optional[str] = None, start_timeout: float = 60.0):
        self.binary = find_binary(binary)
        self.cmd = [self.binary, "model", "--listen", "127.0.0.1:0", "--tasks", tasks, "--token-delay", token_delay, *args]
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.identity: Optional[ProcessIdentity] = None
        self.url: Optional[str] = None

    def __enter__(self) -> "ScriptedModel":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> str:
        """Start it and wait until it answers /healthz; returns its URL."""
        out = tempfile.TemporaryFile()
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=log, close_fds=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self.identity = identity_of(self.proc.pid)
        deadline = time.monotonic() + self.start_timeout
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def serving():
            if self.url is None:
                out.seek(0)
                first = out.read()
                if b"\n" not in first:
                    return None
                self.url = "http://" + first.split(b"\n", 1)[0].decode().strip()
            try:
                with opener.open(self.url + "/healthz", timeout=5) as r:
                    return self.url if r.status == 200 else None
            except OSError:
                return None

        try:
            return _poll(self.proc, deadline, "stasis model did not serve", serving)
        except BaseException:
            self.close()
            raise
        finally:
            out.close()

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM, SIGKILL after timeout."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _ancestors() -> set[int]:
    """This process and its ancestors: never strays."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                b = f.read()
            pid = int(b[b.rfind(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _kill_and_wait(ids: Iterable[ProcessIdentity], timeout: float) -> None:
    ids = list(ids)
    deadline = time.monotonic() + timeout
    while True:
        alive = [i for i in ids if i.alive()]
        for i in alive:
            try:
                os.kill(i.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return
        time.sleep(0.01)  # poll interval, bounded by the deadline


def _remove_cgroups(sandbox_dir: str, timeout: float) -> None:
    try:
        with open(os.path.join(sandbox_dir, "meta.json")) as f:
            dirs = (json.load(f).get("cgroups") or {}).get("dirs") or []
    except (OSError, ValueError, AttributeError):
        return
    deadline = time.monotonic() + timeout
    for d in dirs:
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    break
                time.sleep(0.02)  # poll interval, bounded by the deadline
