"""Run harness attempts as Kubernetes Jobs: render, create, follow, time out, clean up.

Why: harnesses that need their own image or sandbox run in a cluster; everything else (identity,
retries, rewards, the rollouts table) stays in the batch runner, which sees this runner through the
same ``run(job, cancel) -> AttemptOutcome`` call as the local one.

One Job per attempt, rendered from a Jinja2 YAML template (task fields usable as ``{{ task.x }}``),
then made safe by the launcher: ``backoffLimit: 0`` (retries are new attempts, not pod restarts),
``restartPolicy: Never``, ``activeDeadlineSeconds`` = timeout, a TTL as a safety net, labels, the
Contract 2 environment in every container, and a Secret (task.json + CA bundle, mounted at
``/lightning/in``, plus every environment value that carries the proxy token or the API key, read
through ``secretKeyRef`` so the Job spec holds no secret) with scratch space at ``/lightning/out``.
The harness reaches the proxy at ``proxy_host``. Not exercised against a live cluster here (see docs/LAUNCH.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from lightning_harness.proxy.client import SECRET_VARS

from .local import MAX_LOG_BYTES, AttemptJob, AttemptOutcome, trim_to_tail, utcnow
from .proxy_link import ProxyLink

IN_DIR = "/lightning/in"
OUT_DIR = "/lightning/out"
LABEL_PREFIX = "lightning-harness.io"
_DNS = re.compile(r"[^a-z0-9-]+")
_LABEL = re.compile(r"[^A-Za-z0-9._-]+")
# waiting reasons after which a pod will not start by itself: fail the attempt now, not at the timeout
FATAL_WAITING = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError"}


class K8sTemplateError(ValueError):
    """The Job template cannot be rendered into a usable Job (message says why)."""

    def __init__(self, message: str, *, undefined: bool = False) -> None:
        super().__init__(message)
        self.undefined = undefined  # a task field the template needs is missing from this task


def job_name(rollout_id: str, attempt: int, prefix: str = "lh") -> str:
    """A DNS-1123 name (<= 63 chars, lowercase) unique per attempt; a hash keeps cut names distinct."""
    digest = hashlib.sha1(f"{rollout_id}~{attempt}".encode()).hexdigest()[:8]
    base = _DNS.sub("-", rollout_id.lower()).strip("-")
    head = f"{prefix}-"
    tail = f"-{attempt}-{digest}"
    base = base[: 63 - len(head) - len(tail)].strip("-")
    return f"{head}{base}{tail}" if base else f"{head.rstrip('-')}{tail}"


def label_value(text: str) -> str:
    value = _LABEL.sub("_", text)[:63].strip("._-")
    return value or "x"


def secret_key(env_name: str) -> str:
    return f"env.{env_name}"


def _env_list(env: Mapping[str, str], secret: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k, v in env.items():
        if secret and k in SECRET_VARS:
            out.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": secret_key(k)}}})
        else:
            out.append({"name": k, "value": str(v)})
    return out


def _command(command: Sequence[str] | str | None) -> list[str] | None:
    """The container's command: argv as given, a string through ``/bin/sh -c``, nothing for the image's own."""
    if isinstance(command, (list, tuple)):
        return list(command)
    return ["/bin/sh", "-c", command] if command else None


def render_job(
    template: str,
    *,
    job: AttemptJob,
    name: str,
    namespace: str,
    timeout: float | None,
    ttl_seconds: int = 600,
    secret: str | None = None,
) -> dict[str, Any]:
    """Render the template for one attempt and apply the launcher's rules; returns the Job as a dict."""
    task = json.loads(job.task_json or "{}")
    variables = {
        "task": task,
        "rollout_id": job.rollout_id,
        "attempt": job.attempt,
        "job_name": name,
        "namespace": namespace,
        "timeout": timeout,
        "env": dict(job.env),
        "command": _command(job.command),
        **job.labels,
    }
    try:
        text = jinja2.Environment(undefined=jinja2.StrictUndefined,
                                  keep_trailing_newline=True).from_string(template).render(**variables)
    except jinja2.UndefinedError as exc:
        raise K8sTemplateError(f"Job template uses an undefined value: {exc}", undefined=True) from None
    except jinja2.TemplateError as exc:
        raise K8sTemplateError(f"Job template: {exc}") from None
    try:
        manifest = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise K8sTemplateError(f"Job template does not render to YAML: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "Job":
        raise K8sTemplateError("Job template must render to one object with kind: Job")
    manifest.setdefault("apiVersion", "batch/v1")
    meta = manifest.setdefault("metadata", {}) or {}
    manifest["metadata"] = meta
    meta.update(name=name, namespace=namespace)
    labels = {
        f"{LABEL_PREFIX}/rollout": label_value(job.rollout_id),
        f"{LABEL_PREFIX}/attempt": str(job.attempt),
        **{f"{LABEL_PREFIX}/{k.replace('_', '-')}": label_value(str(v)) for k, v in job.labels.items()},
    }
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["annotations"] = {**(meta.get("annotations") or {}), f"{LABEL_PREFIX}/rollout-id": job.rollout_id}
    spec = manifest.setdefault("spec", {}) or {}
    manifest["spec"] = spec
    spec["backoffLimit"] = 0
    if timeout:
        spec["activeDeadlineSeconds"] = max(1, int(round(timeout)))
    spec.setdefault("ttlSecondsAfterFinished", ttl_seconds)
    pod = spec.setdefault("template", {}) or {}
    spec["template"] = pod
    pod_meta = pod.setdefault("metadata", {}) or {}
    pod["metadata"] = pod_meta
    pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **labels}
    pod_spec = pod.get("spec")
    if not isinstance(pod_spec, dict) or not pod_spec.get("containers"):
        raise K8sTemplateError("Job template needs spec.template.spec.containers with at least one container")
    pod_spec["restartPolicy"] = "Never"
    # the harness runs model-written commands: no API credential of the cluster unless the template asks
    pod_spec.setdefault("automountServiceAccountToken", False)
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") not in ("lightning-in", "lightning-out")]
    if secret:
        items = [{"key": k, "path": k} for k in sorted(job.files)]  # files only, not the env.* keys
        volumes.append({"name": "lightning-in",
                        "secret": {"secretName": secret, **({"items": items} if items else {})}})
    volumes.append({"name": "lightning-out", "emptyDir": {}})
    pod_spec["volumes"] = volumes
    for i, c in enumerate(pod_spec["containers"]):
        if not isinstance(c, dict) or not c.get("name") or not c.get("image"):
            raise K8sTemplateError(f"container {i} of the Job template needs a name and an image")
        ours = set(job.env)
        c["env"] = [e for e in c.get("env") or [] if e.get("name") not in ours] + _env_list(job.env, secret)
        mounts = [m for m in c.get("volumeMounts") or [] if m.get("name") not in ("lightning-in", "lightning-out")]
        if secret:
            mounts.append({"name": "lightning-in", "mountPath": IN_DIR, "readOnly": True})
        mounts.append({"name": "lightning-out", "mountPath": OUT_DIR})
        c["volumeMounts"] = mounts
    first = pod_spec["containers"][0]
    if variables["command"] and not first.get("command") and not first.get("args"):
        first["command"] = variables["command"]
    if not first.get("command") and not first.get("args"):
        # the image's entrypoint runs; fine, but say so in the manifest for whoever reads it
        meta["annotations"][f"{LABEL_PREFIX}/command"] = "image entrypoint"
    return manifest


