"""Workloads: a model, a source of mini-batches and a loss, built the same way in every process.

Built in: ``mlp`` (a 3-layer MLP learning a fixed random teacher on synthetic Gaussian inputs) and
``cnn`` (a small CNN on scikit-learn's bundled 8x8 digits, so nothing is downloaded). A user's own
workload is ``--workload package.module:function``; the function takes ``seed`` and returns a
:class:`Workload`.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from bdsgd.stages.errors import ConfigError
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    """What the engine needs of a training job.

    ``model``: the network (same initial parameters in every process for the same seed).
    ``batch(generator, batch_size)``: a training mini-batch (inputs, targets), drawn with the
    given ``torch.Generator`` so each worker sees its own stream.
    ``loss(outputs, targets)``: a scalar loss.
    ``eval_batch``: a fixed held-out batch for the periodic evaluation loss.

    What the training loop of ``--engine loop`` (``bdsgd.Cutoff``, the library) also takes;
    None keeps the built-in behaviour:

    ``optimizer(params, lr)``: a ``torch.optim`` optimizer (default SGD with momentum 0.9).
    ``scheduler(optimizer, iterations)``: an LR scheduler stepped once per iteration (default
    none: a constant learning rate).
    ``data(rank, world, batch_size, seed)``: an iterable of this rank's mini-batches, a
    ``DataLoader`` for instance (default: ``batch`` drawn from a per-rank generator).
    ``autocast``: the dtype of ``torch.autocast`` around the forward pass (``torch.bfloat16``).
    ``clip_norm``: the gradient norm clipped to after the all-reduce, before the step.
    """

    name: str
    model: nn.Module
    batch: Callable[[torch.Generator, int], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_batch: Batch
    optimizer: Callable[..., torch.optim.Optimizer] | None = None
    scheduler: Callable[..., object] | None = None
    data: Callable[[int, int, int, int], Iterable] | None = None
    autocast: torch.dtype | None = None
    clip_norm: float | None = None

    def loop_only(self) -> list[str]:
        """The fields only ``--engine loop`` honours that this workload sets."""
        names = ("optimizer", "scheduler", "data", "autocast", "clip_norm")
        return [name for name in names if getattr(self, name) is not None]

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The workload's optimizer on the model's parameters, or SGD with momentum 0.9."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is not None:
            return self.optimizer(params, lr)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    def make_scheduler(self, optimizer: torch.optim.Optimizer, iterations: int):
        """The workload's LR scheduler over ``iterations`` steps, or None."""
        return None if self.scheduler is None else self.scheduler(optimizer, iterations)

    def batches(self, rank: int, world: int, batch_size: int, seed: int, start: int = 0):
        """Rank ``rank``'s mini-batches from iteration ``start`` on: the workload's ``data``
        (an epoch after another; a resumed run skips the ``start`` batches it consumed), or
        ``batch`` drawn from a generator seeded by the seed, the rank and the iteration (a
        resumed run draws what an uninterrupted one would)."""
        if self.data is None:
            gen = torch.Generator()
            for t in itertools.count(start):
                gen.manual_seed((seed * 1_000_003 + rank) * 1_000_003 + t)
                yield self.batch(gen, batch_size)
        skip = start
        while True:
            empty = True
            for item in self.data(rank, world, batch_size, seed):
                empty = False
                if skip:
                    skip -= 1
                    continue
                yield item
            if empty:
                raise ConfigError(f"workload {self.name!r}: its data holds no batch")


def mlp(seed: int = 0, dim: int = 32, hidden: int = 256, classes: int = 10) -> Workload:
    """~77k parameters; labels come from a fixed random teacher network, so the loss can fall."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    teacher = torch.randn(dim, classes, generator=gen)

    def batch(g: torch.Generator, n: int) -> Batch:
        x = torch.randn(n, dim, generator=g)
        return x, (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(1)

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(dim, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )
    return Workload("mlp", model, batch, nn.functional.cross_entropy, batch(gen, 512))


def cnn(seed: int = 0) -> Workload:
    """A small CNN on the 1,797 8x8 digit images bundled with scikit-learn (last 297 held out)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_x, train_y = images[:1500], labels[:1500]

    def batch(g: torch.Generator, n: int) -> Batch:
        idx = torch.randint(0, train_x.shape[0], (n,), generator=g)
        return train_x[idx], train_y[idx]

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    return Workload(
        "cnn", model, batch, nn.functional.cross_entropy, (images[1500:], labels[1500:])
    )


