"""Run harness attempts as Kubernetes Jobs: render, create, follow, time out, clean up.

Why: harnesses that need their own image or sandbox run in a cluster; everything else (identity,
retries, rewards, the rollouts table) stays in the batch runner, which sees this runner through the
same ``run(job, cancel) -> AttemptOutcome`` call as the local one.

One Job per attempt, rendered from a Jinja2 YAML template (task fields usable as ``{{ task.x }}``).
Task text is hostile (a model may have written it): the YAML structure comes from the template text
and its ``{% %}`` blocks alone, and each ``{{ }}`` is one value put in after parsing, so no quote,
newline or ``{{`` in a task field can add a key (see :func:`_load_rendered`). Then the launcher's
rules: one pod run once (``backoffLimit: 0``, ``completions``/``parallelism`` 1, no pod failure policy,
suspend or selector: retries are new attempts), ``restartPolicy: Never``, ``activeDeadlineSeconds`` =
timeout, a TTL as a safety net, labels, no service account token and no privilege escalation unless
the template asks, the Contract 2 environment in every container, and a Secret (task.json + CA bundle,
mounted at ``/lightning/in``, plus every environment value other than the attempt's identity and
paths, read through ``secretKeyRef`` so the Job spec holds no secret) owned by the Job, with scratch
space at ``/lightning/out``. The harness reaches the proxy at ``proxy_host``. Not exercised against a
live cluster here (see docs/LAUNCH.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import markupsafe
import yaml

from lightning_harness.proxy.client import CA_VARS

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
# environment values that may stand in the Job spec (identity, paths, the public task row); all others
# (credentials in proxy URLs, API keys, --env, --pass-env) are read from the attempt's Secret
PUBLIC_VARS = frozenset({*CA_VARS, "NO_PROXY", "no_proxy", "LIGHTNING_TASK", "LIGHTNING_MODEL_VERSION",
                         *(f"LIGHTNING_{n}" for n in ("ROLLOUT_ID", "ATTEMPT", "RUN_ID", "TASK_ID", "GROUP_ID",
                                                      "SAMPLE_INDEX", "SPLIT", "STEP", "TASK_FILE", "REWARD_FILE",
                                                      "OUTPUT_DIR"))})
# Job fields that would run the pod more than once or hand it other pods: dropped from the template
JOB_SPEC_DROPPED = ("suspend", "selector", "manualSelector", "podFailurePolicy", "backoffLimitPerIndex",
                    "maxFailedIndexes", "successPolicy", "completionMode", "podReplacementPolicy")
JOB_NAME_LABELS = ("job-name", "controller-uid", "batch.kubernetes.io/job-name", "batch.kubernetes.io/controller-uid")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


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
    """The Secret key of an environment value (Secret keys allow fewer characters than env names)."""
    key = f"env.{env_name}"
    if _SECRET_KEY.fullmatch(key) and len(key) <= 253:
        return key
    return "env.x-" + hashlib.sha256(env_name.encode()).hexdigest()[:24]


def _env_list(env: Mapping[str, str], secret: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k, v in env.items():
        if secret and not is_public_var(k):
            out.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": secret_key(k)}}})
        else:
            out.append({"name": k, "value": str(v)})
    return out


def _command(command: Sequence[str] | str | None) -> list[str] | None:
    """The container's command: argv as given, a string through ``/bin/sh -c``, nothing for the image's own."""
    if isinstance(command, (list, tuple)):
        return list(command)
    return ["/bin/sh", "-c", command] if command else None


# -- rendering: the template makes the structure, task text only ever fills a value -------------------------
class _SlotLoader(yaml.SafeLoader):
    """YAML loader that puts each ``{{ }}`` value in place of its slot token once the structure is
    parsed: a plain scalar that is exactly one token becomes the value itself (a number stays a
    number, a list a list); any other scalar holding tokens (quoted, block, ``x-{{ y }}``) is text with
    each value's text in place. So no value, whatever it holds, can add a key or end a string."""

    slots: Mapping[str, Any] = {}
    token = re.compile(r"(?!)")

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        if isinstance(node, yaml.ScalarNode) and self.token.search(node.value):
            if node.style is None and self.token.fullmatch(node.value):
                return self.slots[node.value]
            return self.token.sub(lambda m: _text(self.slots[m.group(0)]), node.value)
        return super().construct_object(node, deep)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _slot_value(value: Any) -> Any:
    """The value an expression stands for: ``| tojson`` gives its JSON back as data (a template that
    quoted values that way keeps working); other markup (``| e``, ``| safe``) is just text."""
    if isinstance(value, markupsafe.Markup):
        try:
            return json.loads(value)
        except ValueError:
            return str(value)
    return value


