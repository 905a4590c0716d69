"""Loading and saving bdsgd's own files without ever running code from them.

Every checkpoint (the fitted model, the training server's state) is read with
``torch.load(path, weights_only=True)``: tensors and plain data only. A missing, truncated or
foreign file becomes one :class:`CheckpointError` line.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from bdsgd.stages.errors import CheckpointError, first_line


def load_plain(path: Path, what: str) -> dict:
    """The dict stored at ``path``; ``what`` names the file in error messages."""
    if not path.is_file():
        raise CheckpointError(f"no {what} at {path}")
    if not is_torch_file(path):
        raise CheckpointError(f"{path}: not a readable {what} (not a torch file)")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 (a text or CSV file read as pickle opcodes raises
        # KeyError, IndexError...: whatever it is, the file is not ours to read)
        reason = first_line(exc)
        if "Weights only load failed" in reason:
            reason = "it holds objects other than tensors and plain data"
        raise CheckpointError(f"{path}: not a readable {what} ({reason})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: not a bdsgd {what}")
    return payload


def is_torch_file(path: Path) -> bool:
    """Whether ``path`` starts as ``torch.save`` writes: a zip archive, or (before torch 1.6) a
    pickle, whose first byte is the PROTO opcode."""
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as fh:
        return fh.read(1) == b"\x80"


def save_atomic(payload: dict, path: Path, then: Callable[[], None] | None = None) -> None:
    """``torch.save`` under a temporary name (flushed to disk), then rename into place; a failure
    leaves neither a partial file nor the temporary one. ``then`` runs between the two (what the
    file counts is made durable there: :class:`bdsgd.stages.engine.resume.Checkpointer`); if
    it raises, the file is not renamed into place. A full disk is a :class:`CheckpointError`
    (``torch.save``'s zip writer raises RuntimeError there: the OSError under it says why)."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            sink = _Sink(fh)
            try:
                torch.save(payload, sink)
            except RuntimeError as exc:
                raise sink.error or OSError(first_line(exc)) from None
            fh.flush()
            os.fsync(fh.fileno())
        if then is not None:
            then()
        os.replace(tmp, path)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):  # e.g. the parent is not a directory: nothing to remove
            tmp.unlink()


class _Sink:
    """A file as ``torch.save`` writes it, keeping the OSError a write raised (torch reports it
    as a RuntimeError that does not say why)."""

    def __init__(self, fh) -> None:
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()
