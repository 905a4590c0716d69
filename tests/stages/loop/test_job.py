"""A rank's failure line for the launcher (stages/loop/job.py)."""

from bdsgd.stages.loop.job import collective_timeout_line

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
        "Timed out waiting 60000ms for send operation to complete")  # fmt: skip


def test_a_gloo_timeout_names_the_timeout_and_what_to_do():
    line = collective_timeout_line(RuntimeError(GLOO), 60.0)
    assert line is not None
    assert "--timeout (60 s)" in line and "raise --timeout" in line
    assert "unbound_buffer" not in line and "\n" not in line


def test_another_error_is_left_to_its_own_line():
    assert collective_timeout_line(ValueError("shapes do not match"), 60.0) is None
