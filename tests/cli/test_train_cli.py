"""``bdsgd train`` end to end: exact-c admission with a slow worker, the JSON contract, errors,
resume after the server is killed, Ctrl-C; the same for an asynchronous policy."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from bdsgd.stages.engine.resume import STATE_FILE
from bdsgd.stages.loop_runs import CHECKPOINT
from bdsgd.stages.store import TraceStore

from tests.cli.test_profile_cli import BDSGD, bdsgd
from tests.processes import kill_session, run_in_session, start_in_session, stderr_of
from tests.stages.engine import write_replay_trace
from tests.stages.wire.test_keys import listening_addresses

SPEC_KEYS = {
    "policy",
    "iterations",
    "wall_s",
    "throughput",
    "mean_c",
    "final_loss",
    "time_to_loss",
    "decision_ms_p50",
    "decision_ms_p99",
}
SLOW_S, FAST_S = 5.0, 0.005  # a slow worker is always cut: its long delay costs nothing


@pytest.fixture(scope="module")
def slow_worker_train(tmp_path_factory):
    """static:3 of 4 workers, worker 2 replayed 1000x slower than the others; the cut rank
    contributes nothing (no salvage), so exactly 3 mini-batches are applied."""
    tmp = tmp_path_factory.mktemp("train")
    replay = write_replay_trace(tmp / "replay", [[FAST_S, FAST_S, SLOW_S, FAST_S]])
    done = bdsgd(
        "train", "--workers", "4", "--iterations", "20", "--policy", "static:3",
        "--traces", str(tmp / "traces"), "--out", str(tmp / "run"),
        "--stragglers", f"replay:{replay}", "--batch-size", "16",
        "--target-loss", "10", "--no-salvage", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return tmp, json.loads(done.stdout.strip().splitlines()[-1])


def test_json_has_exactly_the_spec_keys(slow_worker_train):
    _, summary = slow_worker_train
    assert set(summary) - {"run_id"} == SPEC_KEYS
    assert summary["policy"] == "static:3"
    assert summary["iterations"] == 20
    assert summary["throughput"] > 0 and summary["wall_s"] > 0
    assert summary["mean_c"] == 3.0
    assert math.isfinite(summary["final_loss"])
    assert isinstance(summary["time_to_loss"], float)  # a loss of 10 is reached at once
    assert 0 <= summary["decision_ms_p50"] <= summary["decision_ms_p99"]


def test_every_iteration_applies_three_gradients(slow_worker_train):
    tmp, _ = slow_worker_train
    its = pq.read_table(tmp / "run" / "iterations.parquet").to_pydict()
    assert its["iteration"] == list(range(20))
    assert its["c"] == [3] * 20
    assert its["lr"] == pytest.approx([0.05 * 3 / 4] * 20)  # linear scaling c / N


def test_slow_worker_rows_are_censored_at_the_cut(slow_worker_train):
    tmp, summary = slow_worker_train
    rows = TraceStore(tmp / "traces").read()
    assert rows["run_id"].unique().to_list() == [summary["run_id"]]
    assert rows.height == 80
    slow = rows.filter(pl.col("worker") == 2)
    assert slow["censored"].all()
    assert (slow["runtime_s"] < slow["injected_delay_s"]).all()  # cut before its delay ended
    assert not rows.filter(pl.col("worker") != 2)["censored"].any()
    assert rows["cutoff"].to_list() == [3] * 80
    assert rows["source"].unique().to_list() == ["train"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--policy", "k-batch-sync:1"), "k-batch-sync"),
        (("--policy", "oracle"), "oracle"),
        (("--policy", "nonsense"), "nonsense"),
        (("--policy", "static:2", "--no-out"), "--out"),
        (("--policy", "static:2", "--workers", "10000"), "--allow-oversubscribe"),
        (("--policy", "static:2", "--timeout", "nan"), "--timeout"),
        (("--policy", "static:2", "--timeout", "inf"), "--timeout"),
        (("--policy", "static:2", "--time-scale", "nan"), "--time-scale"),
        (("--policy", "static:2", "--stragglers", "synthetic:base_s=inf"), "base_s"),
    ],
)
def test_bad_train_input_is_one_line_and_leaves_no_run_dir(tmp_path, args, needle):
    base = ["train", "--workers", "2", "--iterations", "3", "--traces", str(tmp_path / "t")]
    out = [] if "--no-out" in args else ["--out", str(tmp_path / "run")]
    done = bdsgd(*base, *out, *(a for a in args if a != "--no-out"), timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_the_engine_rejects_at_start_leaves_no_run_dir(tmp_path):
    """--host names an address this machine lacks: the run dir was made, then is taken back."""
    args = ["--workers", "2", "--iterations", "3", "--policy", "full", "--host", "203.0.113.254"]
    done = bdsgd("train", *args, "--traces", str(tmp_path / "t"), "--out", str(tmp_path / "run"))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # after the progress bar's line
    assert last.startswith("error: cannot reach the control store at 203.0.113.254"), last
    assert not (tmp_path / "run").exists()


def test_an_out_of_other_files_is_refused_untouched(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("the user's")
    args = ["--workers", "2", "--iterations", "3", "--policy", "full"]
    done = bdsgd("train", *args, "--traces", str(tmp_path / "t"), "--out", str(tmp_path / "mine"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"error: --out {tmp_path / 'mine'} holds files bdsgd did not write (config.json): pass "
        "a new or empty directory"
    ]
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["config.json"]
    assert (tmp_path / "mine" / "config.json").read_text() == "the user's"


def test_an_unwritable_out_is_one_line_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    args = ["--workers", "2", "--iterations", "3", "--policy", "full"]
    out = str(tmp_path / "file" / "run")  # under a file: unwritable even for root
    done = bdsgd("train", *args, "--traces", str(tmp_path / "t"), "--out", out, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot make the run directory")
    assert not TraceStore(tmp_path / "t").files()


def test_resume_does_not_run_the_workload_a_run_dir_names(tmp_path):
    """A tampered config.json naming module:function: resume refuses before importing it."""
    (tmp_path / "evil.py").write_text(
        f"open({str(tmp_path / 'ran')!r}, 'w').write('imported')\ndef make(seed=0): pass\n"
    )
    run = tmp_path / "run"
    run.mkdir()
    config = dict(workers=2, iterations=3, policy="full", traces=str(tmp_path / "t"))
    (run / "config.json").write_text(
        json.dumps({**config, "out": str(run), "workload": "evil:make"})
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [BDSGD, "train", "--resume", str(run)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'evil:make', which is code: pass --workload" in lines[0]
    assert not (tmp_path / "ran").exists()
    done = subprocess.run(
        [BDSGD, "train", "--resume", str(run), "--workload", "other:make"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "not --workload 'other:make'" in done.stderr
    assert not (tmp_path / "ran").exists()


BAD_WORKLOAD = """
import torch
from bdsgd.stages.workloads import Workload

