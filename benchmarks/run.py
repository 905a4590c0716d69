"""Run every ``benchmarks/bench_*.py`` and write one Markdown page of generated tables.

    python -m benchmarks.run                                     # make bench
    python -m benchmarks.run --out /tmp/b.md --quick --only fit,simulate

The page goes to its own file (``docs/benchmarks-generated.md`` by default), never over
``docs/benchmarks.md``: that page is the hand-written reference, which quotes these tables.

Each module exposes ``run(quick: bool = False) -> str`` returning a Markdown section. They run in
name order; one that fails to import or raises gets an error line in its section and the others
still run. The page starts with the machine it ran on and the command that reproduces it, and is
written atomically.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from bdsgd.schemas.run_dir import write_atomic
from rich.console import Console
from rich.progress import Progress

BENCH_DIR = Path(__file__).resolve().parent
REPRODUCE = "make bench"
ROOT = BENCH_DIR.parent
DEFAULT_OUT = ROOT / "docs" / "benchmarks-generated.md"
HAND_WRITTEN = ROOT / "docs" / "benchmarks.md"  # the reference page: never written here


@dataclass(frozen=True)
class Bench:
    """One benchmark module: its short name and its ``run``, or why it could not be imported."""

    name: str
    run: Callable[..., str] | None
    import_error: str | None = None


@dataclass(frozen=True)
class Section:
    name: str
    markdown: str
    seconds: float
    ok: bool


def discover() -> list[Bench]:
    """Every ``bench_*.py`` next to this file, imported, in name order."""
    benches = []
    for path in sorted(BENCH_DIR.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        try:
            module = importlib.import_module(f"benchmarks.{path.stem}")
            benches.append(Bench(name, module.run))
        except Exception as exc:  # reported in its section, the others still run
            benches.append(Bench(name, None, f"import failed: {_one_line(exc)}"))
    return benches


def select(benches: list[Bench], only: str | None) -> list[Bench]:
    """The benches named in ``--only a,b`` (all when None); an unknown name is an error."""
    if not only:
        return benches
    wanted = [n.strip().removeprefix("bench_") for n in only.split(",") if n.strip()]
    known = {b.name for b in benches}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(
            f"error: unknown benchmark(s) {', '.join(unknown)}; "
            f"available: {', '.join(sorted(known)) or 'none'}"
        )
    return [b for b in benches if b.name in wanted]


def run_one(bench: Bench, quick: bool) -> Section:
    """Run one benchmark; an exception becomes an error line in its section."""
    start = time.perf_counter()
    if bench.run is None:
        text, ok = f"error: {bench.import_error}", False
    else:
        try:
            text, ok = bench.run(quick=quick).strip(), True
        except Exception as exc:
            text, ok = f"error: {_one_line(exc)}", False
    if not text.startswith("#"):
        text = f"## {bench.name}\n\n{text}"
    return Section(bench.name, text, time.perf_counter() - start, ok)


def run_all(benches: Sequence[Bench], quick: bool, console: Console) -> list[Section]:
    sections = []
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("benchmarks", total=len(benches))
        for bench in benches:
            progress.update(task, description=f"bench {bench.name}")
            sections.append(run_one(bench, quick))
            progress.advance(task)
    return sections


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


# -- the page ---------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=BENCH_DIR,
            text=True,
            capture_output=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, str]:
    """Where the numbers come from."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "CPU": _cpu_model(),
        "cores": str(os.cpu_count()),
        "RAM": _ram_gib(),
        "torch": _version("torch"),
        "pyro-ppl": _version("pyro-ppl"),
        "python": platform.python_version(),
        "commit": _commit(),
    }


def render(sections: Sequence[Section], info: dict[str, str], quick: bool) -> str:
    mode = "quick (`--quick`: smaller sizes, numbers are indicative only)" if quick else "full"
    lines = [
        "# bdsgd benchmarks: generated tables",
        "",
        f"Reproduce: `{REPRODUCE}` (writes this file; docs/benchmarks.md is the hand-written "
        f"reference). Mode: {mode}.",
        "",
        "| machine | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "| benchmark | status | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {'ok' if s.ok else 'error'} | {s.seconds:.1f} |" for s in sections]
    if not sections:
        lines.append("\nNo benchmarks ran (none found as benchmarks/bench_*.py, or none selected).")
    lines.append("")
    for s in sections:
        lines += [s.markdown, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="Markdown file to write (default: docs/benchmarks-generated.md; never "
        "docs/benchmarks.md, the hand-written reference).",
    )
    parser.add_argument("--quick", action="store_true", help="Small sizes, for a smoke run.")
    parser.add_argument("--only", help="Comma-separated benchmark names, e.g. fit,simulate.")
    args = parser.parse_args(argv)
    if args.out.resolve() == HAND_WRITTEN.resolve():
        parser.error(f"{HAND_WRITTEN} is hand-written; write the generated tables elsewhere")
    console = Console(stderr=True)
    benches = select(discover(), args.only)
    sections = run_all(benches, args.quick, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, render(sections, machine(), args.quick).encode())
    failed = [s.name for s in sections if not s.ok]
    console.print(f"wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