@dataclass
class JobPhase:
    """What a Job's status means for the attempt."""

    state: str  # 'pending', 'running', 'succeeded', 'failed', 'deadline'
    exit_code: int | None = None
    reason: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in ("succeeded", "failed", "deadline")


def _get(obj: Any, *names: str) -> Any:
    """Attribute access that also works on plain dicts (camelCase or snake_case)."""
    for name in names:
        if obj is None:
            return None
        if isinstance(obj, dict):
            camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)
            obj = obj.get(name, obj.get(camel))
        else:
            obj = getattr(obj, name, None)
    return obj


def _harness_container_status(pods: Sequence[Any], container: str | None) -> Any:
    """The status of the harness container in the newest pod (the last listed that has it)."""
    found = None
    for pod in pods or []:
        found = next((cs for cs in _get(pod, "status", "container_statuses") or []
                      if container is None or _get(cs, "name") == container), found)
    return found


def job_phase(job: Any, pods: Sequence[Any] = (), container: str | None = None) -> JobPhase:
    """Map a V1Job (and its pods) to a JobPhase. Works on kubernetes model objects or dicts."""
    status = _get(job, "status")
    cs = _harness_container_status(pods, container)
    terminated = _get(cs, "state", "terminated")
    exit_code = _get(terminated, "exit_code")
    term_reason = _get(terminated, "reason")
    for cond in _get(status, "conditions") or []:
        if str(_get(cond, "status")) != "True":
            continue
        ctype, reason, msg = _get(cond, "type"), _get(cond, "reason"), _get(cond, "message")
        if ctype == "Complete":
            return JobPhase("succeeded", 0 if exit_code is None else exit_code, reason)
        if ctype in ("Failed", "FailureTarget"):
            if reason == "DeadlineExceeded":
                return JobPhase("deadline", exit_code, f"DeadlineExceeded: {msg}" if msg else "DeadlineExceeded")
            detail = ": ".join(x for x in (reason, term_reason, msg) if x)
            return JobPhase("failed", exit_code, detail or "job failed")
    if (_get(status, "succeeded") or 0) >= 1:
        return JobPhase("succeeded", 0 if exit_code is None else exit_code)
    if (_get(status, "failed") or 0) >= 1:
        return JobPhase("failed", exit_code, term_reason or "pod failed")
    waiting = _get(cs, "state", "waiting")
    if waiting is not None and _get(waiting, "reason") in FATAL_WAITING:
        return JobPhase("failed", None,
                        f"pod cannot start: {_get(waiting, 'reason')}: {_get(waiting, 'message') or ''}".rstrip(": "))
    if (_get(status, "active") or 0) >= 1 or _get(cs, "state", "running") is not None:
        return JobPhase("running", None)
    return JobPhase("pending", None)


