"""The fitted model on disk: one versioned file that ``torch.load(path, weights_only=True)`` reads.

Contents (plain dict): ``format``, ``version``, ``model_config`` (dict), ``state_dict``,
``norm`` ({"loc", "scale"}), ``worker_ids`` / ``host_names`` (embedding row i + 1 holds entry i;
row 0 is "unknown"), ``worker_hosts`` (the host each id last ran on), ``default_hosts`` (the
latest run's worker set, by position = worker id), ``fit_config``, ``summary`` (steps,
val_nll, baseline_nll, calibration, traces, workers) and ``common`` ([shift, sd, widen,
tighten]: the shared log-slowdown the recalibration adds, its factor on each worker's spread and
its factor on the draws' spread of locations; absent in older files: none; older three-number
ones: tighten 1). Writes are atomic: a temporary name, then os.replace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stages.errors import CheckpointError
from stages.model.data import Normaliser
from stages.model.runtime_model import ModelConfig, RuntimeModel
from stages.safe_load import first_line, load_plain, save_atomic

FORMAT = "bdsgd-runtime-model"
VERSION = 4
NO_RECALIBRATION = (0.0, 0.0, 1.0, 1.0)  # common: shift, sd, widen, tighten


@dataclass(frozen=True)
class Vocab:
    """Known worker ids and host names; index 0 is the shared "unknown" embedding."""

    worker_ids: tuple[int, ...]
    host_names: tuple[str, ...]
    worker_hosts: dict[int, str] = field(default_factory=dict)

    def worker_index(self, ids: list[int]) -> torch.Tensor:
        pos = {w: i + 1 for i, w in enumerate(self.worker_ids)}
        return torch.tensor([pos.get(int(w), 0) for w in ids], dtype=torch.long)

    def host_index(self, names: list[str]) -> torch.Tensor:
        pos = {h: i + 1 for i, h in enumerate(self.host_names)}
        return torch.tensor([pos.get(h, 0) for h in names], dtype=torch.long)

    def extended(self, hosts_by_run: list[tuple[str, ...]]) -> Vocab:
        """This vocabulary plus the worker ids (0..N-1) and hosts of the given runs."""
        workers = dict.fromkeys(self.worker_ids)
        names = dict.fromkeys(self.host_names)
        worker_hosts = dict(self.worker_hosts)
        for hosts in hosts_by_run:
            workers.update(dict.fromkeys(range(len(hosts))))
            names.update(dict.fromkeys(hosts))
            worker_hosts.update(enumerate(hosts))
        return Vocab(tuple(workers), tuple(names), worker_hosts)


@dataclass(frozen=True)
class Checkpoint:
    model: RuntimeModel
    norm: Normaliser
    vocab: Vocab
    default_hosts: tuple[str, ...]
    fit_config: dict
    summary: dict
    common: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0)
    """Shift and spread (normalised log units) of a log-slowdown shared by every worker in
    each joint draw, a factor on every worker's own spread and a factor (at most 1) on how far
    the draws' locations spread about their mean, set by ``stages.model.recalibrate`` after
    training ((0, 0, 1, 1): none)."""


def save_checkpoint(path: str | os.PathLike, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` atomically; raises CheckpointError if the location is not writable."""
    path = Path(path)
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "model_config": ckpt.model.cfg.to_dict(),
        "state_dict": {k: v.detach().clone() for k, v in ckpt.model.state_dict().items()},
        "norm": {"loc": float(ckpt.norm.loc), "scale": float(ckpt.norm.scale)},
        "worker_ids": list(ckpt.vocab.worker_ids),
        "host_names": list(ckpt.vocab.host_names),
        "worker_hosts": dict(ckpt.vocab.worker_hosts),
        "default_hosts": list(ckpt.default_hosts),
        "fit_config": ckpt.fit_config,
        "summary": ckpt.summary,
        "common": [float(v) for v in ckpt.common],
    }
    save_atomic(payload, path)
    return path


def check_writable(path: str | os.PathLike) -> None:
    """Fail before a long fit, not after it, if ``path`` cannot be written."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {parent}: {exc.strerror or exc}") from None
    if not os.access(parent, os.W_OK) or Path(path).is_dir():
        raise CheckpointError(f"cannot write checkpoint {path}")


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and check a checkpoint; any problem is one CheckpointError line."""
    payload = _read_payload(Path(path))
    try:
        model = RuntimeModel(ModelConfig(**payload["model_config"]))
        model.load_state_dict(payload["state_dict"])
        norm = Normaliser(float(payload["norm"]["loc"]), float(payload["norm"]["scale"]))
        vocab = Vocab(
            tuple(int(w) for w in payload["worker_ids"]),
            tuple(str(h) for h in payload["host_names"]),
            {int(k): str(v) for k, v in payload["worker_hosts"].items()},
        )
        default_hosts = tuple(str(h) for h in payload["default_hosts"])
        saved = [float(v) for v in payload.get("common", ())]
        shift, sd, widen, tighten = (*saved, *NO_RECALIBRATION[len(saved) :])[:4]
        return Checkpoint(
            model,
            norm,
            vocab,
            default_hosts,
            payload["fit_config"],
            payload["summary"],
            (shift, sd, widen, tighten),
        )
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint ({first_line(exc)})") from None


def _read_payload(path: Path) -> dict:
    payload = load_plain(path, "checkpoint")
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a bdsgd run-time model checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {payload.get('version')!r} is not supported "
            f"(this bdsgd reads version {VERSION}); fit again"
        )
    return payload


def grown_state_dict(model: RuntimeModel, old: RuntimeModel) -> dict:
    """``old``'s weights for ``model``, whose embedding tables may have more rows: the rows ``old``
    knows are copied, new ones start as ``old``'s unknown row (0)."""
    state = {k: v.clone() for k, v in old.state_dict().items()}
    for name in ("head.worker_emb.weight", "head.host_emb.weight"):
        target = model.state_dict()[name]
        grown = state[name][0].expand_as(target).clone()
        grown[: state[name].shape[0]] = state[name]
        state[name] = grown
    return state
