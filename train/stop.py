"""SIGTERM, and SIGINT (Ctrl-C) alike: the loop stops at the next step boundary, saves if a
step was done since the last checkpoint, and exits 0.

The handler only sets a flag (no KeyboardInterrupt: a save in flight finishes, and the
asynchronous checkpointer closes cleanly). Everything that waits on the data pipeline goes
through `StopRequest.call`, which runs the wait in a helper thread and watches the flag
while it waits, so a read that never returns (a stalled file system) cannot keep a stop
waiting.
The processes of a job agree at each such call: a stop on any of them stops all at the
same step. A step or compilation in progress finishes first.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TypeVar, cast

from train import distributed
from train.config import ConfigError
from train.data.sources import BadRecord

T = TypeVar("T")
_POLL_S = 0.1  # how often a wait looks at the flag
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
  """SIGTERM or SIGINT arrived (on this process or another) before the awaited value."""


class StopRequest:
  """Installs the handler of `SIGNALS` until `close`; `requested` is set once one arrives,
  and `name` says which ("SIGTERM", "SIGINT"; a stop on another process of a job leaves
  it at "a stop on another process")."""

  def __init__(self):
    self.requested = False
    self.name = "a stop on another process"
    self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

  def _handle(self, signum, frame):
    del frame
    if not self.requested:
      self.name = signal.Signals(signum).name
    self.requested = True

  def close(self) -> None:
    """Puts back the handlers there were before."""
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def _wait(self, fn: Callable[[], T]) -> T:
    if self.requested:
      raise Stopped
    result = {}

    def target():
      try:
        result["value"] = fn()
      except BaseException as e:  # handed to the waiting thread
        result["error"] = e

    # A daemon thread: one left blocked after a stop does not keep the process alive.
    thread = threading.Thread(target=target, name="train-wait", daemon=True)
    thread.start()
    while thread.is_alive():
      thread.join(_POLL_S)
      if self.requested and thread.is_alive():
        raise Stopped
    if "error" in result:
      raise result["error"]
    return result["value"]

  def call(self, fn: Callable[[], T]) -> T:
    """`fn()`, unless a stop signal arrives first. Every process calls it at the same point
    and gets the same outcome.

    Raises:
      Stopped: SIGTERM or SIGINT arrived on any process (before or while waiting).
      ConfigError: `fn` raised one on any process (its own, or one naming no details on
        the others).
      BadRecord: `fn` read a document that is not the one listed (a corpus file changed
        under the run) on any process (its own, or one naming no details on the others);
        before a stop or a ConfigError: every process saves and exits alike.
    """
    value, error, outcome = None, None, 0
    try:
      value = self._wait(fn)
    except Stopped:
      outcome = 2
    except ConfigError as e:
      error, outcome = e, 1
    except BadRecord as e:
      error, outcome = e, 3
    outcome = distributed.process_max(outcome)
    if outcome == 3:
      raise error if isinstance(error, BadRecord) else BadRecord(
          "a file changed after the corpus was listed, read on another process (see its log)")
    if outcome == 2:
      raise Stopped
    if outcome == 1:
      raise error or ConfigError("the data check failed on another process; see its log.")
    return cast(T, value)  # outcome 0 on every process: _wait returned here
