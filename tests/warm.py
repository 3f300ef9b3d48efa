"""Warm processes for the tests: forks of a process that has already imported torch, DeepSpeed and
megatron-core, instead of fresh interpreters that import them again.

A fresh `scaletrain train` spends about 5 s of CPU importing those (megatron.core alone pulls in
torch._inductor and wandb), and a two-rank run under torchrun about 15 s of its 21, while the tiny
runs the tests train take a second: start-up was most of the suite's time. Two warm servers fix it:

- `fork_server()`: multiprocessing's fork server with PRELOADED imported; tests/distributed/harness.py
  forks its ranks from it.
- `WarmServer` (run as `python tests/warm_server.py SOCKET`): forks one `scaletrain` process per
  request from tests/warm_client.py, which stands where `python -m scaletrain` stood: under torchrun
  (each rank a client), or alone. The fork takes the client's argv, environment, working directory
  and stdin/stdout/stderr; the client passes signals on to it and exits as it did (code or signal), so
  torchrun's rendezvous, error files and exit codes are real. The fork ends when its client ends.
  A client whose first argument is TORCHRUN stands for `python -m torch.distributed.run ARGS` instead
  (importing torch for torchrun took 1.5 s of each multi-rank run), SCALETRAIN_TORCHRUN for
  `python -m scaletrain.torchrun ARGS`; their ranks are clients in turn. One whose first argument is
  SCRIPT stands for `python SCRIPT ARGS` (the benchmarks, tests/test_benchmarks.py).
- A fork enters its client's network, UTS and mount namespaces when they differ from the server's, so a
  client started as a namespace host (tests/hosts.py) gets a fork that is that host: its addresses,
  hostname and /etc/hosts. `warm_bin()` is a directory of `python`, `scaletrain` and
  `scaletrain-torchrun` that go to the server: first on a job's PATH (torchrun.sh, slurm.sbatch), it
  makes every process of a multi-host run a warm fork. A signal the client ignored when it started
  (slurm.sbatch's ranks ignore USR1 until scaletrain handles it) is ignored by the fork too until the
  program sets a handler.
  In a fork, sys.executable is tests/warm_python, so the `python -m scaletrain` processes that a
  command starts itself (a sweep's runs, locally or as SLURM array tasks) are warm forks too.

A fork cannot show what happens while a process imports (which modules a command loads, the notices
printed on import) nor a launcher's own process tree (pkill by command line, a rank's parent), so
tests of those use fresh processes: `launcher(nproc, fresh=True)` in tests/train/runs.py.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import multiprocessing
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# transformers.modeling_utils: `transformers` alone is a lazy module, and every fork that exports, imports or
# compares with a transformers model (a model class's first use) imported modeling_utils and the scipy.optimize
# it pulls in again, 2-4 s of CPU each (most of a `scaletrain export`); the fits of `sweep run` use scipy too.
PRELOADED = ("torch", "torch.distributed.run", "megatron.core", "deepspeed", "transformers",
             "transformers.modeling_utils", "scaletrain.cli", "scaletrain.torchrun", "scaletrain.train.loop",
             "tests.warm", "tests.distributed.harness")
SOCKET_VARIABLE = "SCALETRAIN_TEST_WARM_SOCKET"  # where tests/warm_client.py finds the server
PYTHON_VARIABLE = "SCALETRAIN_TEST_PYTHON"  # the interpreter behind tests/warm_python
TORCHRUN = "--torchrun"  # a client's first argument when it stands for `python -m torch.distributed.run`
SCALETRAIN_TORCHRUN = "--scaletrain-torchrun"  # ... for `python -m scaletrain.torchrun`
SCRIPT = "--script"  # ... for `python SCRIPT ARGS` (tests/warm_script.py)
# a client's first argument -> (argv[0], the module whose main() runs); any other: scaletrain.cli
PROGRAMS = {TORCHRUN: ("torchrun", "torch.distributed.run"),
            SCALETRAIN_TORCHRUN: ("scaletrain-torchrun", "scaletrain.torchrun"),
            SCRIPT: ("python", "tests.warm_script")}
NAMESPACES = (("uts", 0x04000000), ("net", 0x40000000), ("mnt", 0x00020000))  # CLONE_NEWUTS, NEWNET, NEWNS
WARM_PYTHON = Path(__file__).resolve().parent / "warm_python"
WARM_SERVER = Path(__file__).resolve().parent / "warm_server.py"  # main() below, started by path
HEADER = struct.Struct("!I")  # the length of the JSON request that follows it
CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED's struct ucred: pid, uid, gid


def fork_server() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's fork server context; the server starts (and imports PRELOADED) on first use.

    It keeps the environment of the moment it started: a child sets what it needs itself."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


_server: subprocess.Popen | None = None
_socket_path: Path | None = None
_starting = threading.Lock()  # runs start from two threads at once (test_layouts.py's TrainedAhead)


def wait_until_listening(server: subprocess.Popen, socket_path: Path, timeout: float) -> bool:
    """Whether `server` made its socket within `timeout` seconds (False at once if it ended first)."""
    deadline = time.monotonic() + timeout
    while not socket_path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def warm_socket() -> Path:
    """The socket of this test session's WarmServer, started on first use and stopped at exit."""
    global _server, _socket_path
    with _starting:
        if _server is None or _server.poll() is not None:
            directory = Path(tempfile.mkdtemp(prefix="scaletrain-warm-"))
            _socket_path = directory / "server.sock"
            log = (directory / "server.log").open("w")
            repo = Path(__file__).resolve().parents[1]
            # SIGINT at its default, as in a terminal: a shell's background job (CI as `nohup bash .ci/run &`)
            # starts ignoring it, and the forks would keep that (a client's own ignored signals still reach them)
            _server = subprocess.Popen([sys.executable, str(WARM_SERVER), str(_socket_path)], cwd=repo,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=default_sigint)
            if not wait_until_listening(_server, _socket_path, timeout=300):
                raise RuntimeError(f"the warm test server did not start: {(directory / 'server.log').read_text()}")
            atexit.register(_stop_server, _server)
        return _socket_path


