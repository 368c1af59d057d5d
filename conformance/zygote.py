"""Backend workers forked from one process that has loaded the backend: a fork server.

A fresh worker imports its backend's libraries before its first answer (torch, Triton and the
adapter: seconds), paid by each of a ``-j`` run's workers and by every worker that replaces
one a fault ended. A *zygote* imports the backend's module once, touching no device, and
forks each worker from there; the worker makes its own CUDA context, as a spawned one does.

It is an optimisation, never a requirement: it forks only while that is safe (one thread, no
CUDA driver initialised, the requester's environment the one it started with but for the
GPU), after as much of the backend's preload as left it so (``conformance.preload``), and a
request it refuses or does not answer in time is spawned as before. A forked
worker is the zygote's child: its owner reaches it through a pidfd and its process group,
and the zygote reports its exit status on a channel of the owner's and reaps it only when
the owner closes that channel, so its group id cannot be reused while the owner may signal
it (docs/isolation.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from conformance.parallel import spawned_with
from conformance.preload import Loaded, end_with_parent, load_deepest, unsafe

ZYGOTES_VARIABLE = "CONFORMANCE_ZYGOTES"  # {target: socket path}, for every process of a run
SWITCH_VARIABLE = "CONFORMANCE_FORK"  # "0": every worker spawned, as before zygotes
GPU_VARIABLE = "CUDA_VISIBLE_DEVICES"  # read when CUDA initialises: after the fork
REPLY_WAIT = 120.0  # seconds a requester waits for a fork (the zygote's import included)
_STATUS = struct.Struct("q")
_refused: dict[str, str] = {}  # a zygote's socket -> why it cannot serve this process


# - the owner's side -

class ForkedProcess:
    """A worker forked by a zygote, seen as ``subprocess.Popen`` sees a child: ``pid``,
    ``stdout``, ``returncode``, ``wait``; and ``exited`` without reaping it."""

    def __init__(self, pid: int, stdout: int, status: socket.socket):
        self.pid = pid
        self.stdout = os.fdopen(stdout, "rb", buffering=0)
        self.status = status
        self.returncode: int | None = None
        self.lost = False  # the zygote ended first: the exit status is unknown

    def exited(self) -> bool:
        """Whether the worker has ended (the zygote said so), looked at without reaping it."""
        return self._read_status(0.0)

    def wait(self) -> int | None:
        """Its exit status, once it has ended; then the zygote may reap it."""
        while not self._read_status(0.05):
            pass
        with contextlib.suppress(OSError):
            self.status.close()
        return self.returncode

    def _read_status(self, wait: float) -> bool:
        if self.returncode is not None or self.lost:
            return True
        if self.status.fileno() < 0 or not select.select([self.status], [], [], wait)[0]:
            return False
        data = self.status.recv(_STATUS.size)
        if len(data) == _STATUS.size:
            self.returncode = _STATUS.unpack(data)[0]
            return True
        # the zygote is gone: it no longer reports; the worker's end is read from /proc
        if has_ended(self.pid):
            self.lost = True
            return True
        time.sleep(wait)
        return False


def has_ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie, without reaping it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def forked_worker(target: str, channel: socket.socket, env: dict[str, str],
                  deadline: float | None = None) -> ForkedProcess | None:
    """A worker serving ``channel``, forked by ``target``'s zygote; None where there is no
    zygote for it, or it refused or did not answer by ``deadline`` (the caller spawns one,
    and so does every later call in this process)."""
    path = _address(target)
    if not path or path in _refused:
        return None
    wait = REPLY_WAIT if deadline is None else min(REPLY_WAIT, deadline - time.monotonic())
    out_read, out_write = os.pipe()
    mine, theirs = socket.socketpair()
    try:
        reply = _ask(path, env, [channel.fileno(), out_write, theirs.fileno()], wait)
    finally:
        os.close(out_write)
        theirs.close()
    if "pid" not in reply:
        _refused[path] = str(reply.get("refused"))
        os.close(out_read)
        mine.close()
        return None
    return ForkedProcess(int(reply["pid"]), out_read, mine)


def fork_note(target: str) -> str | None:
    """What a run says of how ``target``'s workers were started, where not as it should be:
    spawned after all (why: in this process, or, asked of the zygote, in any process of the
    run), or forked after only part of the backend's preload; None where all is well."""
    state = _state(target)
    if state.get("refused"):
        return ("its workers were spawned, not forked from one that loaded it once: "
                f"{state['refused']}")
    if state.get("partial"):
        return f"its workers were forked after part of its preload: {state['partial']}"
    return None