class K8sRunner:
    """Attempt runner that creates one Job per attempt with the ``kubernetes`` client.

    ``template`` is the template text (or a Path to read). ``batch_api`` / ``core_api`` default to
    ``BatchV1Api()`` / ``CoreV1Api()`` after loading the kube config (in-cluster first, then
    ``~/.kube/config``). ``proxy_host`` is how pods reach the proxy (its listeners must bind an
    address they can reach, e.g. ``--proxy-listen 0.0.0.0``).
    """

    name = "k8s"

    def __init__(
        self,
        template: str | Path,
        *,
        namespace: str = "default",
        proxy_host: str | None = None,
        batch_api: Any = None,
        core_api: Any = None,
        poll_interval: float = 2.0,
        deadline_slack: float = 30.0,
        keep: bool = False,
        ttl_seconds: int = 600,
        log_tail_lines: int = 2000,
        max_log_bytes: int = MAX_LOG_BYTES,
    ) -> None:
        self.template = template.read_text() if isinstance(template, Path) else str(template)
        self.namespace = namespace
        self.proxy_host = proxy_host
        self.poll_interval = poll_interval
        self.deadline_slack = deadline_slack
        self.keep = keep
        self.ttl_seconds = ttl_seconds
        self.log_tail_lines = log_tail_lines
        self.max_log_bytes = max_log_bytes
        self._batch, self._core = batch_api, core_api
        self._api_lock = threading.Lock()
        # fail on a broken template now, not in the middle of a batch
        probe = AttemptJob("probe", 0, ["true"], {}, Path("."), Path("."), task_json="{}")
        try:
            render_job(self.template, job=probe, name="probe", namespace=namespace, timeout=None)
        except K8sTemplateError as exc:
            if not exc.undefined:  # task fields are unknown to the probe
                raise

    # -- what the batch runner asks before building the environment ------------------------------
    def harness_paths(self, workdir: Path) -> dict[str, str]:
        return {"task_file": f"{IN_DIR}/task.json", "reward_file": f"{OUT_DIR}/reward.json", "output_dir": OUT_DIR}

    def proxy_view(self, link: ProxyLink) -> ProxyLink:
        host = self.proxy_host
        if host is None:
            raise RuntimeError("the k8s runner needs proxy_host (--k8s-proxy-host): pods cannot reach 127.0.0.1 of "
                               "this machine")
        return link.with_host(host, ca_bundle=f"{IN_DIR}/ca-bundle.pem")

    # -- API -------------------------------------------------------------------------------------
    def _apis(self) -> tuple[Any, Any]:
        with self._api_lock:
            if self._batch is None or self._core is None:
                from kubernetes import client, config

                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
                self._batch = self._batch or client.BatchV1Api()
                self._core = self._core or client.CoreV1Api()
        return self._batch, self._core

    def run(self, job: AttemptJob, cancel: threading.Event) -> AttemptOutcome:
        batch, core = self._apis()
        name = job_name(job.rollout_id, job.attempt)
        started = utcnow()
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            manifest = render_job(self.template, job=job, name=name, namespace=self.namespace,
                                  timeout=job.timeout, ttl_seconds=self.ttl_seconds, secret=name)
        except K8sTemplateError as exc:
            return AttemptOutcome(None, started, utcnow(), error=str(exc), reward_file_local=False)
        (job.workdir / "job.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))  # no secrets in it
        container = manifest["spec"]["template"]["spec"]["containers"][0]["name"]
        data = {k: Path(p).read_text() for k, p in job.files.items()}
        data.update({secret_key(k): str(v) for k, v in job.env.items() if k in SECRET_VARS})
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "stringData": data,
                  "metadata": {"name": name, "namespace": self.namespace, "labels": manifest["metadata"]["labels"]}}
        try:
            core.create_namespaced_secret(self.namespace, secret)
            batch.create_namespaced_job(self.namespace, manifest)
        except Exception as exc:  # ApiException or connection errors: the attempt fails, the batch goes on
            self._cleanup(batch, core, name)
            return AttemptOutcome(None, started, utcnow(), error=f"could not create Job {name}: {_api_error(exc)}",
                                  reward_file_local=False)

        deadline = None if not job.timeout else time.monotonic() + job.timeout + self.deadline_slack
        phase = JobPhase("pending")
        timed_out = cancelled = False
        errors = 0
        try:
            while True:
                try:
                    obj = batch.read_namespaced_job_status(name, self.namespace)
                    pods = core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}").items
                    phase = job_phase(obj, pods, container)
                    errors = 0
                except Exception as exc:
                    errors += 1
                    if errors >= 10:
                        phase = JobPhase("failed", None, f"lost track of Job {name}: {_api_error(exc)}")
                if phase.terminal:
                    break
                if cancel.is_set():
                    cancelled = True
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                cancel.wait(self.poll_interval)
            self._fetch_logs(core, name, container, job.log_path)
        finally:
            if not self.keep:
                self._cleanup(batch, core, name)
        ended = utcnow()
        timed_out = timed_out or phase.state == "deadline"
        error = None
        if phase.state == "deadline":
            deadline = manifest["spec"].get("activeDeadlineSeconds")
            error = f"timed out: Job {name} {phase.reason} (activeDeadlineSeconds {deadline})"
        elif timed_out:
            error = f"timed out after {job.timeout:g}s; Job {name} deleted"
        elif cancelled:
            error = f"cancelled; Job {name} deleted"
        elif phase.state == "failed":
            code = f"exit code {phase.exit_code}" if phase.exit_code is not None else "no exit code"
            error = f"{code}; {phase.reason}" if phase.reason else code
        exit_code = phase.exit_code
        if phase.state == "succeeded":
            exit_code = exit_code or 0
        elif exit_code == 0:
            exit_code = None  # a failed Job whose container said 0 (e.g. killed by the deadline) did not succeed
        return AttemptOutcome(exit_code, started, ended, timed_out=timed_out, cancelled=cancelled, error=error,
                              reward_file_local=False)

    def _fetch_logs(self, core: Any, name: str, container: str, log_path: Path) -> None:
        try:
            pods = core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}").items
            with open(log_path, "ab") as fh:
                for pod in pods:
                    pod_name = _get(pod, "metadata", "name")
                    text = core.read_namespaced_pod_log(pod_name, self.namespace, container=container,
                                                        tail_lines=self.log_tail_lines,
                                                        limit_bytes=8 * self.max_log_bytes)  # a bound in memory
                    fh.write(f"[lightning] pod {pod_name}\n".encode())
                    fh.write(text.encode() if isinstance(text, str) else (text or b""))
        except Exception as exc:
            with open(log_path, "ab") as fh:
                fh.write(f"[lightning] could not read pod logs: {_api_error(exc)}\n".encode())
        trim_to_tail(log_path, self.max_log_bytes)

    def _cleanup(self, batch: Any, core: Any, name: str) -> None:
        for call in (lambda: batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background"),
                     lambda: core.delete_namespaced_secret(name, self.namespace)):
            try:
                call()
            except Exception:
                pass  # already gone, or the TTL controller will collect it


def _api_error(exc: Exception) -> str:
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return repr(exc)
