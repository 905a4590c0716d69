"""Commands a test starts each in a session (a process group) of its own, so that the test can end
every process the command started, the ones it left behind included: run one or several at once
with a timeout, or start one, do what the test needs while it runs, and finish or kill it. Every
wait is bounded."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence

import pytest

REAP_S = 10.0
"""How long a process whose session was sent SIGKILL may take to be reaped."""
TAIL = 3000
"""How much of each output (characters, its end) a timeout's message shows."""


def start_in_session(cmd: Sequence, **popen) -> subprocess.Popen:
    """``cmd`` started in a new session; stdout and stderr are piped and text unless ``popen``
    says otherwise (``stderr=subprocess.STDOUT`` merges them)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(cmd, start_new_session=True, **popen)


def kill_session(*procs: subprocess.Popen, wait_s: float = REAP_S) -> None:
    """SIGKILL the session of each of ``procs`` (one already gone is fine), then reap each,
    waiting at most ``wait_s`` for each."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # in a finally: keep the real error
            proc.wait(wait_s)


def finish_sessions(*procs: subprocess.Popen, timeout: float) -> list[subprocess.CompletedProcess]:
    """Wait for all of ``procs`` at once, at most ``timeout`` seconds, collecting each one's
    output (until every process of its session holding its pipes closed them); then kill their
    sessions, whatever they left running. The outputs are read together, each by a thread of
    its own, so that no process can block on a full pipe while an earlier one is read (ranks
    that wait on each other would then stall together). A process still running after
    ``timeout`` fails the test with the end of its output."""
    outputs: list[tuple | None] = [None] * len(procs)
    errors: list[BaseException] = []

    def read(i: int, proc: subprocess.Popen) -> None:
        try:
            outputs[i] = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass  # (None: still running)
        except BaseException as exc:  # e.g. output that is not UTF-8: raised below, as itself
            errors.append(exc)

    try:
        readers = [threading.Thread(target=read, args=(i, proc), daemon=True)
                   for i, proc in enumerate(procs)]  # fmt: skip
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout + REAP_S)
        if errors:
            raise errors[0]
        if any(output is None for output in outputs):
            kill_session(*procs)
            for reader in readers:
                reader.join(REAP_S)
            pytest.fail(_report_timeout(procs, outputs, timeout))
        return [subprocess.CompletedProcess(proc.args, proc.returncode, *output)
                for proc, output in zip(procs, outputs, strict=True)]  # fmt: skip
    finally:
        kill_session(*procs)


def _report_timeout(procs, outputs, timeout: float) -> str:
    """Every process's state and the end of its output, the finished ones' too (a node that
    failed is often why another still waits)."""
    parts = []
    for i, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        state = "still running" if output is None else f"exited {proc.returncode}"
        out, err = _output_of_killed(proc) if output is None else output
        parts.append(f"--- [{i}] {state} after {timeout} s: {shlex.join(map(str, proc.args))}\n"
                     f"--- end of its stdout:\n{_tail(out)}\n--- end of its stderr:\n{_tail(err)}")  # fmt: skip
    return "\n".join(parts)


def run_in_sessions(
    cmds: Sequence[Sequence],
    *,
    timeout: float,
    envs: Sequence[Mapping[str, str]] | None = None,
    **popen,
) -> list[subprocess.CompletedProcess]:
    """Start every one of ``cmds`` at once, each in a session of its own (with ``envs[i]`` as
    its environment where given, and ``popen``), and finish them (:func:`finish_sessions`)."""
    procs: list[subprocess.Popen] = []
    try:
        for i, cmd in enumerate(cmds):
            env = {} if envs is None else {"env": envs[i]}
            procs.append(start_in_session(cmd, **popen, **env))
        return finish_sessions(*procs, timeout=timeout)
    finally:  # also when a start failed half-way
        kill_session(*procs)


def run_in_session(cmd: Sequence, *, timeout: float, **popen) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own, at most ``timeout`` seconds, and kill the session
    afterwards; its returncode, stdout and stderr (None where merged into stdout)."""
    return run_in_sessions([cmd], timeout=timeout, **popen)[0]


def stderr_of(proc: subprocess.Popen) -> str:
    """For a failing assertion's message: the end of ``proc``'s stderr, its session killed
    first if it still runs (reading a running process's pipe would wait for it to end)."""
    kill_session(proc)
    return _tail(_output_of_killed(proc)[1])


def _output_of_killed(proc: subprocess.Popen) -> tuple[str | None, str | None]:
    try:
        return proc.communicate(timeout=REAP_S)
    except subprocess.TimeoutExpired as e:  # a pipe held open by a process outside the session
        return _text(e.output), _text(e.stderr)


def _text(data: bytes | str | None) -> str | None:
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _tail(text: str | None) -> str:
    return "(not captured)" if text is None else text[-TAIL:]