def warm_bin() -> Path:
    """A directory of `python`, `python3`, `scaletrain` and `scaletrain-torchrun` that start warm forks
    (through tests/warm_python, which runs anything else on the interpreter); put it first on the PATH
    of a launcher script, with `warm_environment()`."""
    directory = warm_socket().parent / "bin"
    if not directory.is_dir():
        staging = directory.with_suffix(".tmp")
        staging.mkdir()
        for name, prefix in (("python", ""), ("python3", ""), ("scaletrain", "-m scaletrain "),
                             ("scaletrain-torchrun", "-m scaletrain.torchrun ")):
            script = staging / name
            script.write_text(f'#!/bin/sh\nexec "{WARM_PYTHON}" {prefix}"$@"\n')
            script.chmod(0o755)
        staging.rename(directory)
    return directory


def warm_environment(environment: dict[str, str]) -> dict[str, str]:
    """`environment` with warm_bin() first on PATH and what tests/warm_python needs to reach the server."""
    return {**environment, "PATH": f"{warm_bin()}{os.pathsep}{environment.get('PATH', '')}",
            SOCKET_VARIABLE: str(warm_socket()), PYTHON_VARIABLE: sys.executable}


def default_sigint() -> None:
    """SIGINT at its default action, for a child's preexec_fn: a shell's background job starts ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def fork_of(client_pid: int) -> int | None:
    """The pid of the process this session's server forked for the client `client_pid`, while it runs. A
    client's fork ends when a thread of it sees the client's connection close, so a test that SIGKILLs a
    client (a rank, say) and needs the process itself gone at once kills this one too."""
    if _socket_path is None:
        return None
    with contextlib.suppress(FileNotFoundError, ValueError):
        return int((_forks_directory(_socket_path) / str(client_pid)).read_text())
    return None


def process_tree(pid: int, follow_forks: bool = False) -> list[int]:
    """pid and its descendants, from /proc; with `follow_forks`, also the fork each warm client among them
    stands for (fork_of) and that fork's descendants, which are no descendants of the client."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        tree.append(current)
        frontier.extend(children.get(current, []))
        fork = fork_of(current) if follow_forks else None
        if fork is not None:
            frontier.append(fork)
    return tree