def _load_rendered(template: str, variables: Mapping[str, Any]) -> Any:
    """Render with Jinja2, each ``{{ }}`` written as a random slot token, then parse the YAML and fill
    the slots (:class:`_SlotLoader`). ``{% %}`` blocks see the real values, so loops and conditions
    still shape the Job; task text can never become YAML syntax (keys, quotes, newlines, ``{{``)."""
    nonce = secrets.token_hex(8)
    slots: dict[str, Any] = {}

    def finalize(value: Any) -> str:
        if isinstance(value, jinja2.Undefined):
            str(value)  # StrictUndefined: raises UndefinedError naming the missing value
        token = f"lhslot{nonce}n{len(slots)}x"
        slots[token] = _slot_value(value)
        return token

    try:
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, finalize=finalize)
        text = env.from_string(template).render(**variables)
    except jinja2.UndefinedError as exc:
        raise K8sTemplateError(f"Job template uses an undefined value: {exc}", undefined=True) from None
    except jinja2.TemplateError as exc:
        raise K8sTemplateError(f"Job template: {exc}") from None
    loader = _SlotLoader(text)
    loader.slots, loader.token = slots, re.compile(f"lhslot{nonce}n[0-9]+x")
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise K8sTemplateError(f"Job template does not render to YAML: {exc}") from None
    finally:
        loader.dispose()


