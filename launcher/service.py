"""A harness service: one long-lived helper that a run's harness commands talk to over a Unix socket.

Why: a harness process per rollout is the contract, but some agents cost seconds of CPU just to
import (mini-swe-agent: ~5 s, mostly litellm), more than the rollout itself on a small machine. A
service keeps the agent imported; each rollout's command stays a separate, attributed process (its
own proxy credential, folder, log, timeout and kill), only lighter: it hands its task and its
``OPENAI_BASE_URL`` to the service and waits for the answer.

The service gets what a harness gets of the launcher's environment (``launcher_env``: no
credentials of the launcher's, no rollout identity, no proxy credential), the run's ``--env`` and
``--pass-env`` variables, and ``LIGHTNING_HARNESS_SERVICE``, the socket path it must listen on;
every harness gets the same variable. It starts once, before the first rollout, in its own
session, and its group is ended when the run stops. What the service runs for a rollout is still
bound by that rollout's credential: the proxy refuses it once the attempt has ended.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Mapping
from typing import Any

from lightning_harness.process import direct_env, exit_code, log_tail, start_in_session, stop_group, wait_ready

from .local import launcher_env

SERVICE_VAR = "LIGHTNING_HARNESS_SERVICE"


class HarnessService:
    """``command`` (argv list or shell line) run in ``cwd``, ready once ``socket_path`` accepts."""

    def __init__(self, command: Any, *, cwd: str | os.PathLike, log_path: str | os.PathLike,
                 env: Mapping[str, str] | None = None) -> None:
        self.argv = ["/bin/sh", "-c", command] if isinstance(command, str) else [str(a) for a in command]
        self.cwd = str(cwd)
        # in a fresh folder only its owner can enter (a socket path must also stay under ~108 bytes)
        self.socket_path = os.path.join(tempfile.mkdtemp(prefix="lightning-service-"), "harness.sock")
        self.log_path = str(log_path)
        self.extra_env = dict(env or {})  # what the harnesses get besides Contract 2 (--env, --pass-env)
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What every harness of the run gets in addition to its own variables."""
        return {SERVICE_VAR: self.socket_path}

    def start(self, timeout: float = 120.0) -> HarnessService:
        env = direct_env(launcher_env({**self.extra_env, **self.env}))
        self.process = start_in_session(self.argv, self.log_path, env, cwd=self.cwd)
        try:
            wait_ready(self._accepts, timeout, what="harness service", proc=self.process, log_path=self.log_path)
        except Exception:
            self.stop()
            raise
        return self

    def _accepts(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(self.socket_path)  # (a probe: the service sees a connection that sends nothing)
        return True

    def check(self) -> str | None:
        """Why the service can serve no rollout (it exited), else None: a batch's ``health_check``. Every
        rollout after a dead service fails at once (its harness cannot connect), so a run must stop
        with this reason rather than go on failing them."""
        code = exit_code(self.process) if self.process is not None else None
        if code is None:
            return None
        return f"the harness service exited with code {code} (log {self.log_path}):\n{log_tail(self.log_path, 15)}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self, grace: float = 5.0) -> None:
        if self.process is not None:
            stop_group(self.process, grace)
        shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)