def _forks_directory(socket_path: Path) -> Path:
    return socket_path.parent / "forks"


def _stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=30)


class WarmServer:
    """Accepts client requests on a Unix socket and forks a `scaletrain` process for each; tells each
    client its fork's pid, then how the fork ended. It never runs a torch op or starts a Python thread,
    so no OpenMP, gloo or DataLoader thread would be missing in a fork."""

    def __init__(self, socket_path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(socket_path) + ".tmp")
        self.listener.listen(64)
        self.wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of exits
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        self.clients: dict[int, socket.socket] = {}
        self.forks = _forks_directory(socket_path)  # client pid -> its fork's pid, for fork_of()
        self.forks.mkdir()
        self.fork_clients: dict[int, int] = {}
        os.rename(str(socket_path) + ".tmp", socket_path)  # clients see the socket once it listens

    def serve(self) -> None:
        while True:
            readable, _, _ = select.select([self.listener, self.wakeup_read], [], [])
            if self.wakeup_read in readable:
                os.read(self.wakeup_read, 4096)
                self._report_exits()
            if self.listener in readable:
                self._fork_for(self.listener.accept()[0])

    def _fork_for(self, connection: socket.socket) -> None:
        """A client killed while it connects (a kill campaign's SIGKILL, say) is no error of the server's: one
        gone before its request is whole gets no fork, one gone after it a fork that ends itself
        (_end_with_client); the server, which every later test needs, serves on either way."""
        fds: list[int] = []
        try:
            header, fds, _, _ = socket.recv_fds(connection, HEADER.size, 3)
            request = json.loads(_receive_exactly(connection, HEADER.unpack(header)[0]))
        except (OSError, struct.error, ValueError):  # a short header, a cut request, a reset connection
            for fd in fds:
                os.close(fd)
            connection.close()
            return
        client_pid = CREDENTIALS.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              CREDENTIALS.size))[0]
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for other in self.clients.values():
                other.close()
            _become_scaletrain(request, fds, connection, client_pid)  # never returns
        for fd in fds:
            os.close(fd)
        self.clients[pid] = connection
        self.fork_clients[pid] = client_pid
        (self.forks / str(client_pid)).write_text(str(pid))
        with contextlib.suppress(OSError):  # the client is gone: its fork sees the connection closed and ends
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")

    def _report_exits(self) -> None:
        while self.clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            connection = self.clients.pop(pid, None)
            with contextlib.suppress(KeyError, FileNotFoundError):
                (self.forks / str(self.fork_clients.pop(pid))).unlink()
            if connection is not None:
                ended = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                         else {"exit": os.waitstatus_to_exitcode(status)})
                with contextlib.suppress(OSError):  # the client is gone
                    connection.sendall(json.dumps(ended).encode() + b"\n")
                connection.close()


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client closed the connection mid-request")
        data += chunk
    return data