def _mapping(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """``parent[key]`` as a mapping (created if absent): a template error, not a traceback, otherwise."""
    value = parent.get(key)
    if value is None:
        value = parent[key] = {}
    if not isinstance(value, dict):
        raise K8sTemplateError(f"Job template: {where}{key} must be a mapping, got {type(value).__name__}")
    return value


def _entries(parent: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    """``parent[key]`` as a list of mappings (env, volumes, volumeMounts, containers)."""
    value = parent.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise K8sTemplateError(f"Job template: {where}{key} must be a list of mappings")
    return value


def is_public_var(name: str) -> bool:
    """Whether an environment value may stand in the Job spec: the attempt's identity and paths. Every
    other one (the attempt's credential, API keys, ``--env`` and ``--pass-env`` values) comes from the
    attempt's Secret, since anyone who can read Jobs (or the traces' ``job.yaml``) reads the spec."""
    return name in PUBLIC_VARS


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
    """Render the template for one attempt and apply the launcher's rules; returns the Job as a dict.

    With ``secret``, every environment value that is not :func:`is_public_var` is a ``secretKeyRef``
    into it, and the template's ``{{ env.X }}`` of such a value is ``$(X)`` (the kubelet expands it in
    ``command``/``args``), so the rendered Job holds no secret."""
    env = dict(job.env)
    variables = {
        "task": json.loads(job.task_json or "{}"),
        "rollout_id": job.rollout_id,
        "attempt": job.attempt,
        "job_name": name,
        "namespace": namespace,
        "timeout": timeout,
        "env": {k: v if not secret or is_public_var(k) else f"$({k})" for k, v in env.items()},
        "command": _command(job.command),
        **job.labels,
    }
    manifest = _load_rendered(template, variables)
    if not isinstance(manifest, dict) or manifest.get("kind") != "Job":
        raise K8sTemplateError("Job template must render to one object with kind: Job")
    manifest.setdefault("apiVersion", "batch/v1")
    labels = {
        f"{LABEL_PREFIX}/rollout": label_value(job.rollout_id),
        f"{LABEL_PREFIX}/attempt": str(job.attempt),
        **{f"{LABEL_PREFIX}/{k.replace('_', '-')}": label_value(str(v)) for k, v in job.labels.items()},
    }
    meta = _job_meta(manifest, name, namespace, labels, job.rollout_id)
    pod_spec = _job_spec(manifest, labels, timeout, ttl_seconds)
    _pod_rules(pod_spec, job, env, secret)
    first = pod_spec["containers"][0]
    if variables["command"] and not first.get("command") and not first.get("args"):
        first["command"] = variables["command"]
    if not first.get("command") and not first.get("args"):
        # the image's entrypoint runs; fine, but say so in the manifest for whoever reads it
        meta["annotations"][f"{LABEL_PREFIX}/command"] = "image entrypoint"
    return manifest


def _job_meta(manifest: dict[str, Any], name: str, namespace: str, labels: Mapping[str, str],
              rollout_id: str) -> dict[str, Any]:
    """The Job's name, namespace and labels are the launcher's (the template's other labels stay)."""
    meta = _mapping(manifest, "metadata", "")
    meta.update(name=name, namespace=namespace)
    meta.pop("generateName", None)
    meta["labels"] = {**_mapping(meta, "labels", "metadata."), **labels}
    meta["annotations"] = {**_mapping(meta, "annotations", "metadata."), f"{LABEL_PREFIX}/rollout-id": rollout_id}
    return meta


def _job_spec(manifest: dict[str, Any], labels: Mapping[str, str], timeout: float | None,
              ttl_seconds: int) -> dict[str, Any]:
    """One pod, run once, within the deadline: retries are new attempts with new credentials, so
    nothing in the template may re-run or multiply the pod (completions, parallelism, a pod failure
    policy that ignores failures, suspend, a selector that adopts other pods). Returns the pod spec."""
    spec = _mapping(manifest, "spec", "")
    for key in JOB_SPEC_DROPPED:
        spec.pop(key, None)
    spec.update(backoffLimit=0, completions=1, parallelism=1)
    if timeout:
        spec["activeDeadlineSeconds"] = max(1, int(round(timeout)))
    if spec.get("ttlSecondsAfterFinished") is None:  # the template may choose another TTL, not none
        spec["ttlSecondsAfterFinished"] = ttl_seconds
    pod = _mapping(spec, "template", "spec.")
    pod_meta = _mapping(pod, "metadata", "spec.template.")
    pod_labels = {k: v for k, v in _mapping(pod_meta, "labels", "spec.template.metadata.").items()
                  if k not in JOB_NAME_LABELS}  # the API server sets them: the runner finds its pods by them
    pod_meta["labels"] = {**pod_labels, **labels}
    pod_spec = pod.get("spec")
    if not isinstance(pod_spec, dict) or not pod_spec.get("containers"):
        raise K8sTemplateError("Job template needs spec.template.spec.containers with at least one container")
    return pod_spec


def _pod_rules(pod_spec: dict[str, Any], job: AttemptJob, env: Mapping[str, str], secret: str | None) -> None:
    """Never restarted, no cluster credential and no privilege escalation unless the template asks
    (the harness runs model-written commands), the attempt's environment in every container (over
    same-named template entries), its Secret at /lightning/in and scratch space at /lightning/out."""
    pod_spec["restartPolicy"] = "Never"
    pod_spec.setdefault("automountServiceAccountToken", False)
    ours_volumes = ("lightning-in", "lightning-out")
    volumes = [v for v in _entries(pod_spec, "volumes", "spec.template.spec.") if v.get("name") not in ours_volumes]
    if secret:
        items = [{"key": k, "path": k} for k in sorted(job.files)]  # files only, not the env.* keys
        volumes.append({"name": "lightning-in",
                        "secret": {"secretName": secret, **({"items": items} if items else {})}})
    volumes.append({"name": "lightning-out", "emptyDir": {}})
    pod_spec["volumes"] = volumes
    windows = (pod_spec.get("os") or {}).get("name") == "windows"  # where the field is refused
    for c in _entries(pod_spec, "initContainers", "spec.template.spec."):
        _no_escalation(c, windows)
    for i, c in enumerate(_entries(pod_spec, "containers", "spec.template.spec.")):
        where = f"spec.template.spec.containers[{i}]."
        if not c.get("name") or not c.get("image"):
            raise K8sTemplateError(f"container {i} of the Job template needs a name and an image")
        _no_escalation(c, windows)
        c["env"] = [e for e in _entries(c, "env", where) if e.get("name") not in env] + _env_list(env, secret)
        mounts = [m for m in _entries(c, "volumeMounts", where) if m.get("name") not in ours_volumes]
        if secret:
            mounts.append({"name": "lightning-in", "mountPath": IN_DIR, "readOnly": True})
        mounts.append({"name": "lightning-out", "mountPath": OUT_DIR})
        c["volumeMounts"] = mounts


def _no_escalation(container: dict[str, Any], windows: bool = False) -> None:
    """``allowPrivilegeEscalation: false`` (no setuid root from model-written commands) unless the
    template set it, or made the container privileged or gave it CAP_SYS_ADMIN, or the pod runs
    Windows (where the API server refuses it)."""
    if windows:
        return
    ctx = container.get("securityContext")
    if ctx is None:
        ctx = container["securityContext"] = {}
    if not isinstance(ctx, dict):
        raise K8sTemplateError(f"container {container.get('name')!r}: securityContext must be a mapping")
    added = ((ctx.get("capabilities") or {}).get("add") or []) if isinstance(ctx.get("capabilities"), dict) else []
    if not ctx.get("privileged") and "SYS_ADMIN" not in added and "CAP_SYS_ADMIN" not in added:
        ctx.setdefault("allowPrivilegeEscalation", False)


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
    address they can reach, e.g. ``--proxy-listen 0.0.0.0``). Its service account needs create/delete
    on jobs and secrets, get on jobs/status, list on pods, get on pods/log, and (optional) patch on
    secrets: the Secret is then owned by its Job, so a launcher that dies leaves no Secret behind.
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
        data.update({secret_key(k): str(v) for k, v in job.env.items() if not is_public_var(k)})
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "stringData": data,
                  "metadata": {"name": name, "namespace": self.namespace, "labels": manifest["metadata"]["labels"]}}
        problem = self._create(batch, core, name, manifest, secret)
        if problem:
            return AttemptOutcome(None, started, utcnow(), error=problem, reward_file_local=False)

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

    def _create(self, batch: Any, core: Any, name: str, manifest: dict[str, Any],
                secret: dict[str, Any]) -> str | None:
        """Create the Secret, then the Job, then make the Job the Secret's owner (so a launcher that
        dies leaves nothing behind once the Job's TTL passes). Returns why the Job could not be
        created, after deleting what this call made; a name someone else holds (409) is left alone."""
        try:
            core.create_namespaced_secret(self.namespace, secret)
        except Exception as exc:  # ApiException or connection errors: the attempt fails, the batch goes on
            if _status(exc) != 409:  # maybe created before the connection broke: ours to delete
                self._cleanup(batch, core, name, job=False)
            return f"could not create Secret {name}: {_api_error(exc)}"
        try:
            created = batch.create_namespaced_job(self.namespace, manifest)
        except Exception as exc:
            self._cleanup(batch, core, name, job=_status(exc) != 409)
            return f"could not create Job {name}: {_api_error(exc)}"
        uid = _get(created, "metadata", "uid")
        if uid:
            owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid}
            try:
                core.patch_namespaced_secret(name, self.namespace, {"metadata": {"ownerReferences": [owner]}})
            except Exception:
                pass  # no patch right on secrets: the runner still deletes it when the attempt ends
        return None

    def _cleanup(self, batch: Any, core: Any, name: str, *, job: bool = True) -> None:
        calls = [lambda: core.delete_namespaced_secret(name, self.namespace)]
        if job:
            calls.insert(0, lambda: batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background"))
        for call in calls:
            try:
                call()
            except Exception:
                pass  # already gone, or the TTL controller will collect it


def _status(exc: Exception) -> int | None:
    return getattr(exc, "status", None)


def _api_error(exc: Exception) -> str:
    """One line about a failed API call, without the values it carried (a client-side validation
    error quotes its input, which for the Secret is its data)."""
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic's ValidationError (kubernetes clients that validate their arguments)
        try:
            found = errors(include_input=False, include_url=False, include_context=False)
            return "invalid body: " + "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in found[:5])
        except Exception:
            pass
    return type(exc).__name__ + ": " + " ".join(str(exc).split())[:300]
