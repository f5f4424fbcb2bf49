"""Is the capture complete? One check the trainer loop and the launcher run after a rollout phase.

Why: the proxy keeps serving (policy ``capture_failure: serve``) or rejects calls (``reject``)
while it cannot write spans; either way the rollouts of that phase may lack calls. Training on
them would silently learn from partial trajectories, so after each rollout phase the caller
flushes the proxy and stops with a clear error when its state (``GET /_lh/state``, Contract 3)
shows a storage failure or rows lost since the phase began.

Stdlib only, like ``client.py`` (the training environment imports it without mitmproxy).
"""

from __future__ import annotations

from typing import Any

# counters of /_lh/state that only grow when a captured row did not reach disk
LOSS_COUNTERS = ("rows_lost", "spans_dropped", "rewards_refused")


class CaptureUnhealthy(RuntimeError):
    """The proxy could not record everything of a rollout phase (message says what and why)."""


def capture_problem(state: dict[str, Any], baseline: dict[str, Any] | None = None) -> str | None:
    """What is wrong with the capture in ``state`` (None when complete).

    ``baseline``: the state when the phase began; losses before it are not this phase's. A proxy too
    old to report health (no ``healthy`` key) counts as healthy.
    """
    problems = []
    if state.get("healthy", True) is False:
        problems.append(
            f"spans cannot be written ({state.get('capture_error') or 'buffer full'}; "
            f"{state.get('write_failures', 0)} failed writes, {state.get('spans_pending', 0)} spans pending)"
        )
    for key in LOSS_COUNTERS:
        grew = int(state.get(key) or 0) - int((baseline or {}).get(key) or 0)
        if grew > 0:
            problems.append(f"{grew} {key.replace('_', ' ')}")
    if not problems:
        return None
    return "capture proxy incomplete: " + "; ".join(problems) + " (see the proxy log and /_lh/state)"


def capture_baseline(control: Any) -> dict[str, Any] | None:
    """The proxy's state now, as the baseline of a phase (None if it cannot be read)."""
    try:
        return control.state(timeout=10)
    except Exception:
        return None


def require_capture(control: Any, baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Flush the proxy (``ProxyControl``), then raise :class:`CaptureUnhealthy` if the capture of
    the phase is incomplete. Returns the state (the next phase's baseline)."""
    state = control.flush()
    problem = capture_problem(state, baseline)
    if problem:
        raise CaptureUnhealthy(problem)
    return state
