"""The warm test server (tests/warm.py) says which fork stands for a client, while the fork runs: what a
test that SIGKILLs a rank uses to kill the rank itself (tests/hosts.py Hosts.kill)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.runs import REPO, WARM_CLIENT, scaletrain_environment
from tests.warm import HEADER, SCRIPT, SOCKET_VARIABLE, WARM_SERVER, fork_of, wait_until_listening


def test_fork_of_names_a_clients_running_fork_and_forgets_it_when_it_ends(tmp_path: Path):
    script = tmp_path / "wait.py"
    script.write_text("import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    client = subprocess.Popen([sys.executable, str(WARM_CLIENT), SCRIPT, str(script)], cwd=REPO,
                              env=scaletrain_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        printed = int(client.stdout.readline())  # the fork's own pid, as the script sees it
        assert fork_of(client.pid) == printed != client.pid
        os.kill(printed, signal.SIGKILL)
        assert client.wait(timeout=30) == -signal.SIGKILL, client.stderr.read()  # the client ends as its fork did
        deadline = time.monotonic() + 30
        while fork_of(client.pid) is not None:
            assert time.monotonic() < deadline, "the server still names the fork after it ended"
            time.sleep(0.05)
    finally:
        client.kill()
        client.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroup scheduling in this kernel")
def test_a_server_started_niced_nices_its_sessions_autogroup(tmp_path: Path):
    """`make test` runs its parallel phase at nice 19 beside the serial tests (tests/run_suite.py); a warm server
    is a session of its own (start_new_session), whose autogroup starts at nice 0 and would outrank them."""
    niceness = min(os.nice(0) + 7, 19)  # under run_suite.py's parallel phase this process is at 19 already
    server = subprocess.Popen(["nice", "-n", "7", sys.executable, str(WARM_SERVER), str(tmp_path / "server.sock")],
                              cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while (autogroup := Path(f"/proc/{server.pid}/autogroup").read_text().split())[-1] != str(niceness):
            assert server.poll() is None and time.monotonic() < deadline, f"autogroup stays {' '.join(autogroup)}"
            time.sleep(0.02)
        assert os.getsid(server.pid) == server.pid  # a session, and so an autogroup, of its own
    finally:
        server.kill()
        server.wait(timeout=30)


def test_a_client_gone_mid_request_leaves_the_server_serving(tmp_path: Path):
    """A kill campaign's SIGKILL can end a client between its request and the server's reply. The server died of
    the broken pipe (BrokenPipeError in _fork_for, in a fresh-clone run of 2026-11-29), and every later test of
    that pytest worker found no server ("Connection refused"). Here a client leaves before its request is whole
    and another before the reply (both close before the server reads them); then a third is served."""
    socket_path = tmp_path / "server.sock"
    server = subprocess.Popen([sys.executable, str(WARM_SERVER), str(socket_path)], cwd=REPO,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until_listening(server, socket_path, timeout=120), "the server did not start"
        sleeper, printer = tmp_path / "sleep.py", tmp_path / "print.py"
        sleeper.write_text("import time\ntime.sleep(60)\n")
        printer.write_text("print('served')\n")
        request = json.dumps({"args": [SCRIPT, str(sleeper)], "env": {}, "cwd": str(tmp_path),
                              "ignored": []}).encode()
        with open(os.devnull, "r+b") as null:
            for sent in (request[:10], request):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
                    gone.connect(str(socket_path))
                    socket.send_fds(gone, [HEADER.pack(len(request))], [null.fileno()] * 3)
                    gone.sendall(sent)
        served = subprocess.run([sys.executable, str(WARM_CLIENT), SCRIPT, str(printer)], cwd=tmp_path,
                                env={**scaletrain_environment(), SOCKET_VARIABLE: str(socket_path)},
                                capture_output=True, text=True, timeout=60)
        assert (served.returncode, served.stdout) == (0, "served\n"), served.stderr
        assert server.poll() is None
    finally:
        server.kill()
        server.wait(timeout=30)