def _become_scaletrain(request: dict, fds: list[int], connection: socket.socket, client_pid: int) -> None:
    """In the fork: the process `python -m scaletrain *args` (or torchrun's) would have been, then run it;
    exit with its code."""
    code = 1
    try:
        _enter_namespaces_of(client_pid)  # while this process has one thread, as setns needs for mnt
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        for signum in request.get("ignored", []):
            signal.signal(signum, signal.SIG_IGN)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _end_with_client(connection)
        _leave_server_resources()
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[PYTHON_VARIABLE] = sys.executable
        sys.executable = str(WARM_PYTHON)
        os.chdir(request["cwd"])
        program, module = PROGRAMS.get(request["args"][0] if request["args"] else "", ("scaletrain", "scaletrain.cli"))
        args = request["args"][1:] if module != "scaletrain.cli" else request["args"]
        sys.argv = [program, *args]
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the fork's own stdin, kept open to exit)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        import torch

        # OpenMP read OMP_NUM_THREADS when the server imported torch, under the server's environment.
        torch.set_num_threads(int(request["env"].get("OMP_NUM_THREADS", os.cpu_count() or 1)))
        main = importlib.import_module(module).main
        try:
            code = main(args) or 0
        except SystemExit as exit_request:
            code = exit_request.code if isinstance(exit_request.code, int) else (0 if exit_request.code is None else 1)
            if isinstance(exit_request.code, str):
                print(exit_request.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting either way
                stream.flush()
        os._exit(code)


def _enter_namespaces_of(pid: int) -> None:
    """Join the network, UTS (hostname) and mount namespaces of process `pid` where they are not ours."""
    joined = []
    for kind, flag in NAMESPACES:
        theirs, ours = f"/proc/{pid}/ns/{kind}", f"/proc/self/ns/{kind}"
        if os.stat(theirs).st_ino != os.stat(ours).st_ino:
            joined.append((os.open(theirs, os.O_RDONLY), flag))
    for fd, flag in joined:
        _setns(fd, flag)
        os.close(fd)


def _setns(fd: int, flag: int) -> None:
    """os.setns (Python >= 3.12), else libc's."""
    if hasattr(os, "setns"):
        os.setns(fd, flag)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, flag) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


def _leave_server_resources() -> None:
    """A fork runs the exit handlers the server registered as it imported, as a fresh process would
    (multiprocessing's ends the DataLoader workers at once; without it each lingered 5 s until its
    parent watchdog fired), except those that delete what the server owns for every fork: the media
    directory wandb makes at import (an atexit cleanup and the TemporaryDirectory's finalizer)."""
    media = sys.modules.get("wandb.sdk.data_types._private")
    if media is not None:
        atexit.unregister(media.MEDIA_TMP.cleanup)
        media.MEDIA_TMP._finalizer.detach()


def _end_with_client(connection: socket.socket) -> None:
    """The fork is killed when its client ends (killed with SIGKILL, say): the client holds the other end
    of the connection, so a thread that reads it sees end-of-file then."""

    def watch() -> None:
        while connection.recv(1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="warm-client-watch").start()


def keep_niceness_in_new_session() -> None:
    """Give this process's autogroup the niceness the process runs at. With Linux's autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) the CPU is shared between sessions first and nice counts only
    inside one, and a new session starts at nice 0: the server, a session of its own, would otherwise take as
    much CPU for the tests of `make test`'s niced phase as for those of its serial phase, which the niceness is
    there to put first (tests/run_suite.py, which calls this for that phase too). Where there is no
    autogroup this is nice alone."""
    niceness = os.nice(0)
    if niceness > 0:
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text(f"{niceness}\n")


def main(socket_path: str) -> None:
    keep_niceness_in_new_session()
    for name in PRELOADED:
        importlib.import_module(name)
    # The imports start no Python thread, and native ones only in the OpenBLAS builds of numpy and scipy
    # (one pool thread each on 2 cores; OpenBLAS shuts its pool down at fork and restarts it on use), and
    # torch's pools are re-made in a fork by its at-fork handlers: forks see the same as multiprocessing's
    # fork server.
    threads = len(os.listdir("/proc/self/task"))
    print(f"warm server: {len(PRELOADED)} modules imported, {threads} native thread(s)", flush=True)
    WarmServer(Path(socket_path)).serve()

