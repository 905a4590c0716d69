"""A stop the command was asked for by SIGTERM (:func:`bdsgd_cli.common.sigterm_as_ctrl_c`),
for the blocks that defer Ctrl-C (:func:`bdsgd.stages.engine.base.interrupts_deferred`): where SIGINT
is ignored (a background job of a shell script) they drop a held SIGINT, but not this one."""

from __future__ import annotations

STOP_REQUESTED = [False]
