"""Whether a replica's engine core still works, for Ray Serve's health check (`check_health`, called every
`health_check_period_s`; a raise marks the replica unhealthy and Serve replaces it).

A core is dead when it has stopped (shut down, or its stepping thread is gone: work waits and no step finishes),
stalled (it has work and no step has finished for `stall_timeout` seconds), or every model call fails (the last
`max_error_streak` engine requests all ended in a failed model call, none finishing normally in between: a broken
device or session). Uses only the engine's public state (accepting, stats, has_work) and the service's metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fxllm.errors import FxllmError


class EngineUnhealthy(FxllmError):
    """The replica should be replaced (one-line reason)."""


class EngineHealth:
    def __init__(self, service, stall_timeout: float = 60.0, max_error_streak: int = 8,
                 clock: Callable[[], float] = time.monotonic):
        self.service, self.stall_timeout, self.max_error_streak, self.clock = (service, stall_timeout,
                                                                                max_error_streak, clock)
        self._steps, self._progress_at = -1, clock()

    def check(self) -> None:
        """Raise EngineUnhealthy if the engine core is dead, stalled or failing every model call."""
        engine = self.service.engine
        if not engine.accepting:
            raise EngineUnhealthy("the engine core has stopped")
        now, steps = self.clock(), engine.stats().steps
        if steps != self._steps or not engine.driver.has_work():
            self._steps, self._progress_at = steps, now
        elif now - self._progress_at > self.stall_timeout:
            raise EngineUnhealthy(f"the engine core has had work but finished no step for "
                                  f"{now - self._progress_at:.0f} s")
        streak = self.service.metrics.error_streak
        if streak >= self.max_error_streak:
            raise EngineUnhealthy(f"the last {streak} requests all failed in the model call")
