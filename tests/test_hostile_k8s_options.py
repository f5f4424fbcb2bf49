"""Hostile input to the Kubernetes runner and to the proxy's options.

Kubernetes: task text is written by whoever made the task file (often a model); rendered into the Job
template it must stay a value, never YAML structure (host mounts, privileged, hostNetwork). The
launcher's rules hold against any template; no secret is in the Job spec; the runner deletes only what
it created. The runner is driven through the real ``kubernetes`` client against a small API stub over
HTTP (the client's own request validation and serialization run), no cluster needed.

Proxy options: every bad value from a YAML file, a flag or the environment is refused with a message
naming the option (never a traceback, never a silent default), and no secret is echoed.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from lightning_harness.launcher.k8s import K8sRunner, K8sTemplateError, render_job
from lightning_harness.launcher.local import AttemptJob

_api = client.ApiClient()

HOSTILE = [
    'a", "--x"], "securityContext": {"privileged": true}, "z": ["',
    "x\n          securityContext: {privileged: true}\n      hostNetwork: true\n      hostPID: true",
    "q'\n      volumes: [{name: root, hostPath: {path: /}}]\n#",
    "{{ 7 * 7 }} {% raw %} $(OPENAI_API_KEY) \\ \\n \t ü 🦀",
    "- [", "&anchor *alias !!python/object:os.system", "",
    "|\n  serviceAccountName: admin\n  automountServiceAccountToken: true",
]

CONTEXTS = """
kind: Job
metadata:
  annotations:
    plain: {{ task.text }}
    mixed: prefix-{{ task.text }}-suffix
spec:
  template:
    spec:
      containers:
        - name: harness
          image: "img:{{ task.tag }}"
          args: ["--double", "{{ task.text }}", '{{ task.text }}', {{ task.text }}]
          env:
            - name: BLOCK
              value: |
                {{ task.text }}
            - name: PLAIN
              value: {{ task.text }}
"""


def _job(task: dict, env: dict | None = None, tmp: Path = Path("."), command=None, timeout=None) -> AttemptJob:
    text = json.dumps(task)
    return AttemptJob("run-t-0", 0, command, env or {"LIGHTNING_TASK": text}, tmp, tmp / "harness.log",
                      timeout=timeout, task_json=text, labels={"run_id": "run", "task_id": "t", "group_id": "t"})


def _v1job(manifest: dict):
    return _api._ApiClient__deserialize(json.loads(json.dumps(manifest)), "V1Job")  # raises on unknown fields


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_task_text_stays_one_value_in_every_yaml_context(text):
    manifest = render_job(CONTEXTS, job=_job({"text": text, "tag": "v1"}), name="n", namespace="d", timeout=None)
    job = _v1job(manifest)
    pod = job.spec.template.spec
    [c] = pod.containers
    assert c.args == ["--double", text, text, text]  # each exactly the task's text, nothing added
    env = {e.name: e.value for e in c.env}
    assert env["PLAIN"] == text and env["BLOCK"] == text + "\n"  # a literal block keeps its final newline
    assert job.metadata.annotations["plain"] == text
    assert job.metadata.annotations["mixed"] == f"prefix-{text}-suffix"
    assert c.image == "img:v1" and c.security_context.privileged is None
    assert not pod.host_network and not pod.host_pid and not pod.service_account_name
    assert pod.automount_service_account_token is False
    assert [v.name for v in pod.volumes] == ["lightning-out"]


TYPED = """
kind: Job
spec:
  template:
    spec:
      terminationGracePeriodSeconds: {{ task.grace }}
      containers:
        - name: h
          image: python:3.11
          command: {{ command }}
          args: {{ task.args | tojson }}
          workingDir: {{ task.missing | default('/work') }}
          env:
            - {name: S, value: {{ task.s }}}
{%- for k in task.names %}
            - {name: "X_{{ k }}", value: "{{ loop.index }}"}
{%- endfor %}
"""


def test_values_keep_their_types_and_jinja_still_drives_the_structure():
    task = {"grace": 7, "args": ["a\nb", "--flag"], "names": ["ONE", "TWO"], "s": "007"}
    manifest = render_job(TYPED, job=_job(task, command=["python", "agent.py"]), name="n", namespace="d",
                          timeout=None)
    pod = _v1job(manifest).spec.template.spec
    assert pod.termination_grace_period_seconds == 7  # a number stays a number
    [c] = pod.containers
    assert c.command == ["python", "agent.py"] and c.args == ["a\nb", "--flag"] and c.working_dir == "/work"
    assert [(e.name, e.value) for e in c.env if e.name.startswith("X_")] == [("X_ONE", "1"), ("X_TWO", "2")]
    assert [e.value for e in c.env if e.name == "S"] == ["007"]  # a task's string stays a string (YAML: 7)
    with pytest.raises(K8sTemplateError, match="undefined") as err:
        render_job(CONTEXTS, job=_job({"text": "x"}), name="n", namespace="d", timeout=None)  # no task.tag
    assert err.value.undefined


FORCED = """
apiVersion: batch/v1
kind: Job
metadata:
  labels: {lightning-harness.io/rollout: forged}
