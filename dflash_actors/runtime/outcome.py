"""How a supervised run ended: its state, reason and exit code, the batches committed and
the restarts. What the supervisor returns and its callers (the job, the tests) read,
without needing the supervisor itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class JobState(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class JobResult:
    state: JobState
    reason: str
    """``finished``, the signal name, or the one-line error."""
    traceback: Optional[str] = None
    committed: list[int] = field(default_factory=list)
    """Batch ids in the order the last stage committed them."""
    restarts: dict[str, int] = field(default_factory=dict)
    raised: Optional[BaseException] = None
    """The ``Escalate`` or ``ProtocolError`` that stopped the job (decision RAISE), for the caller."""

    @property
    def exit_code(self) -> int:
        return {JobState.DONE: 0, JobState.STOPPED: 130}.get(self.state, 1)