BUILTIN: dict[str, Callable[..., Workload]] = {"mlp": mlp, "cnn": cnn}  # + transformer, below


def load_workload(spec: str, seed: int = 0) -> Workload:
    """Build a workload from ``mlp``, ``cnn``, ``transformer`` or ``module:function``."""
    if spec in BUILTIN:
        return BUILTIN[spec](seed=seed)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"unknown workload {spec!r}: use mlp, cnn, transformer or module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot load workload {spec!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (the user's module failed while it was imported)
        raise ConfigError(f"workload {spec!r} failed on import: {error_line(exc)}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"cannot load workload {spec!r}: {module_name} has no {attr!r}")
    if not callable(factory):
        raise ConfigError(
            f"cannot load workload {spec!r}: {spec.replace(':', '.')} is a "
            f"{type(factory).__name__}, not a function"
        )
    return build_workload(spec, factory, seed)


def build_workload(spec: str, factory: Callable[..., object], seed: int) -> Workload:
    """Call a user's factory. Its errors are the user's to fix, so they come back as one line
    naming the workload (a traceback into our loader would point at the wrong code)."""
    try:
        workload = factory(seed=seed)
    except Exception as exc:  # noqa: BLE001 (any error of the user's code)
        raise ConfigError(f"workload {spec!r} failed: {error_line(exc)}") from None
    if not isinstance(workload, Workload):
        raise ConfigError(f"workload {spec!r} returned {type(workload).__name__}, not a Workload")
    return workload


def error_line(exc: BaseException) -> str:
    """``Type: first line of the message``: a workload's error, in one line (here and in the
    workers, :func:`bdsgd.stages.engine.worker.workload_code`)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def transformer(
    seed: int = 0, vocab: int = 64, dim: int = 128, layers: int = 2, context: int = 64
) -> Workload:
    """A small causal transformer (~0.4M parameters) on synthetic tokens from a fixed random
    Markov chain, so the loss can fall to the chain's entropy: a GPU-sized workload for
    ``--device cuda`` profiles (it runs on CPU too, slowly)."""
    gen = torch.Generator().manual_seed(20_000 + seed)
    logits = torch.randn(vocab, vocab, generator=gen) * 2.0
    chain = torch.softmax(logits, dim=1)

    def batch(g: torch.Generator, n: int) -> Batch:
        tokens = torch.empty(n, context + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for i in range(context):
            tokens[:, i + 1] = torch.multinomial(chain[tokens[:, i]], 1, generator=g).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]

    torch.manual_seed(seed)
    model = TinyTransformer(vocab, dim, layers, context)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return Workload("transformer", model, batch, loss, batch(gen, 64))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm encoder layers under a causal mask,
    and a linear head."""

    def __init__(self, vocab: int, dim: int, layers: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


BUILTIN["transformer"] = transformer


def resolve_device(device: str, workers: int, local_rank: int = 0) -> torch.device:
    """The device a worker computes on: ``cuda`` (or ``auto`` with a GPU present) takes GPU
    ``local_rank mod`` the GPUs of this machine; otherwise the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch on this machine")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def backend_for(device: torch.device, workers: int) -> str:
    """NCCL when every worker of this machine has a GPU of its own, gloo otherwise (CPU, or
    several workers sharing a GPU)."""
    import os

    local = int(os.environ.get("LOCAL_WORLD_SIZE", workers))
    if device.type == "cuda" and torch.cuda.device_count() >= local:
        return "nccl"
    return "gloo"