def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    def batch(gen, n):  # 7 features for a model of 8: the user's bug
        return torch.randn(n, 7, generator=gen), torch.randint(0, 4, (n,), generator=gen)
    held_out = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    return Workload("bad", model, batch, torch.nn.functional.cross_entropy, held_out)
"""


def run_bad_workload(tmp_path, policy: str):
    (tmp_path / "badwl.py").write_text(BAD_WORKLOAD)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    args = ["--workers", "2", "--iterations", "5", "--policy", policy,
            "--workload", "badwl:make", "--traces", str(tmp_path / "t"),
            "--out", str(tmp_path / "run")]  # fmt: skip
    return run_in_session([BDSGD, "train", *args], timeout=240, env=env)


def test_a_workload_failing_in_the_ranks_ends_the_run_with_its_line(tmp_path):
    """The rank's own error (here torch's shape mismatch) is the run's one-line error, naming
    the rank; no run directory is left (it failed before its first checkpoint)."""
    done = run_bad_workload(tmp_path, "full")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and "Traceback" not in done.stderr, done.stderr
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in last
    assert not (tmp_path / "run").exists()


def test_a_workload_failing_in_the_servers_workers_is_reported_by_each_in_one_line(tmp_path):
    """The parameter server's workers' own error reaches the user, one line per worker, before
    the server's own one-line error. (A worker may be stopped by the server's end before its
    first micro-batch: at least one reports.)"""
    done = run_bad_workload(tmp_path, "async")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    workers = [line for line in lines if line.startswith("bdsgd worker ")]
    assert workers and len({line.split(":")[0] for line in workers}) == len(workers)
    assert {line.split(":")[0] for line in workers} <= {"bdsgd worker 0", "bdsgd worker 1"}
    assert all("RuntimeError: mat1 and mat2 shapes cannot be multiplied" in w for w in workers)
    assert lines[-1].startswith("error:") and len(lines) <= len(workers) + 2  # + progress
    if "worker(s) left" in lines[-1]:  # names why: here the workers' processes ended
        assert "worker(s) " in lines[-1].split("--min-workers")[1], lines[-1]


def test_a_finished_run_is_not_resumed_and_keeps_its_results(slow_worker_train):
    tmp, _ = slow_worker_train
    before = (tmp / "run" / "summary.json").read_bytes()
    done = bdsgd("train", "--resume", str(tmp / "run"), timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "already run 20 iterations" in lines[0], done.stderr
    assert (tmp / "run" / "summary.json").read_bytes() == before


def test_resume_refuses_a_flag_it_would_ignore(tmp_path):
    """Settings come from the run directory: a new --policy or --timeout is refused, not
    silently dropped."""
    done = bdsgd("train", "--resume", str(tmp_path), "--policy", "full", "--timeout", "9",
                 timeout=60)  # fmt: skip
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "--policy, --timeout" in lines[0]


def test_resume_of_a_dir_without_state_is_one_line(tmp_path):
    done = bdsgd("train", "--resume", str(tmp_path), "--json", timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr


# -- killing and interrupting a running train -------------------------------------------------
def processes_where(field: int, value: int) -> list[int]:
    """Pids whose /proc stat field (after the command name: 1 parent, 3 session) is ``value``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value:
            out.append(int(stat.parent.name))
    return out


