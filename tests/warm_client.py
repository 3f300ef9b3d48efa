"""Stands where `python -m scaletrain ARGS` stands (alone, or as a rank under torchrun) and has the warm
test server (tests/warm.py) fork that process: it sends its argv, environment, working directory and
stdin/stdout/stderr, passes on the signals it receives, and exits as the fork did. The signals it was
started ignoring, the fork ignores until it sets a handler (a fresh process would inherit that).

Imports only the standard library and tests/warm.py's constants (that module imports nothing else at
its top; this script's directory, tests/, is first on sys.path), so it starts in milliseconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from warm import HEADER, SOCKET_VARIABLE

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)


def main() -> None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(os.environ[SOCKET_VARIABLE])
    ignored = [int(signum) for signum in FORWARDED if signal.getsignal(signum) == signal.SIG_IGN]
    request = json.dumps({"args": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
                          "ignored": ignored}).encode()
    socket.send_fds(connection, [HEADER.pack(len(request))], [0, 1, 2])
    connection.sendall(request)
    replies = connection.makefile("r")
    pid = json.loads(replies.readline())["pid"]
    for signum in FORWARDED:
        signal.signal(signum, lambda received, _frame: os.kill(pid, received))
    line = ""
    while not line:
        try:
            line = replies.readline()
        except InterruptedError:
            continue
        if not line:
            sys.exit(f"warm test server ended before process {pid} did")
    ended = json.loads(line)
    # As a rank that has its exit code does (train/stopping.py ignore_while_exiting): torchrun sends SIGTERM to
    # the ranks still running once one has exited, and Python puts a handler set in Python back to the default
    # as the interpreter ends, so a SIGTERM then killed this client after its fork had exited 75.
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_IGN)
    if "signal" in ended:
        if ended["signal"] not in (signal.SIGKILL, signal.SIGSTOP):  # these two take no handler to undo
            signal.signal(ended["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), ended["signal"])
    sys.exit(ended["exit"])


if __name__ == "__main__":
    main()
