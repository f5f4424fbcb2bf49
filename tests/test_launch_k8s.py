"""Kubernetes Jobs: manifest rendering, status-to-rollout mapping, and the runner against a fake API.

No cluster runs here. Rendered manifests are checked by deserializing them into the ``kubernetes``
client's V1Job model; the runner is driven through tests/support/harness_fake_k8s.py, which answers
with real model objects and posts rewards to the real proxy from the rendered environment.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from kubernetes import client
from support.harness_fake_k8s import FakeCluster

from lightning_harness.launcher.batch import BatchRunner, run_batch
from lightning_harness.launcher.k8s import (
    IN_DIR,
    OUT_DIR,
    K8sRunner,
    K8sTemplateError,
    job_name,
    job_phase,
    render_job,
)
from lightning_harness.launcher.local import AttemptJob
from lightning_harness.launcher.proxy_link import ProxyLink
from lightning_harness.launcher.tasks import tasks_from_rows

TEMPLATE = """
apiVersion: batch/v1
kind: Job
metadata:
  labels: {team: rl}
spec:
  backoffLimit: 6
  template:
    spec:
      restartPolicy: OnFailure
      containers:
        - name: harness
          image: "registry.example/agent:{{ task.image_tag | default('latest') }}"
          args: ["--question", "{{ task.question }}", "--rollout", "{{ rollout_id }}"]
          env:
            - {name: OPENAI_BASE_URL, value: "overridden"}
            - {name: KEEP_ME, value: "1"}
          resources: {limits: {cpu: "1", memory: 1Gi}}
        - name: sidecar
          image: busybox
"""

NO_ARGS_TEMPLATE = """
kind: Job
spec:
  template:
    spec:
      containers:
        - name: h
          image: python:3.11
