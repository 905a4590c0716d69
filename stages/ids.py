"""Run ids: one name for a profile, train, import or loop run in the traces."""

from __future__ import annotations

import time
import uuid


def new_run_id(source: str) -> str:
    """A sortable, unique run id such as ``profile-20261121T213900-1a2b3c``."""
    return f"{source}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
