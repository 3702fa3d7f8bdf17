"""What an actor's death means: restart it, give up on the job, or raise to the caller.

Per actor, as Ray Train's failure policy maps an error to a decision:
  * RESTART: Erlang's ``one_for_one``, the dead actor is restarted alone;
  * GIVE_UP: Erlang's restart intensity, more than ``max_restarts`` deaths within any
    ``window_s`` seconds: a crash loop, which fails the job;
  * RAISE: the actor died of an ``actor.Escalate`` or ``messages.ProtocolError`` error,
    which no restart can fix; the
    job stops and its caller gets the exception.
"""

from __future__ import annotations

import collections
import enum
from typing import Optional

from .messages import ActorError


class Decision(enum.Enum):
    RESTART = "restart"
    GIVE_UP = "give_up"
    RAISE = "raise"


class RestartPolicy:
    """Per actor: what its death means. An error the actor reported as ``raised``
    (``Escalate``, ``ProtocolError``) goes to the caller;
    otherwise Erlang's restart intensity: more than ``max_restarts`` deaths within any
    ``window_s`` seconds means give up."""

    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts, self.window_s = max_restarts, window_s
        self._deaths: collections.deque[float] = collections.deque()

    def decide(self, now: float, error: Optional[ActorError]) -> Decision:
        """Record a death at ``now`` (``error``: what the actor reported, if anything)."""
        if error is not None and error.raised is not None:
            return Decision.RAISE
        self._deaths.append(now)
        while now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        return Decision.RESTART if len(self._deaths) <= self.max_restarts else Decision.GIVE_UP

    @property
    def recent(self) -> int:
        return len(self._deaths)