def children_of(pid: int) -> list[int]:
    return processes_where(1, pid)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def leftovers() -> list[str]:
    """Command lines of bdsgd processes still running (for failure messages)."""
    out = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmd.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "multiprocessing" in text or "bdsgd" in text:
            out.append(f"{cmd.parent.name}: {text[:120]}")
    return out


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {leftovers()}"
        time.sleep(0.05)


STARTUP_S = 240.0
"""How long a started train may take to write its first checkpoint: start-up takes what the
machine needs (importing torch in every worker took over 10 s on a loaded 2-core machine), so
only the test's own timeout (300 s) bounds it."""


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path) -> None:
    """Until the run's first checkpoint is written (or the run ended: the test then fails on
    what it says)."""
    wait_until(lambda: checkpoint_of(run_dir) or proc.poll() is not None, STARTUP_S,
               "a checkpoint")  # fmt: skip
    assert checkpoint_of(run_dir), f"the run ended before its first checkpoint: {stderr_of(proc)}"


def checkpoint_of(run_dir: Path) -> Path | None:
    """The run's checkpoint: the library's loop's, or the parameter server's."""
    return next((p for p in (run_dir / CHECKPOINT, run_dir / STATE_FILE) if p.exists()), None)


def start_train(
    tmp: Path,
    iterations: int,
    policy: str = "static:2",
    stragglers: str | None = None,
    sigint_ignored: bool = False,
) -> subprocess.Popen:
    """``sigint_ignored``: as a shell script starts a background job (``bdsgd train ... &``);
    otherwise SIGINT has its default disposition, whatever pytest's is."""
    if stragglers is None:
        stragglers = f"replay:{write_replay_trace(tmp / 'replay', [[0.02, 0.01, 0.015]])}"
    return start_in_session(
        [
            BDSGD,
            "train",
            "--workers",
            "3",
            "--iterations",
            str(iterations),
            "--policy",
            policy,
            "--traces",
            str(tmp / "traces"),
            "--out",
            str(tmp / "run"),
            "--stragglers",
            stragglers,
            "--batch-size",
            "8",
            "--micro-batches",
            "2",
        ],  # fmt: skip
        preexec_fn=sigint_disposition(signal.SIG_IGN if sigint_ignored else signal.SIG_DFL),
    )


def sigint_disposition(disposition):
    """What sets SIGINT's disposition in a started process (it would inherit pytest's, ignored
    where pytest runs as a background job): SIG_DFL, so a Ctrl-C raises KeyboardInterrupt in
    Python, or SIG_IGN, as a shell script's background job starts."""
    return lambda: signal.signal(signal.SIGINT, disposition)


