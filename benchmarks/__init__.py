"""Opt-in benchmarks (``make bench``). Each ``bench_*.py`` exposes ``run(quick=False) -> str``
returning one Markdown section; ``benchmarks.run`` assembles them into docs/benchmarks.md."""
