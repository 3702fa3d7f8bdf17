"""What wakes the supervisor's loop besides its children: SIGINT and SIGTERM, and a
request from another thread (a lost node), both through one socket that the loop waits
on beside the children's pipes and sentinels (no sleep-polling)."""

from __future__ import annotations

import signal
import socket
import threading
from typing import Callable


class Wakeup:
    """A socket pair: ``reader`` for ``multiprocessing.connection.wait``; ``poke`` and the
    signals write to the other end. Signal handlers are installed only from the main
    thread (where Python runs them) and restored by ``close``."""

    def __init__(self, on_signal: Callable[[str], None]):
        self.reader, self._writer = socket.socketpair()
        self._restore: list[Callable[[], None]] = []
        if threading.current_thread() is not threading.main_thread():
            return
        self._writer.setblocking(False)
        old_fd = signal.set_wakeup_fd(self._writer.fileno())
        old = {s: signal.signal(s, lambda signum, _f: on_signal(signal.Signals(signum).name))
               for s in (signal.SIGINT, signal.SIGTERM)}
        self._restore = [lambda: signal.set_wakeup_fd(old_fd), *(lambda s=s, h=h: signal.signal(s, h)
                                                                 for s, h in old.items())]

    def poke(self) -> None:
        """Wake the loop, from any thread; a no-op once closed."""
        try:
            self._writer.send(b"!")
        except OSError:
            pass

    def drain(self) -> None:
        """Forget what woke it (so that the next signal is a new one)."""
        self.reader.setblocking(False)
        try:
            while self.reader.recv(512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self.reader.close()
        self._writer.close()
