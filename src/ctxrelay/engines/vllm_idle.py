"""vLLM's idle spin, capped for CPUs the engine shares with ctxrelay's router.

After each step vLLM's worker busy-waits on its shared-memory queue (`sched_yield` in a loop) for one second
before it sleeps on a socket (`shm_broadcast.SpinCondition.busy_loop_s`). On a GPU host that costs a spare
core; on a 2-core CPU host it takes one of the two cores the router's relay compute runs on, right when a
relayed turn follows another turn: measured on the AMD EPYC, the router's matmuls ran 2x slower for the
second after every engine request. Steps under load follow each other within milliseconds, so a short
spin keeps vLLM's hand-off fast where it matters. Loaded in the engine's processes with the connector;
`CTXRELAY_ENGINE_IDLE_SPIN_S` sets the cap (vllm_params.cpu_engine_env sets it; unset or < 0: vLLM's own).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
ENV = "CTXRELAY_ENGINE_IDLE_SPIN_S"


def cap_idle_spin() -> float | None:
    """Cap the worker's busy-wait at $CTXRELAY_ENGINE_IDLE_SPIN_S seconds; returns the cap applied, or None."""
    try:
        cap = float(os.environ.get(ENV, "-1"))
    except ValueError:
        log.warning("%s must be a number of seconds; vLLM's idle spin left as it is", ENV)
        return None
    if cap < 0:
        return None
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return None
    cls = getattr(shm_broadcast, "SpinCondition", None)
    wait = getattr(cls, "wait", None)
    if wait is None or getattr(wait, "ctxrelay_cap", None) is not None:
        return None  # another vLLM layout, or capped already

    def capped_wait(self, timeout_ms: int | None = None) -> None:
        if getattr(self, "is_reader", False) and getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        return wait(self, timeout_ms)

    capped_wait.ctxrelay_cap = cap  # type: ignore[attr-defined]
    cls.wait = capped_wait
    return cap