"""

_api = client.ApiClient()


def _job(rollout_id="run-s3-task_one-0", attempt=2, task='{"question": "2+2?", "task_id": "task_one"}', command=None):
    env = {"OPENAI_BASE_URL": "http://proxy:1/lh/x~2/tok/v1", "LIGHTNING_TASK": task,
           "LIGHTNING_ROLLOUT_ID": rollout_id}
    return AttemptJob(rollout_id, attempt, command, env, Path("."), Path("log"), task_json=task,
                      labels={"run_id": "run", "task_id": "task_one", "group_id": "task_one@3"})


def test_rendered_job_is_a_valid_v1job_with_the_launchers_rules():
    manifest = render_job(TEMPLATE, job=_job(), name="lh-run-1-abc", namespace="rl", timeout=90.4,
                          secret="lh-run-1-abc")
    job = _api._ApiClient__deserialize(manifest, "V1Job")
    assert job.metadata.name == "lh-run-1-abc" and job.metadata.namespace == "rl"
    assert job.metadata.labels["team"] == "rl" and job.metadata.labels["lightning-harness.io/attempt"] == "2"
    assert job.metadata.annotations["lightning-harness.io/rollout-id"] == "run-s3-task_one-0"
    assert job.spec.backoff_limit == 0 and job.spec.active_deadline_seconds == 90
    assert job.spec.ttl_seconds_after_finished == 600
    pod = job.spec.template.spec
    assert pod.restart_policy == "Never"
    assert pod.automount_service_account_token is False  # no cluster credential beside model-written commands
    harness, sidecar = pod.containers
    assert harness.image == "registry.example/agent:latest"
    assert harness.args == ["--question", "2+2?", "--rollout", "run-s3-task_one-0"]
    assert harness.command is None  # the template has args: the image's entrypoint runs them
    env = {e.name: e for e in harness.env}
    # token-bearing values come from the Secret; the Job spec itself holds no secret
    ref = env["OPENAI_BASE_URL"].value_from.secret_key_ref
    assert (ref.name, ref.key, env["OPENAI_BASE_URL"].value) == ("lh-run-1-abc", "env.OPENAI_BASE_URL", None)
    assert "tok" not in json.dumps(manifest)
    assert env["KEEP_ME"].value == "1" and env["LIGHTNING_TASK"].value == '{"question": "2+2?", "task_id": "task_one"}'
    assert [e.name for e in harness.env].count("OPENAI_BASE_URL") == 1
    assert {e.name for e in sidecar.env} >= {"OPENAI_BASE_URL", "LIGHTNING_TASK"}
    assert {(m.name, m.mount_path) for m in harness.volume_mounts} == {("lightning-in", IN_DIR),
                                                                       ("lightning-out", OUT_DIR)}
    assert {v.name: (v.secret.secret_name if v.secret else "emptyDir") for v in pod.volumes} == {
        "lightning-in": "lh-run-1-abc", "lightning-out": "emptyDir"}
    assert pod.containers[0].resources.limits == {"cpu": "1", "memory": "1Gi"}


def test_harness_command_fills_a_template_without_one():
    m = render_job(NO_ARGS_TEMPLATE, job=_job(command=["python", "agent.py", "--task", "task_one"]), name="n",
                   namespace="d", timeout=None)
    c = m["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "agent.py", "--task", "task_one"]
    assert "activeDeadlineSeconds" not in m["spec"]
    shell = render_job(NO_ARGS_TEMPLATE, job=_job(command="echo {x} && run"), name="n", namespace="d", timeout=None)
    assert shell["spec"]["template"]["spec"]["containers"][0]["command"] == ["/bin/sh", "-c", "echo {x} && run"]
    _api._ApiClient__deserialize(shell, "V1Job")


@pytest.mark.parametrize("template, message", [
    ("kind: Job\nspec: {template: {spec: {containers: [{name: a, image: '{{ task.nope }}'}]}}}", "undefined"),
    ("kind: Pod\nspec: {}", "kind: Job"),
    ("kind: Job\nspec: {template: {spec: {containers: []}}}", "at least one container"),
    ("kind: Job\nspec: {template: {spec: {containers: [{name: a}]}}}", "needs a name and an image"),
    ("kind: Job\n  bad: [", "does not render to YAML"),
    ("{% if %}", "Job template"),
])
def test_template_errors_are_clear(template, message):
    with pytest.raises(K8sTemplateError, match=re.escape(message)):
        render_job(template, job=_job(), name="n", namespace="d", timeout=10)


def test_job_names_are_dns1123_unique_per_attempt():
    long = "My_Run-" + "x" * 200 + "-task/ünï-3"
    names = {job_name(long, a) for a in range(3)} | {job_name("a", 0), job_name("A", 0)}
    assert len(names) == 5
    for n in names:
        assert len(n) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n), n


def _status(**kw):
    return client.V1Job(status=client.V1JobStatus(**kw))


def _pod(name="h", **state):
    cs = client.V1ContainerStatus(name=name, state=client.V1ContainerState(**state), image="i", image_id="",
                                  ready=False, restart_count=0)
    return client.V1Pod(status=client.V1PodStatus(container_statuses=[cs]))


def _cond(type_, reason=None, message=None, status="True"):
    return client.V1JobCondition(type=type_, status=status, reason=reason, message=message)


def test_status_mapping_with_kubernetes_models():
    def term(code, reason="Error"):
        return {"terminated": client.V1ContainerStateTerminated(exit_code=code, reason=reason)}

    assert job_phase(_status()).state == "pending"
    assert job_phase(_status(active=1), [_pod(running=client.V1ContainerStateRunning())]).state == "running"
    ok = job_phase(_status(succeeded=1, conditions=[_cond("Complete")]), [_pod(**term(0, "Completed"))], "h")
    assert (ok.state, ok.exit_code) == ("succeeded", 0)
    bad = job_phase(_status(failed=1, conditions=[_cond("Failed", "BackoffLimitExceeded", "limit")]),
                    [_pod(**term(3))], "h")
    assert (bad.state, bad.exit_code) == ("failed", 3) and "BackoffLimitExceeded" in bad.reason
    oom = job_phase(_status(failed=1), [_pod(**term(137, "OOMKilled"))])
    assert (oom.state, oom.exit_code, oom.reason) == ("failed", 137, "OOMKilled")
    dl = job_phase(_status(failed=1, conditions=[_cond("Failed", "DeadlineExceeded", "too long")]))
    assert dl.state == "deadline" and dl.terminal
    target = job_phase(_status(active=1, conditions=[_cond("FailureTarget", "PodFailurePolicy")]))
    assert target.state == "failed"
    pull = job_phase(_status(active=1),
                     [_pod(waiting=client.V1ContainerStateWaiting(reason="ImagePullBackOff", message="nope"))])
    assert pull.state == "failed" and "ImagePullBackOff" in pull.reason
    creating = job_phase(_status(), [_pod(waiting=client.V1ContainerStateWaiting(reason="ContainerCreating"))])
    assert creating.state == "pending" and not creating.terminal
    # a condition with status False is not a verdict; the other container's status is not the harness's
    assert job_phase(_status(active=1, conditions=[_cond("Failed", status="False")])).state == "running"
    assert job_phase(_status(succeeded=1), [_pod("sidecar", **term(9))], "h").exit_code == 0
    # dicts (e.g. from `kubectl get -o json`) map the same way
    d = {"status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}}
    assert job_phase(d).state == "deadline"


def test_k8s_runner_through_the_batch_api_with_a_fake_cluster(make_proxy, rows):
    proxy = make_proxy()
    fake = FakeCluster(namespace="rl")
    runner = K8sRunner(TEMPLATE, namespace="rl", proxy_host="127.0.0.1", batch_api=fake, core_api=fake,
                       poll_interval=0.05, deadline_slack=3.0)  # 3 s past the 2 s deadline: seen under load
    tasks = tasks_from_rows([
        {"id": "ok", "question": "q", "reward": 0.5},
        {"id": "noreward", "question": "q"},
        {"id": "fail", "question": "q", "k8s": "fail"},
        {"id": "deadline", "question": "q", "k8s": "deadline"},
        {"id": "pull", "question": "q", "k8s": "imagepull"},
        {"id": "hang", "question": "q", "k8s": "hang"},
        {"id": "forbidden", "question": "q", "k8s": "forbidden"},
    ])
    results = run_batch(tasks, None, traces_dir=proxy.traces_dir, run_id="k", proxy=proxy, runner=runner,
                        concurrency=4, timeout=1.5, retries=0)
    by = {r.task_id: r for r in results}
    assert (by["ok"].state, by["ok"].reward, by["ok"].reward_source, by["ok"].exit_code) == (
        "succeeded", 0.5, "proxy", 0)
    assert by["noreward"].state == "no_reward" and by["noreward"].reward is None
    assert by["fail"].state == "failed" and by["fail"].exit_code == 2 and "BackoffLimitExceeded" in by["fail"].error
    assert by["deadline"].state == "timed_out" and "DeadlineExceeded" in by["deadline"].error
    assert by["pull"].state == "failed" and "ImagePullBackOff" in by["pull"].error
    assert by["hang"].state == "timed_out" and "timed out after 1.5s" in by["hang"].error  # the launcher's own clock
    assert by["forbidden"].state == "failed" and "HTTP 403" in by["forbidden"].error
    assert all(r.runner == "k8s" for r in results)
    # everything created was deleted; logs were fetched; the rendered Job is kept next to the log
    assert set(fake.deleted_jobs) >= set(fake.created) and not fake.jobs and not fake.secrets
    assert "log of lh-k-ok-0-0-" in Path(by["ok"].log_path).read_text()
    assert (Path(by["ok"].log_path).parent / "job.yaml").exists()
    # the "pod" posted its reward through the proxy URL it resolved from the Secret
    assert fake.rewards_posted == [("k-ok-0", 0.5)]
    assert len(rows(proxy.traces_dir, "rollouts")) == 7


def test_k8s_runner_cancel_deletes_the_job(make_proxy):
    proxy = make_proxy()
    fake = FakeCluster()
    runner = K8sRunner(TEMPLATE, proxy_host="10.0.0.5", batch_api=fake, core_api=fake, poll_interval=0.05)
    with BatchRunner(None, traces_dir=proxy.traces_dir, proxy=proxy, runner=runner, run_id="kc", timeout=300) as b:
        b.submit([{"id": "hang", "question": "q", "k8s": "hang"}])
        deadline = time.monotonic() + 30
        while not fake.jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        [name] = list(fake.jobs)
        env = fake.jobs[name]["env"]
        secret = fake.secrets[name]
        b.cancel()
    assert env["OPENAI_BASE_URL"].startswith("http://10.0.0.5:")
    assert env["HTTP_PROXY"].endswith(f"@10.0.0.5:{proxy.forward_port}")
    assert env["SSL_CERT_FILE"] == f"{IN_DIR}/ca-bundle.pem" and env["LIGHTNING_OUTPUT_DIR"] == OUT_DIR
    assert env["LIGHTNING_TASK_FILE"] == f"{IN_DIR}/task.json"
    files = {k for k in secret["stringData"] if not k.startswith("env.")}
    assert files == {"task.json", "ca-bundle.pem"} and "BEGIN CERTIFICATE" in secret["stringData"]["ca-bundle.pem"]
    assert name in fake.deleted_jobs and not fake.jobs and not fake.secrets
    saved = (proxy.traces_dir / "launch" / "kc" / "kc-hang-0" / "0" / "job.yaml").read_text()
    assert proxy.token not in saved and "secretKeyRef" in saved  # the kept manifest leaks no token


def test_k8s_runner_refuses_loopback_proxy_and_broken_templates():
    with pytest.raises(K8sTemplateError):
        K8sRunner("kind: Pod", batch_api=object(), core_api=object())
    runner = K8sRunner(NO_ARGS_TEMPLATE, batch_api=object(), core_api=object())
    with pytest.raises(RuntimeError, match="proxy_host"):
        runner.proxy_view(ProxyLink("http://127.0.0.1:1", "http://127.0.0.1:2", "t", "/ca"))
