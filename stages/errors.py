"""Errors a user can act on. The CLI prints ``error: <message>`` on one line and exits non-zero."""


class BdsgdError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""


class ConfigError(BdsgdError):
    """A stage config field holds a value the stage cannot run with."""


class TraceError(BdsgdError):
    """A trace file or trace store is missing, malformed or not schema v1."""


class CheckpointError(BdsgdError):
    """A checkpoint file is missing, corrupt, of an unknown version or for another cluster."""


class WorkerError(BdsgdError):
    """A worker process died, timed out or could not be reached."""


def first_line(exc: BaseException) -> str:
    """The first informative line of an exception's message (torch's state-dict errors put a
    heading first and the reason on the next line)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else type(exc).__name__