def _state(target: str) -> dict:
    path = _address(target)
    if path in _refused or not path:
        return {"refused": _refused.get(path, "no zygote serves this run")}
    return _ask(path, {"state": True}, [], 5.0)


def _ask(path: str, message: dict, fds: list[int], wait: float) -> dict:
    """The zygote's reply to ``message`` (with ``fds``): {"pid": ...} or {"refused": why}."""
    request = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        request.settimeout(max(0.001, wait))
        request.connect(path)
        socket.send_fds(request, [json.dumps(message).encode()], fds)
        request.shutdown(socket.SHUT_WR)  # the whole request is sent
        return json.loads(_read_all(request) or b'{"refused": "no reply"}')
    except (OSError, ValueError) as exc:
        return {"refused": f"the zygote could not be reached: {exc}"}
    finally:
        request.close()


def _address(target: str) -> str | None:
    """The socket of ``target``'s zygote in this run, if one serves it."""
    return json.loads(os.environ.get(ZYGOTES_VARIABLE) or "{}").get(target)


def _read_all(sock: socket.socket) -> bytes:
    return b"".join(iter(lambda: sock.recv(4096), b""))


# - the harness's side: a run's zygotes -

@contextlib.contextmanager
def zygotes(targets: list[str], env: dict[str, str] | None = None) -> Iterator[None]:
    """A zygote loading each of ``targets`` from now until the block ends, announced to this
    process and every process it starts after (``CONFORMANCE_ZYGOTES``); ``env``: what the
    workers' owners add to the environment (a ``-j`` pool's variables), set in this process
    too for the block, so that every request comes with the environment the zygote has."""
    folder = tempfile.mkdtemp(prefix="conformance-zygotes-")  # 0700: only this user connects
    started: list[subprocess.Popen] = []
    addresses = {}
    with spawned_with({**(env or {}), ZYGOTES_VARIABLE: ""}), _ended(started, folder):
        for index, target in enumerate(dict.fromkeys(targets)):
            path = str(Path(folder) / f"{index}.sock")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(path)  # bound here: requests wait while the zygote starts
                listener.listen(256)
                started.append(subprocess.Popen(
                    [sys.executable, "-m", "conformance.zygote", target,
                     str(listener.fileno())],
                    env=worker_environment(), pass_fds=[listener.fileno()],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True))
            addresses[target] = path
        os.environ[ZYGOTES_VARIABLE] = json.dumps(addresses)
        yield


