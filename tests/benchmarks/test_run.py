"""benchmarks.run assembles the page from fake bench modules (no timings asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import run as bench_run  # noqa: E402


def _fake_benches(calls: list[bool]) -> list[bench_run.Bench]:
    def good(quick: bool = False) -> str:
        calls.append(quick)
        return "## alpha\n\n| metric | value |\n|---|---|\n| throughput | 42 |\n"

    def bad(quick: bool = False) -> str:
        raise RuntimeError("cluster on fire\nsecond line")

    def bare(quick: bool = False) -> str:
        return "no heading here"

    return [
        bench_run.Bench("alpha", good),
        bench_run.Bench("beta", bad),
        bench_run.Bench("gamma", None, "import failed: ModuleNotFoundError: No module named 'x'"),
        bench_run.Bench("delta", bare),
    ]


def test_page_has_header_sections_in_order_and_errors(monkeypatch, tmp_path):
    calls: list[bool] = []
    monkeypatch.setattr(bench_run, "discover", lambda: _fake_benches(calls))
    out = tmp_path / "docs" / "benchmarks.md"
    rc = bench_run.main(["--out", str(out), "--quick"])
    page = out.read_text()
    assert rc == 1  # a failure is reported in the page and in the exit status
    assert calls == [True]  # --quick reached the benchmark
    assert "make bench" in page and "| torch |" in page and "| cores |" in page
    assert "| alpha | ok |" in page and "| beta | error |" in page
    assert "error: RuntimeError: cluster on fire" in page and "second line" not in page
    assert "## gamma\n\nerror: import failed" in page
    assert "## delta\n\nno heading here" in page
    body = page[page.index("## alpha") :]
    assert body.index("## alpha") < body.index("## beta") < body.index("## gamma")
    assert not list(out.parent.glob(".tmp-*"))


def test_only_selects_and_rejects_unknown(monkeypatch, tmp_path):
    calls: list[bool] = []
    monkeypatch.setattr(bench_run, "discover", lambda: _fake_benches(calls))
    out = tmp_path / "b.md"
    assert bench_run.main(["--out", str(out), "--only", "alpha"]) == 0
    assert calls == [False] and "## beta" not in out.read_text()
    with pytest.raises(SystemExit, match="unknown benchmark"):
        bench_run.main(["--out", str(out), "--only", "nope"])


def test_discover_imports_every_bench_module_in_name_order():
    benches = bench_run.discover()
    names = [b.name for b in benches]
    assert {"fit", "heldout", "predictor", "simulate", "train"} <= set(names)
    assert names == sorted(names)
    failed = {b.name: b.import_error for b in benches if b.run is None}
    assert not failed  # an import error would only show up in the page
    assert all(callable(b.run) for b in benches)


def test_never_writes_over_the_hand_written_page(monkeypatch):
    monkeypatch.setattr(bench_run, "discover", lambda: _fake_benches([]))
    before = bench_run.HAND_WRITTEN.read_bytes()
    with pytest.raises(SystemExit):
        bench_run.main(["--out", str(bench_run.HAND_WRITTEN), "--only", "alpha"])
    assert bench_run.HAND_WRITTEN.read_bytes() == before
    assert bench_run.DEFAULT_OUT != bench_run.HAND_WRITTEN


def test_make_bench_targets_write_their_own_files():
    """`make bench` and `make bench-quick` leave docs/benchmarks.md as it is."""
    recipes = [
        line for line in (ROOT / "Makefile").read_text().splitlines() if "benchmarks.run" in line
    ]
    assert len(recipes) >= 2
    assert not any("docs/benchmarks.md" in line for line in recipes), recipes
