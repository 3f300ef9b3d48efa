"""`make test` (`python -m tests.run_suite`): the suite in two phases at once; exits 1 when either fails.

- The parallel phase, at nice 19: every test not marked serial, in three pytest-xdist workers, each test file
  whole on one worker (its module fixtures train once). Three workers on two cores: much of a test's time is
  waiting (processes starting, ranks meeting, files written), which the third fills: 18.2 and 19.0 min against
  19.7 and 19.8 with two on fresh clones (2026-11-29).
- The serial phase, at normal priority beside it: the real SLURM clusters, multi-host jobs and short timeouts
  (marked serial), one at a time, which another test's load would stretch. Run last and alone they took 5.5 min
  of a 27.7-minute CI run (2026-11-29), using about one core of two: much of it they wait for daemons, ranks and
  timeouts. Beside the niced phase they keep the CPU they need and it takes the rest: a CI run with the phases
  at once took 22.8 min, the serial tests 6.7 of them inside the niced phase's 20.5 (2026-11-29). Their output
  goes to .pytest-serial.log and is printed when both phases have ended.

nice alone does not order the two on Linux with autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled,
the default of most distributions' kernels): the CPU is shared between sessions first and nice counts only
inside one. So the niced phase is a session of its own with its autogroup niced too, and tests/warm.py's
servers, sessions of their own, nice theirs as they are niced.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.warm import keep_niceness_in_new_session

REPO = Path(__file__).resolve().parents[1]
SERIAL_LOG = REPO / ".pytest-serial.log"
NICENESS = 19


def _nice_this_session() -> None:
    """In the parallel phase's process, after start_new_session's setsid: itself niced, then its autogroup."""
    os.nice(NICENESS)
    keep_niceness_in_new_session()


def main(pytest_args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "tests", *pytest_args]
    parallel = subprocess.Popen([*pytest, "-n", "3", "--dist", "loadfile", "-m", "not serial"], cwd=REPO,
                                start_new_session=True, preexec_fn=_nice_this_session)
    print(f"the serial tests run beside these; their output: {SERIAL_LOG.name}, printed at the end", flush=True)
    with SERIAL_LOG.open("w") as log:
        serial = subprocess.Popen([*pytest, "-m", "serial"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        codes = [parallel.wait(), serial.wait()]
    except KeyboardInterrupt:  # the terminal's SIGINT reached the serial phase, not the other session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parallel.pid, signal.SIGINT)
        parallel.wait()
        serial.wait()
        return 130
    sys.stdout.write(SERIAL_LOG.read_text())
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