@contextlib.contextmanager
def _ended(started: list[subprocess.Popen], folder: str) -> Iterator[None]:
    """The zygotes killed and their sockets removed when the block ends, however it ends."""
    try:
        yield
    finally:
        for process in started:
            process.kill()
        for process in started:
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def worker_environment() -> dict[str, str]:
    """What a worker starts with: this environment, and this process's import path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


# - the zygote itself -

def worker_file() -> str:
    """The worker module's file: what a spawned worker's ``sys.argv[0]`` is."""
    return str(Path(__file__).with_name("worker.py"))


def _become_worker(channel: int, output: int, env: dict[str, str]) -> None:
    """In the forked child: a session of its own, its output to its owner's pipe, only its
    channel open, then the worker's loop; never back into the zygote's."""
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.closerange(3, channel)
        os.closerange(channel + 1, 1 << 16)
        sys.argv = [worker_file(), str(channel)]  # as a spawned worker's
        if env.get(GPU_VARIABLE) != os.environ.get(GPU_VARIABLE):
            if GPU_VARIABLE in env:
                os.environ[GPU_VARIABLE] = env[GPU_VARIABLE]
            else:
                del os.environ[GPU_VARIABLE]
        from conformance import worker

        worker.run(channel)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class _Server:
    """The zygote's loop: fork on request, report its children's ends, reap on release."""

    def __init__(self, loaded: Loaded, listener: int, start_env: dict[str, str]):
        self.start_env = start_env
        self.listener = socket.socket(fileno=listener)  # requests wait there while it loads
        self.refused, self.partial = loaded.refused, loaded.partial
        self.wake_read, self.wake_write = socket.socketpair()
        self.wake_read.setblocking(False)
        self.wake_write.setblocking(False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_write.fileno())
        self.children: dict[int, socket.socket | None] = {}  # pid -> status channel, or
        self.ended: set[int] = set()                          # None once released

    def serve(self) -> None:
        while True:
            channels = {s: pid for pid, s in self.children.items() if s is not None}
            ready = select.select([self.listener, self.wake_read, *channels], [], [])[0]
            for sock in ready:
                if sock is self.listener:
                    self._fork_for(self.listener.accept()[0])
                elif sock is self.wake_read:
                    with contextlib.suppress(OSError):
                        while self.wake_read.recv(4096):
                            pass
                elif not _received(sock):  # its owner let it go
                    sock.close()
                    self.children[channels[sock]] = None
            self._report()
            for pid in [p for p, s in self.children.items() if s is None and p in self.ended]:
                os.waitpid(pid, 0)  # ended and released: reaped now
                del self.children[pid]
                self.ended.discard(pid)

    def _fork_for(self, conn: socket.socket) -> None:
        fds: list[int] = []
        with conn:
            try:
                conn.settimeout(10.0)
                message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                message += _read_all(conn)  # the requester shuts its side after sending
                env = json.loads(message)
                if not fds and env == {"state": True}:  # asked whether it forks
                    conn.sendall(json.dumps({"refused": self.refused or unsafe(),
                                             "partial": self.partial}).encode())
                    return
                why = self.refused or _env_differs(env, self.start_env) or unsafe()
                if not why and len(fds) != 3:
                    why = "a request without its three descriptors"
                if why:
                    conn.sendall(json.dumps({"refused": why}).encode())
                    return
                channel, output, status = fds
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    self._forget()
                    conn.detach()
                    _become_worker(channel, output, env)
                self.children[pid] = socket.socket(fileno=os.dup(status))
                conn.sendall(json.dumps({"pid": pid}).encode())
            except (OSError, ValueError):  # a requester that went away, or sent nonsense
                pass
            finally:
                for fd in fds:
                    os.close(fd)

    def _forget(self) -> None:
        """In the child: the zygote's sockets let go of, not closed by their objects later
        (``_become_worker`` closes their descriptors, and the numbers are reused)."""
        for sock in (self.listener, self.wake_read, self.wake_write,
                     *(s for s in self.children.values() if s is not None)):
            sock.detach()

    def _report(self) -> None:
        """Each child's exit status to its owner once it has ended, not reaping it."""
        for pid, status in self.children.items():
            if pid in self.ended:
                continue
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is None:
                continue
            self.ended.add(pid)
            if status is not None:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                with contextlib.suppress(OSError):
                    status.sendall(_STATUS.pack(code))


def _received(sock: socket.socket) -> bytes:
    """What the owner wrote (nothing is expected); empty once it has closed its end."""
    try:
        return sock.recv(64)
    except OSError:
        return b""


def _env_differs(env: dict[str, str], start_env: dict[str, str]) -> str | None:
    """Which variable the requester has that the zygote did not start with (a library may
    have read it at import), but for the GPU it names."""
    keys = (set(env) | set(start_env)) - {GPU_VARIABLE, ZYGOTES_VARIABLE}
    changed = sorted(k for k in keys if env.get(k) != start_env.get(k))
    return f"the worker's environment differs in {changed[0]}" if changed else None


def main() -> None:
    start_env = dict(os.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_with_parent()
    target, listener = sys.argv[1:3]
    _Server(load_deepest(target), int(listener), start_env).serve()


if __name__ == "__main__":
    main()