def interrupt_train(
    tmp: Path,
    policy: str,
    iterations: int = 400,
    stragglers: str | None = None,
    signum: int = signal.SIGINT,
    sigint_ignored: bool = False,
) -> tuple[subprocess.Popen, str, list[int]]:
    """Start a train, Ctrl-C (or ``signum``) its process group once a checkpoint is written;
    returns the process, its stderr and the worker pids it had."""
    proc = start_train(tmp, iterations=iterations, policy=policy, stragglers=stragglers,
                       sigint_ignored=sigint_ignored)  # fmt: skip
    try:
        wait_for_checkpoint(proc, tmp / "run")
        workers = [p for p in children_of(proc.pid) if running(p)]
        os.killpg(proc.pid, signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        kill_session(proc)
    return proc, stderr, workers


def session_of(pid: int) -> list[int]:
    """Every process of the session ``pid`` leads (the train and the workers it spawned)."""
    return processes_where(3, pid)


def test_a_default_train_listens_on_loopback_alone(tmp_path):
    """The control store and every gloo socket of the server and its workers, while they run."""
    proc = start_train(tmp_path, iterations=400)
    try:
        wait_for_checkpoint(proc, tmp_path / "run")
        pids = session_of(proc.pid)
        listening = listening_addresses(pids)
    finally:
        kill_session(proc)
    assert len(pids) >= 4  # the server and its three workers
    assert len(listening) >= 2, listening  # the store and at least the server's gloo socket
    assert {address for address, _ in listening} == {"127.0.0.1"}, listening


@pytest.mark.parametrize(
    ("flags", "stopped"),
    [
        (("--target-loss", "100", "--stop-at-target"), "target"),
        (("--max-wall-s", "1e-6"), "wall budget"),
    ],
)
def test_a_run_stops_early_at_its_target_or_wall_budget(tmp_path, flags, stopped):
    """A target every loss is below, or a budget the first iteration spends: the run stops
    after that iteration (or the next, which the ranks may have begun before they saw the
    stop): its rows, run directory and checkpoint agree, and summary.json says why."""
    done = bdsgd(
        "train", "--workers", "2", "--iterations", "1000", "--policy", "full",
        "--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "run"),
        "--batch-size", "8", *flags, "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    n = summary["iterations"]
    assert 1 <= n <= 2
    its = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert its["iteration"] == list(range(n))
    if stopped == "target":
        assert summary["time_to_loss"] == its["wall_s"][0]
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["stopped"] == stopped and not written["interrupted"]
    rows = TraceStore(tmp_path / "traces").read()
    expected = [(t, w) for t in range(n) for w in (0, 1)]
    assert sorted(zip(rows["iteration"], rows["worker"], strict=True)) == expected
    state = torch.load(checkpoint_of(tmp_path / "run"), weights_only=True)
    assert state["next_iteration"] == n  # a resumed run continues right after the last row


def test_resume_after_the_server_is_killed(tmp_path):
    proc = start_train(tmp_path, iterations=80)
    try:
        wait_for_checkpoint(proc, tmp_path / "run")
        workers = [p for p in children_of(proc.pid) if running(p)]
        assert len(workers) >= 3
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not any(map(running, workers)), 15, "workers to exit")
        _, err = proc.communicate(timeout=15)
        assert "bdsgd worker" not in err  # a peer's or the engine's death is not theirs to tell
    finally:
        kill_session(proc)
    (tmp_path / "run").rename(tmp_path / "moved")  # resumed where it is, not where it was
    done = bdsgd("train", "--resume", str(tmp_path / "moved"), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["iterations"] == 80 and not (tmp_path / "run").exists()
    rows = TraceStore(tmp_path / "traces").read()  # validates: no duplicate cells
    assert rows["run_id"].unique().to_list() == [summary["run_id"]]
    cells = set(zip(rows["iteration"], rows["worker"], strict=True))
    assert cells == {(t, w) for t in range(80) for w in range(3)}  # nothing lost, nothing twice
    its = pq.read_table(tmp_path / "moved" / "iterations.parquet").to_pydict()
    assert its["iteration"] == list(range(80))


def test_resume_of_a_learning_policy_continues_warm(tmp_path):
    """ewma, worker 2 always 50x slower. A cold ewma waits for everyone (it knows nothing yet);
    the resumed one is fed the run's rows first, so it cuts worker 2 from its first iteration."""
    replay = write_replay_trace(tmp_path / "replay", [[0.01, 0.01, 0.5]])
    proc = start_train(tmp_path, iterations=60, policy="ewma", stragglers=f"replay:{replay}")
    try:
        wait_for_checkpoint(proc, tmp_path / "run")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        kill_session(proc)
    state = torch.load(checkpoint_of(tmp_path / "run"), weights_only=True)
    written = TraceStore(tmp_path / "traces").read()["iteration"].max() + 1
    resumed_at = max(state["next_iteration"], written)
    done = bdsgd("train", "--resume", str(tmp_path / "run"), "--json")
    assert done.returncode == 0, done.stderr
    its = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert its["iteration"] == list(range(60)) and 25 <= resumed_at < 60
    assert its["c"][0] == 3  # the cold start waited for every worker
    assert its["c"][resumed_at] == 2  # the resumed policy remembered worker 2
    assert its["policy"][resumed_at] == "ewma"


def test_ctrl_c_keeps_what_was_written(tmp_path):
    proc, stderr, workers = interrupt_train(tmp_path, "static:2")
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("error:")
    assert "Traceback" not in stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    its = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert summary["interrupted"] and 25 <= summary["iterations"] < 400
    assert its["iteration"] == list(range(summary["iterations"]))
    rows = TraceStore(tmp_path / "traces").read()
    assert rows["iteration"].max() == summary["iterations"] - 1
    wait_until(lambda: not any(map(running, workers)), 10, "no process left behind")


@pytest.mark.parametrize(
    ("engine_policy", "sigint_ignored"),
    [("static:2", False), ("adasync", False), ("static:2", True)],
)
def test_sigterm_to_the_process_group_stops_the_run_as_ctrl_c_does(
    tmp_path, engine_policy, sigint_ignored
):
    """A scheduler's preemption: SIGTERM to every process of the run. The workers outlive it
    (they ignore it) until the engine stops them, the run is recorded whole, exit 143, and it
    resumes. Also where SIGINT is ignored (a shell script's background job), where a relayed
    SIGINT would be lost."""
    proc, stderr, workers = interrupt_train(tmp_path, engine_policy, signum=signal.SIGTERM,
                                            sigint_ignored=sigint_ignored)  # fmt: skip
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)")
    assert "Traceback" not in stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    its = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert summary["interrupted"] and summary["dead_workers"] == {}  # no worker died of it
    assert 25 <= summary["iterations"] < 400
    assert its["iteration"] == list(range(summary["iterations"]))
    wait_until(lambda: not any(map(running, workers)), 10, "no process left behind")
    more = str(summary["iterations"] + 5)
    done = bdsgd("train", "--resume", str(tmp_path / "run"), "--iterations", more, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["iterations"] == int(more)


def test_a_huge_iteration_count_runs_until_ctrl_c(tmp_path):
    """--iterations 1e13 of a synthetic cluster: the workers draw their delays as they go (up
    front it was 5 x T x N floats each), so they run, and Ctrl-C ends the run cleanly."""
    proc, stderr, workers = interrupt_train(
        tmp_path, "static:2", iterations=10**13, stragglers="synthetic:base_s=0.002"
    )
    assert proc.returncode == 130, stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] and summary["iterations"] >= 25
    assert summary["dead_workers"] == {}  # no worker crashed
    wait_until(lambda: not any(map(running, workers)), 10, "no process left behind")


# -- asynchronous policies --------------------------------------------------------------------
def test_async_ctrl_c_keeps_what_was_written_and_resumes(tmp_path):
    """adasync under Ctrl-C, then --resume for ten more updates (with the JSON contract)."""
    proc, stderr, workers = interrupt_train(tmp_path, "adasync")
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    done_before = summary["iterations"]
    assert summary["interrupted"] and 25 <= done_before < 400
    its = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert its["iteration"] == list(range(done_before))
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.filter(~pl.col("censored")).height >= sum(its["c"])
    wait_until(lambda: not any(map(running, workers)), 10, "no process left behind")

    more = str(done_before + 10)
    done = bdsgd("train", "--resume", str(tmp_path / "run"), "--iterations", more, "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary) - {"run_id"} == SPEC_KEYS
    assert summary["policy"] == "adasync" and summary["iterations"] == done_before + 10
    assert summary["throughput"] > 0 and math.isfinite(summary["final_loss"])
    its = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert its["iteration"] == list(range(done_before + 10))
    assert all(s is not None and s >= 0 for s in its["staleness"])
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["mean_staleness"] == pytest.approx(sum(its["staleness"]) / len(its["c"]))
    rows = TraceStore(tmp_path / "traces").read()  # validates: no computation written twice
    assert rows["run_id"].unique().to_list() == [summary["run_id"]]
    for w in range(3):  # each worker's computations numbered without a gap across the resume
        js = sorted(rows.filter(pl.col("worker") == w)["iteration"].to_list())
        assert js == list(range(len(js)))
