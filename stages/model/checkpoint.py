"""The fitted model on disk: one versioned file that ``torch.load(path, weights_only=True)`` reads.

Contents (plain dict): ``format``, ``version``, ``model_config`` (dict), ``state_dict``,
``norm`` ({"loc", "scale"}, and for a fit that anchors each run at its level ``anchored``,
``level_sd`` and ``level_dof``: ``bdsgd.stages.model.data``), ``worker_ids`` / ``host_names`` (embedding row i + 1 holds entry i;
row 0 is "unknown"), ``worker_hosts`` (the host each id last ran on), ``default_hosts`` (the
latest run's worker set, by position = worker id), ``fit_config``, ``summary`` (steps,
step_workers, val_nll, baseline_nll, calibration, common_slowdown, traces, workers, runs) and ``common`` ([shift, sd, widen,
tighten]: the shared log-slowdown the recalibration adds, its factor on each worker's spread and
its factor on the draws' spread of locations; absent in older files: none; older three-number
ones: tighten 1). Writes are atomic: a temporary name, then os.replace; a write replaces only an
earlier checkpoint (:func:`check_writable`), never a file bdsgd did not write.

A file is checked before the model is built from it: network sizes within :data:`SIZE_LIMITS`,
every tensor of the shape those sizes give and finite, the normalisation and the recalibration
usable. A crafted file is one "malformed checkpoint" line, not a traceback, a huge allocation or
a predictor that silently draws NaN.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bdsgd.schemas.trace_v1 import MAX_WORLD_SIZE
from bdsgd.stages.errors import CheckpointError, first_line
from bdsgd.stages.model.data import BASE_FEATURES, NUM_FEATURES, Normaliser
from bdsgd.stages.model.runtime_model import ModelConfig, RuntimeModel
from bdsgd.stages.safe_load import load_plain, save_atomic

FORMAT = "bdsgd-runtime-model"
VERSION = 8
READS = (4, 5, 6, 7, 8)
WITH_REGIME = 7  # the version a model with the host-regime features, anchored at the median, is
WITH_DROPS = 6  # the version a model with host drops but not the regime features is written as
WITHOUT_DROPS = 5  # ... and one without either (a bdsgd before them reads it)
"""The versions this bdsgd reads: 8 is any model whose runs are anchored at a quantile of their
first iteration other than the median (``norm["anchor_q"]``: a fit of runs of up to 16
workers, :data:`bdsgd.stages.model.data.ANCHOR_Q`); 7 is a model with the host-regime features (``num_features``
14), with or without drops; 6 is 5 with a host's drop; 5 has neither (its ``model_config`` has
no ``recovery``); 4 is 5 without the run-position features (no ``num_features``). A fit writes
the oldest that holds its model (:func:`file_version`: 7 only with ``fit --host-regime``). A
bdsgd that reads only older ones says it cannot read a newer one."""
NO_RECALIBRATION = (0.0, 0.0, 1.0, 1.0)  # common: shift, sd, widen, tighten
REQUIRED_KEYS = frozenset({"format", "version", "model_config", "state_dict", "norm"})
"""What every checkpoint bdsgd has written holds, whatever its version."""
MAX_WIDTH = 4096
"""Largest latent, hidden, embedding or phi size a checkpoint may give (fit's are 8-64)."""
SIZE_LIMITS = {
    "num_workers": (0, MAX_WORLD_SIZE),  # worker ids are 0..world_size - 1 (bdsgd.schemas.trace_v1)
    "num_hosts": (0, MAX_WORLD_SIZE),
    "z_dim": (1, MAX_WIDTH),
    "hidden": (1, MAX_WIDTH),
    "emb_dim": (1, MAX_WIDTH),
    "phi_dim": (1, MAX_WIDTH),
}
MAX_ABS_LOC = 100.0
"""Largest |mean log run-time| (log seconds) a checkpoint's normalisation may hold."""
SCALE_RANGE = (1e-6, 100.0)
"""Its spread of log run-times (fit floors it at 1e-3): outside, y or x over- or underflows."""
MAX_LEVEL_SD = 1e3
"""Largest spread of the fitted runs' levels (normalised units) a checkpoint may hold."""
MAX_LEVEL_DOF = 1_000_000
"""Largest degrees of freedom of the t a run's level is drawn from (the fitted runs less one)."""


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
    the draws' locations spread about their mean, set by ``bdsgd.stages.model.recalibrate`` after
    training ((0, 0, 1, 1): none)."""

    @property
    def usable(self) -> bool:
        """Whether ``fit`` found the model calibrated on held-out data and no worse than the
        pooled-window baseline (``summary["usable"]``); a checkpoint without the mark is."""
        return bool(self.summary.get("usable", True))

    @property
    def unusable_reason(self) -> str | None:
        """Why ``fit`` marked the model unusable, in one line (None where it is usable)."""
        return None if self.usable else str(self.summary.get("unusable_reason") or "")

    @property
    def probation(self) -> bool:
        """Whether ``fit`` marked the model only uncalibrated (``summary["probation"]``: a
        policy may run it in its peers' shadow); a checkpoint written before the mark is not."""
        return not self.usable and self.summary.get("probation") is True


def save_checkpoint(path: str | os.PathLike, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` atomically; raises CheckpointError if the location is not writable, or if
    :func:`load_checkpoint` would refuse what is written (a diverged fit: NaN weights)."""
    path = Path(path)
    try:
        _check_finite(ckpt.model.state_dict())  # (its shapes are the model's own)
        _normaliser(norm_dict(ckpt.norm))
        _common(ckpt.common)
    except ValueError as exc:
        raise CheckpointError(
            f"the fit diverged, nothing written ({first_line(exc)}): try a smaller --lr"
        ) from None
    config = ckpt.model.cfg.to_dict()
    if not config["recovery"]:  # a model without drops is written as before them: version 5
        del config["recovery"]
    payload = {
        "format": FORMAT,
        "version": file_version(ckpt.model.cfg, ckpt.norm),
        "model_config": config,
        "state_dict": {k: v.detach().clone() for k, v in ckpt.model.state_dict().items()},
        "norm": norm_dict(ckpt.norm),
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
    """Fail before a long fit, not after it, if ``path`` cannot be written or holds a file bdsgd
    did not write: an earlier checkpoint may be replaced (fitting again is normal), anything else
    never is. Creates nothing: a missing parent folder is made when the file is written, so a fit
    that fails leaves none behind."""
    path = Path(path)
    existing = next(p for p in path.parents if p.exists())  # the nearest existing ancestor
    if path.is_dir() or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write checkpoint {path}")
    if path.exists() and not is_checkpoint(path):
        raise CheckpointError(
            f"{path} exists and is not a bdsgd checkpoint: bdsgd replaces only a checkpoint it "
            "wrote; pass a new path"
        )


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a run-time model checkpoint of any version, read as data only."""
    try:
        payload = load_plain(path, "checkpoint")
    except CheckpointError:
        return False
    return payload.get("format") == FORMAT and REQUIRED_KEYS <= payload.keys()


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and check a checkpoint; any problem is one CheckpointError line."""
    payload = _read_payload(Path(path))
    try:
        if not isinstance(payload["summary"], dict):  # (fit's marks are read from it)
            raise ValueError(f"summary is a {type(payload['summary']).__name__}, not a dict")
        cfg = _model_config(payload["model_config"])
        _check_weights(cfg, payload["state_dict"])
        model = RuntimeModel(cfg)
        model.load_state_dict(payload["state_dict"])
        vocab = Vocab(
            tuple(int(w) for w in payload["worker_ids"]),
            tuple(str(h) for h in payload["host_names"]),
            {int(k): str(v) for k, v in payload["worker_hosts"].items()},
        )
        if (len(vocab.worker_ids), len(vocab.host_names)) != (cfg.num_workers, cfg.num_hosts):
            raise ValueError("worker_ids and host_names do not match model_config's sizes")
        return Checkpoint(
            model,
            _normaliser(payload["norm"]),
            vocab,
            tuple(str(h) for h in payload["default_hosts"]),
            payload["fit_config"],
            payload["summary"],
            _common(payload.get("common", ())),
        )
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint ({first_line(exc)})") from None


def _model_config(values: dict) -> ModelConfig:
    """The network sizes, each an integer within :data:`SIZE_LIMITS`."""
    # version 4: no position features; 4 and 5: no drop
    cfg = ModelConfig(**{"num_features": BASE_FEATURES, "recovery": False, **values})
    if not isinstance(cfg.recovery, bool):
        raise ValueError(f"model_config recovery {cfg.recovery!r} is not true or false")
    for name, (low, high) in SIZE_LIMITS.items():
        size = getattr(cfg, name)
        if isinstance(size, bool) or not isinstance(size, int) or not low <= size <= high:
            raise ValueError(f"model_config {name} {size!r} is not an integer in {low}..{high}")
    return cfg


def _check_weights(cfg: ModelConfig, state: dict) -> None:
    """Every saved tensor has the shape ``cfg`` gives it and finite values. The shapes come from
    a model on the ``meta`` device (no storage), so sizes the file does not back are refused
    before the real model is allocated; missing or extra names are load_state_dict's to report."""
    with torch.device("meta"):
        expected = RuntimeModel(cfg).state_dict()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict {name} is not a tensor")
        if name in expected and value.shape != expected[name].shape:
            raise ValueError(
                f"state_dict {name} has shape {list(value.shape)}, model_config gives "
                f"{list(expected[name].shape)}"
            )
    _check_finite(state)


def _check_finite(state: dict) -> None:
    """Every floating-point tensor of ``state`` holds finite values only. What a save checks: a
    model built in this process has its config's shapes (a meta-device copy to compare against
    costs 1.2 s the first time in a process, loading parts of torch)."""
    for name, value in state.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"state_dict {name} holds NaN or infinite values")


def norm_dict(norm: Normaliser) -> dict:
    """The normalisation as saved (the anchor's fields only where the fit anchored runs)."""
    out = {"loc": float(norm.loc), "scale": float(norm.scale)}
    if norm.anchored:
        out.update(anchored=True, level_sd=float(norm.level_sd))
        if norm.level_dof:
            out["level_dof"] = int(norm.level_dof)
        if norm.anchor_q != 0.5:
            out["anchor_q"] = float(norm.anchor_q)
    return out


def _normaliser(norm: dict) -> Normaliser:
    """The normalisation, with a finite loc and a scale in :data:`SCALE_RANGE` (a zero,
    negative or NaN one would divide by zero or draw NaN run-times), and a level spread in
    0..:data:`MAX_LEVEL_SD` (absent: an older, unanchored fit)."""
    loc, scale = float(norm["loc"]), float(norm["scale"])
    anchored, level_sd = bool(norm.get("anchored", False)), float(norm.get("level_sd", 0.0))
    if not 0.0 <= level_sd <= MAX_LEVEL_SD:
        raise ValueError(f"norm level_sd {level_sd} is not in 0..{MAX_LEVEL_SD:g}")
    level_dof = norm.get("level_dof", 0)  # (absent: a normal, as fits before the t wrote)
    if type(level_dof) is not int or not 0 <= level_dof <= MAX_LEVEL_DOF:  # (not a bool)
        raise ValueError(f"norm level_dof {level_dof!r} is not an integer in 0..{MAX_LEVEL_DOF}")
    anchor_q = float(norm.get("anchor_q", 0.5))  # (absent: the median, as fits before)
    if not 0.0 < anchor_q < 1.0:
        raise ValueError(f"norm anchor_q {anchor_q} is not in (0, 1)")
    if not abs(loc) <= MAX_ABS_LOC:
        raise ValueError(f"norm loc {loc} is not a finite number within +-{MAX_ABS_LOC:g}")
    low, high = SCALE_RANGE
    if not low <= scale <= high:
        raise ValueError(f"norm scale {scale} is not in {low:g}..{high:g}")
    return Normaliser(loc, scale, anchored, level_sd, level_dof, anchor_q)


def _common(saved) -> tuple[float, float, float, float]:
    """The recalibration (shift, sd, widen, tighten), padded as older files need: finite, the
    spread at least 0 and the two factors above 0."""
    values = [float(v) for v in saved]
    shift, sd, widen, tighten = (*values, *NO_RECALIBRATION[len(values) :])[:4]
    if not all(map(math.isfinite, values)) or sd < 0 or widen <= 0 or tighten <= 0:
        raise ValueError(f"common {values} is not a usable recalibration")
    return shift, sd, widen, tighten


def _read_payload(path: Path) -> dict:
    payload = load_plain(path, "checkpoint")
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a bdsgd run-time model checkpoint")
    version = payload.get("version")
    if type(version) is not int or version not in READS:
        raise CheckpointError(
            f"{path}: checkpoint version {version!r} is not supported "
            f"(this bdsgd reads versions {READS[0]}-{READS[-1]}); fit again"
        )
    return payload


def file_version(cfg: ModelConfig, norm: Normaliser | None = None) -> int:
    """The oldest version that holds a model of ``cfg`` normalised by ``norm`` (a bdsgd before
    it reads the file; one before version 8 would anchor every run at its median)."""
    if norm is not None and norm.anchored and norm.anchor_q != 0.5:
        return VERSION
    if cfg.num_features == NUM_FEATURES:
        return WITH_REGIME
    return WITH_DROPS if cfg.recovery else WITHOUT_DROPS


def grown_state_dict(model: RuntimeModel, old: RuntimeModel) -> dict:
    """``old``'s weights for ``model``, whose embedding tables may have more rows: the rows ``old``
    knows are copied, new ones start as ``old``'s unknown row (0). A model with features ``old``
    had not (the run position, the host regime) starts their weights at 0, shared ones and the
    drop's alike: it predicts as ``old`` did."""
    state = {k: v.clone() for k, v in old.state_dict().items()}
    if model.head.num_position:
        grown = torch.zeros_like(model.head.position_w)
        had = state.get("head.position_w", grown[:, :0])
        grown[:, : had.shape[1]] = had
        state["head.position_w"] = grown
    if model.head.recovery is not None and "head.recovery.weight" in state:
        _grow_recovery(state, old.cfg.num_features, model.cfg.num_features)
    for name in ("head.worker_emb.weight", "head.host_emb.weight"):
        target = model.state_dict()[name]
        grown = state[name][0].expand_as(target).clone()
        grown[: state[name].shape[0]] = state[name]
        state[name] = grown
    return state


def _grow_recovery(state: dict, had: int, has: int) -> None:
    """The drop's weights ([v, k (F), r, m (F)] rows, :meth:`Emitter.recovery`) from ``had``
    features to ``has``, the new features' rows at 0."""
    for name in ("head.recovery.weight", "head.recovery.bias"):
        old = state[name]
        new = old.new_zeros((2 + 2 * has, *old.shape[1:]))
        new[: 1 + had] = old[: 1 + had]
        new[1 + has : 2 + has + had] = old[1 + had :]
        state[name] = new
