"""What both example scripts share, so that their diff is exactly the adoption cost: a tiny
GPT-2 from ``transformers`` (random init, nothing downloaded), a synthetic language to learn
(token sequences from a fixed random bigram chain: a loss that falls steadily), its DataLoader,
warmup then cosine decay, and the emulated stragglers of a benchmark."""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed.nn  # noqa: F401 (before the group, else it outlives it: docs/library.md)
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB, CONTEXT = 256, 64


def build_model(seed: int, layers: int = 2, width: int = 128) -> torch.nn.Module:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise SystemExit("the examples need transformers: pip install 'bdsgd[examples]'") from None
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=width, n_layer=layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


class BigramText(Dataset):
    """Sequences of a fixed random bigram chain (each token has a few likely successors)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(VOCAB, VOCAB, generator=g) * 3.0
        probs = torch.softmax(logits, dim=1)
        tokens = torch.empty(size, CONTEXT, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (size,), generator=g)
        for i in range(1, CONTEXT):
            tokens[:, i] = torch.multinomial(probs[tokens[:, i - 1]], 1, generator=g).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def build_loader(batch_size: int, steps: int, world: int, rank: int, seed: int) -> DataLoader:
    data = BigramText(batch_size * world * (steps + 1), seed=seed)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)


def warmup_cosine(optimizer, warmup: int, steps: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def device_and_backend() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        import os

        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    return torch.device("cpu"), "gloo"


class HelpFormat(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with every default, and the script's docstring as written."""


def arguments(description: str, extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description, formatter_class=HelpFormat)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--micro-batches", type=int, default=4, help="gradient accumulation steps")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    ap.add_argument("--warmup", type=int, default=10, help="linear warmup steps, then cosine")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks")
    ap.add_argument("--width", type=int, default=128, help="embedding width")
    ap.add_argument("--seed", type=int, default=0, help="model init, data order, stragglers")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                    help="auto: nccl on GPUs, gloo on CPUs")  # fmt: skip
    ap.add_argument("--stragglers", default="none",
                    help="emulated stragglers of a benchmark, e.g. synthetic:base_s=0.05")  # fmt: skip
    ap.add_argument(
        "--log-every", type=int, default=10, help="rank 0 prints progress every N steps"
    )
    ap.add_argument("--metrics", help="rank 0 writes per-step wall time and loss here (JSON)")
    if extra is not None:
        extra(ap)
    return ap.parse_args()


class Progress:
    """Rank 0's progress line every ``every`` steps: the step, its loss, steps per second."""

    def __init__(self, rank: int, steps: int, every: int, start: int = 0) -> None:
        self.show = rank == 0 and every > 0
        self.steps, self.every = steps, every
        self.mark, self.mark_step = time.perf_counter(), start

    def step(self, step: int, loss: float | None, extra: str = "") -> None:
        done = step + 1
        if not self.show or (done % self.every and done != self.steps):
            return
        now = time.perf_counter()
        rate = (done - self.mark_step) / (now - self.mark)
        self.mark, self.mark_step = now, done
        shown = "-" if loss is None else f"{loss:.3f}"
        print(f"step {done}/{self.steps}  loss {shown}  {rate:.2f} steps/s{extra}", flush=True)


class Delays:
    """The emulated stragglers of a benchmark, for the plain script: the same per-(step, rank)
    delays bdsgd injects (``bdsgd.Cutoff(stragglers=...)``), slept here in full."""

    def __init__(self, spec: str, world: int, rank: int, seed: int) -> None:
        from bdsgd import straggler_delays

        self.column = straggler_delays(spec, world, rank, seed=seed)

    def sleep(self, step: int, parts: int) -> None:
        if self.column is not None:
            time.sleep(self.column.at(step) / parts)