spec:
  backoffLimit: 6
  completions: 5
  parallelism: 5
  suspend: true
  manualSelector: true
  selector: {matchLabels: {app: other}}
  podFailurePolicy: {rules: [{action: Ignore, onExitCodes: {operator: In, values: [1]}}]}
  activeDeadlineSeconds: 99999
  ttlSecondsAfterFinished:
  template:
    metadata:
      labels: {app: other, job-name: someone-elses-job, batch.kubernetes.io/job-name: someone-elses-job}
    spec:
      restartPolicy: OnFailure
      initContainers:
        - {name: init, image: busybox}
      containers:
        - {name: harness, image: agent}
        - name: root-sidecar
          image: tool
          securityContext: {privileged: true}
        - name: chosen
          image: tool
          securityContext: {allowPrivilegeEscalation: true}
"""


def test_the_launchers_rules_hold_whatever_the_template_says():
    manifest = render_job(FORCED, job=_job({}), name="lh-n", namespace="d", timeout=30)
    job = _v1job(manifest)
    spec = job.spec
    assert (spec.backoff_limit, spec.completions, spec.parallelism) == (0, 1, 1)  # one pod, never re-run
    assert spec.active_deadline_seconds == 30 and not spec.suspend and spec.ttl_seconds_after_finished == 600
    assert spec.selector is None and spec.manual_selector is None and spec.pod_failure_policy is None
    assert job.metadata.labels["lightning-harness.io/rollout"] == "run-t-0"
    labels = spec.template.metadata.labels
    assert labels["app"] == "other" and "job-name" not in labels and "batch.kubernetes.io/job-name" not in labels
    pod = spec.template.spec
    assert pod.restart_policy == "Never"
    harness, privileged, chosen = pod.containers
    assert harness.security_context.allow_privilege_escalation is False  # least privilege unless the template says
    assert privileged.security_context.privileged and privileged.security_context.allow_privilege_escalation is None
    assert chosen.security_context.allow_privilege_escalation is True
    assert pod.init_containers[0].security_context.allow_privilege_escalation is False


def test_labels_are_valid_for_any_rollout_and_group():
    rollout = "R" + "x" * 253 + "."  # the longest id the proxy allows
    job = AttemptJob(rollout, 2**31 - 1, None, {}, Path("."), Path("l"),
                     labels={"run_id": "r", "task_id": "_t_", "group_id": "eval:task@3"})
    labels = render_job(FORCED, job=job, name="n", namespace="d", timeout=None)["metadata"]["labels"]
    for key, value in labels.items():
        assert len(value) <= 63 and re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", value), (key, value)


@pytest.mark.parametrize("template, message", [
    ("kind: List\nitems: [{kind: Job}]", "kind: Job"),
    ("kind: Job\nspec: {}\n---\nkind: Job\n", "does not render to YAML"),
    ("kind: Job\nmetadata: [1]\nspec: {template: {spec: {containers: [{name: a, image: b}]}}}", "metadata"),
    ("kind: Job\nspec: {template: {spec: {containers: [{name: a, image: b, env: [A=1]}]}}}", "env"),
    ("kind: Job\nspec: {template: {spec: {volumes: [x], containers: [{name: a, image: b}]}}}", "volumes"),
    ("kind: Job\nspec: {template: {spec: {containers: [{name: a, image: b, volumeMounts: 3}]}}}", "volumeMounts"),
])
def test_a_malformed_template_is_a_template_error_not_a_traceback(template, message):
    with pytest.raises(K8sTemplateError, match=re.escape(message)):
        render_job(template, job=_job({}), name="n", namespace="d", timeout=10)


def test_no_value_that_may_be_secret_is_in_the_job_spec():
    env = {"LIGHTNING_TASK": "{}", "LIGHTNING_ROLLOUT_ID": "run-t-0", "SSL_CERT_FILE": "/lightning/in/ca.pem",
           "OPENAI_API_KEY": "sk-user-key", "HF_TOKEN": "hf_passed_by_name", "MY VAR": "from --env"}
    template = CONTEXTS.replace("{{ task.text }}", "{{ env.HF_TOKEN }}").replace("{{ task.tag }}", "v")
    manifest = render_job(template, job=_job({}, env=env), name="lh-x", namespace="d", timeout=None, secret="lh-x")
    text = json.dumps(manifest)
    for secret in ("sk-user-key", "hf_passed_by_name", "from --env"):
        assert secret not in text
    c = _v1job(manifest).spec.template.spec.containers[0]
    by_name = {e.name: e for e in c.env}
    keys = {n: e.value_from.secret_key_ref.key for n, e in by_name.items() if e.value_from}
    assert set(keys) == {"OPENAI_API_KEY", "HF_TOKEN", "MY VAR"}
    assert all(re.fullmatch(r"[-._a-zA-Z0-9]+", k) for k in keys.values())  # valid Secret keys, even for "MY VAR"
    assert by_name["LIGHTNING_TASK"].value == "{}" and by_name["SSL_CERT_FILE"].value == "/lightning/in/ca.pem"
    assert c.args[1] == "$(HF_TOKEN)"  # a template using {{ env.X }} gets the kubelet's reference, not the value


# -- the runner through the real kubernetes client ------------------------------------------------------------
class StubApi:
    """Just enough of a Kubernetes API server over HTTP for K8sRunner: objects by kind and name, 409 on a
    duplicate, uids, strategic-merge of metadata on PATCH, a Job that completes at once."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                stub.handle(self, None)

            def do_DELETE(self):
                stub.handle(self, None)

            def do_POST(self):
                stub.handle(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            do_PATCH = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{self.server.server_port}"
        api = client.ApiClient(cfg)
        self.batch, self.core = client.BatchV1Api(api), client.CoreV1Api(api)

    def add(self, kind: str, name: str) -> None:
        self.objects[(kind, name)] = {"metadata": {"name": name, "uid": f"uid-other-{name}"}}

    def handle(self, h: BaseHTTPRequestHandler, body: dict | None) -> None:
        url = urllib.parse.urlsplit(h.path)
        parts = url.path.strip("/").split("/")
        kind, rest = (parts[-2], parts[-1:]) if parts[-1] not in ("jobs", "secrets", "pods", "log", "status") \
            else (parts[-1], [])
        if parts[-1] in ("log", "status"):
            kind, rest = parts[-3], [parts[-2], parts[-1]]
        with self.lock:
            self.requests.append((h.command, f"{kind}/{'/'.join(rest)}?{url.query}"))
            code, out = self.answer(h.command, kind, rest, body, urllib.parse.parse_qs(url.query))
        data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
        h.send_response(code)
        h.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def answer(self, method: str, kind: str, rest: list[str], body: dict | None, query: dict):
        gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound"}
        if method == "POST":
            key = (kind, body["metadata"]["name"])
            if key in self.objects:
                return 409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409,
                             "reason": "AlreadyExists"}
            body["metadata"]["uid"] = f"uid-{kind}-{key[1]}"
            self.objects[key] = body
            return 201, body
        if kind == "pods" and not rest:
            job = query["labelSelector"][0].split("=", 1)[1]
            pod = {"metadata": {"name": f"{job}-abcde"}, "status": {"containerStatuses": [{
                "name": "harness", "image": "i", "imageID": "", "ready": False, "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [pod]}
        if kind == "pods":
            return 200, "the harness said hello\n"
        obj = self.objects.get((kind, rest[0]))
        if obj is None:
            return 404, gone
        if method == "DELETE":
            del self.objects[(kind, rest[0])]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if method == "PATCH":
            obj["metadata"].update(body["metadata"])
            return 200, obj
        return 200, {**obj, "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}


SIMPLE = """
kind: Job
spec:
  template:
    spec:
      containers:
        - {name: harness, image: agent, env: [{name: N, value: "{{ task.n }}"}]}
"""


@pytest.fixture
def stub():
    api = StubApi()
    yield api
    api.server.shutdown()
    api.server.server_close()


def _run(stub: StubApi, tmp_path: Path, task: dict, env: dict | None = None, template: str = SIMPLE):
    (tmp_path / "task.json").write_text(json.dumps(task))
    runner = K8sRunner(template, namespace="rl", proxy_host="10.0.0.5", batch_api=stub.batch, core_api=stub.core,
                       poll_interval=0.01)
    job = _job(task, env=env, tmp=tmp_path, timeout=30)
    job.files = {"task.json": tmp_path / "task.json"}
    return runner.run(job, threading.Event())


def test_the_runner_creates_owns_and_deletes_its_objects_with_the_real_client(stub, tmp_path):
    seen: dict = {}
    real_answer = stub.answer

    def spy(method, kind, rest, body, query):
        if kind == "secrets" and method == "POST":
            seen["secret"] = json.loads(json.dumps(body))
        if kind == "secrets" and method == "PATCH":
            seen["owner"] = body["metadata"]["ownerReferences"]
        return real_answer(method, kind, rest, body, query)

    stub.answer = spy
    out = _run(stub, tmp_path, {"n": "1"}, env={"LIGHTNING_TASK": "{}", "OPENAI_API_KEY": "sk-k"})
    assert (out.exit_code, out.error) == (0, None)
    name = seen["secret"]["metadata"]["name"]
    # the Secret belongs to the Job: if this launcher dies, the Job's TTL removes the Secret with it
    assert seen["owner"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": f"uid-jobs-{name}"}]
    assert seen["secret"]["stringData"]["env.OPENAI_API_KEY"] == "sk-k"
    assert ("DELETE", f"jobs/{name}?propagationPolicy=Background") in stub.requests
    assert not stub.objects  # Job and Secret deleted
    assert "the harness said hello" in (tmp_path / "harness.log").read_text()
    assert "sk-k" not in (tmp_path / "job.yaml").read_text()


@pytest.mark.parametrize("taken", [("secrets",), ("jobs",), ("secrets", "jobs")])
def test_a_name_taken_by_someone_else_fails_the_attempt_and_deletes_nothing_of_theirs(stub, tmp_path, taken):
    from lightning_harness.launcher.k8s import job_name

    name = job_name("run-t-0", 0)
    for kind in taken:
        stub.add(kind, name)
    out = _run(stub, tmp_path, {"n": "1"})
    assert out.exit_code is None and "could not create" in out.error and "409" in out.error, out.error
    assert set(stub.objects) == {(kind, name) for kind in taken}  # theirs stay; nothing of ours is left
    assert all(o["metadata"]["uid"].startswith("uid-other") for o in stub.objects.values())


def test_a_job_the_client_refuses_is_one_clear_line_without_values(stub, tmp_path):
    out = _run(stub, tmp_path, {"n": 12345678}, template=SIMPLE.replace('"{{ task.n }}"', "{{ task.n }}"))
    # (an env value must be a string: the client's own validation refuses the number)
    assert out.exit_code is None and out.error.startswith("could not create Job"), out.error
    assert "env" in out.error and "12345678" not in out.error and "\n" not in out.error, out.error
    assert not stub.objects  # the Secret made before it is deleted again


# -- the proxy's options ------------------------------------------------------------------------------------
def _serve(args: list[str], env: dict | None = None):
    """``lightning-proxy serve`` through click's runner; it stops before starting anything: at a bad option,
    or (this Python has no mitmproxy, and is named as the proxy's Python) where it would hand over."""
    from click.testing import CliRunner

    from lightning_harness.proxy.cli import serve

    base = {"LIGHTNING_PROXY_PYTHON": sys.executable, "LIGHTNING_PROXY_REEXEC": None,
            "LIGHTNING_PROXY_TOKEN": None, "LIGHTNING_PROXY_CONTROL_TOKEN": None}
    return CliRunner().invoke(serve, args, env={**base, **(env or {})})


@pytest.mark.parametrize("yaml_text, flags, expected", [
    ("forward_port: 70000", [], "forward_port must be >= 0 and <= 65535, got 70000"),
    ("", ["--reverse-port", "-1"], "reverse_port must be >= 0 and <= 65535, got -1"),
    ("max_body_size: -5", [], "max_body_size must be >= 1, got -5"),
    ("", ["--flush-rows", "0"], "flush_rows must be >= 1, got 0"),
    ("idle_timeout: -1", [], "idle_timeout must be > 0, got -1"),
    ("", ["--flush-seconds", "nan"], "flush_seconds must be a finite number, got nan"),
    ("fsync: 'false'", [], "fsync must be true or false, got 'false'"),
    ("forward_port: abc", [], "forward_port must be an integer, got 'abc'"),
    ("traces: FILE", [], "exists and is not a directory"),
    ("", ["--traces", "FILE"], "exists and is not a directory"),
    ("upstream_ca: /nonexistent/ca.pem", [], "upstream_ca: '/nonexistent/ca.pem' is not a readable file"),
    ("no_intercept: '['", [], "no_intercept: '[' is not a regular expression"),
    ("model_map: gpt=policy", [], "model_map must be a mapping of strings to strings"),
    ("upstreams: http://127.0.0.1:8000", [], None),  # one URL where a list is expected: taken as a list of one
    ("route_hosts: [1]\nflush_rows: 0", [], "bad proxy options: route_hosts must be a list of strings, got [1]; "
                                          "flush_rows must be >= 1"),
    ("forward_port: [", [], "not YAML"),
])
def test_a_bad_option_value_is_named_wherever_it_came_from(tmp_path, yaml_text, flags, expected):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text.replace("FILE", str(afile)))
    res = _serve(["--config", str(cfg), *[str(afile) if f == "FILE" else f for f in flags]])
    if expected is None:  # valid: it gets as far as handing over to the proxy's Python
        assert res.exit_code == 1 and "cannot import mitmproxy" in res.output, res.output
        return
    assert res.exit_code == 2 and expected in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback


def test_a_proxy_reachable_from_other_machines_needs_its_tokens():
    res = _serve(["--listen-host", "0.0.0.0"])
    assert res.exit_code == 2 and "give it a token ($LIGHTNING_PROXY_TOKEN" in res.output, res.output
    res = _serve(["--listen-host", "10.1.2.3", "--control-token", ""], env={"LIGHTNING_PROXY_TOKEN": "t"})
    assert res.exit_code == 2 and "--control-token ''" in res.output, res.output
    for host in ("127.0.0.2", "localhost", "::1"):  # loopback: as before, it may run without
        res = _serve(["--listen-host", host])
        assert res.exit_code == 1 and "cannot import mitmproxy" in res.output, (host, res.output)


def test_no_secret_in_help_errors_or_the_started_proxys_command_line(tmp_path, make_proxy):
    from click.testing import CliRunner

    from lightning_harness.proxy.cli import main

    secrets = {"LIGHTNING_PROXY_TOKEN": "tok-from-env", "LIGHTNING_PROXY_CONTROL_TOKEN": "ctl-from-env",
               "OPENAI_API_KEY": "sk-from-env", "ANTHROPIC_API_KEY": "sk-ant-from-env"}
    for args in (["serve", "--help"], ["env", "--help"], ["ctl", "--help"]):
        out = CliRunner().invoke(main, args, env=secrets).output
        assert "Usage" in out and not any(v in out for v in secrets.values()), out
    cfg = tmp_path / "c.yaml"
    cfg.write_text("token: {key: sk-secret-in-yaml}\nupstreams: ['http://user:sk-in-url@host:99999']\n")
    res = _serve(["--config", str(cfg)])
    assert res.exit_code == 2 and "token must be a string, got (value hidden)" in res.output, res.output
    assert "sk-secret-in-yaml" not in res.output
    cfg.write_text("upstreams: ['http://user:sk-in-url@host:99999']\n")
    res = _serve(["--config", str(cfg)])
    assert res.exit_code == 2 and "'http://***@host:99999'" in res.output and "sk-in-url" not in res.output
    # a token given as a flag is flagged: every user can read a command line
    res = _serve(["--token", "tok-on-argv"])
    assert "--token on the command line is readable by every user" in res.output and "tok-on-argv" not in res.output
    assert "readable by every user" not in _serve([], env={"LIGHTNING_PROXY_TOKEN": "t"}).output
    # the proxy ProxyProcess starts holds its tokens in its environment, never in its command line
    proxy = make_proxy()
    cmdline = Path(f"/proc/{proxy.pid}/cmdline").read_bytes().decode()
    assert "serve" in cmdline and proxy.token not in cmdline and proxy.control_token not in cmdline


def test_env_and_ctl_warn_of_a_token_given_as_a_flag(tmp_path, monkeypatch):
    """`serve` warned of --token on the command line (every user reads /proc/<pid>/cmdline); `env`
    and `ctl` took theirs there silently, and `env --help` showed that usage."""
    from click.testing import CliRunner

    from lightning_harness.proxy.cli import main

    runner = CliRunner()
    monkeypatch.delenv("LIGHTNING_PROXY_TOKEN", raising=False)
    flagged = runner.invoke(main, ["env", "r1", "--confdir", str(tmp_path), "--token", "flag-secret"])
    assert flagged.exit_code == 0 and "--token on the command line is readable" in flagged.stderr
    monkeypatch.setenv("LIGHTNING_PROXY_TOKEN", "env-secret")
    quiet = runner.invoke(main, ["env", "r1", "--confdir", str(tmp_path)])
    assert quiet.exit_code == 0 and "readable" not in quiet.stderr
    ctl = runner.invoke(main, ["ctl", "--url", "http://127.0.0.1:9", "--token", "flag-secret", "state"])
    assert "--token on the command line is readable" in ctl.stderr
    assert "--token SECRET" not in runner.invoke(main, ["env", "--help"]).stdout
