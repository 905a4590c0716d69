"""The stages of bdsgd: profile, import, fit, simulate, train, report.

Each stage module exposes one config dataclass and one entry function; ``bdsgd_cli`` builds the
config from flags and calls it. Library pieces shared by several stages (the trace store, the
run-time model, the policies, the distributed engine) live in their own modules here.
"""
