"""A fake Kubernetes API for launcher tests: the calls K8sRunner makes, answered with real model objects.

What it checks like an API server would: every Job and Secret body deserializes into the
``kubernetes`` client's V1Job / V1Secret models (field names and types), names are DNS-1123,
namespaces match, a duplicate name is a 409. What it does not do: schedule pods, pull images, run
containers. Like the kubelet, it resolves ``secretKeyRef`` env entries from the Secret (a missing
Secret or key fails the Job's creation here). A Job's course is scripted by the task's ``k8s``
field (read from the resolved environment, as a harness in the pod would read it):

  succeed    pending -> running -> Complete (exit 0); the "pod" POSTs ``task.reward`` to
             LIGHTNING_REWARD_URL from its environment, as a harness would
  fail       running -> Failed/BackoffLimitExceeded with container exit code 2
  deadline   running until ``activeDeadlineSeconds`` passed -> Failed/DeadlineExceeded
  imagepull  container waiting in ImagePullBackOff forever
  hang       running forever (ignores its deadline: the launcher's own timeout must act)
  forbidden  creating the Job answers 403
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

from kubernetes import client
from kubernetes.client.rest import ApiException

_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_api = client.ApiClient()


def _deserialize(body: dict, kind: str):
    return _api._ApiClient__deserialize(json.loads(json.dumps(body)), kind)


class FakeCluster:
    """Serves as both ``batch_api`` and ``core_api``."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.jobs: dict[str, dict] = {}
        self.secrets: dict[str, dict] = {}
        self.created: list[str] = []
        self.deleted_jobs: list[str] = []
        self.deleted_secrets: list[str] = []
        self.rewards_posted: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    # -- helpers ----------------------------------------------------------------------------
    def _check(self, namespace: str, name: str) -> None:
        if namespace != self.namespace:
            raise ApiException(status=404, reason=f"namespace {namespace} not found")
        if not name or len(name) > 63 or not _DNS1123.match(name):
            raise ApiException(status=422, reason=f"invalid name {name!r}")

    def _scenario(self, manifest: dict) -> tuple[str, dict]:
        env = {}
        for e in manifest["spec"]["template"]["spec"]["containers"][0].get("env", []):
            if "valueFrom" in e:
                ref = e["valueFrom"]["secretKeyRef"]
                secret = self.secrets.get(ref["name"])
                if secret is None or ref["key"] not in secret["stringData"]:
                    raise ApiException(status=422, reason=f"secret key {ref} not found")
                env[e["name"]] = secret["stringData"][ref["key"]]
            else:
                env[e["name"]] = e["value"]
        task = json.loads(env["LIGHTNING_TASK"])
        return task.get("k8s", "succeed"), env

    # -- CoreV1Api ---------------------------------------------------------------------------
    def create_namespaced_secret(self, namespace, body):
        name = body["metadata"]["name"]
        self._check(namespace, name)
        _deserialize(body, "V1Secret")
        with self.lock:
            if name in self.secrets:
                raise ApiException(status=409, reason="AlreadyExists")
            self.secrets[name] = body
        return body

    def delete_namespaced_secret(self, name, namespace, **kw):
        with self.lock:
            self.deleted_secrets.append(name)
            if self.secrets.pop(name, None) is None:
                raise ApiException(status=404, reason="NotFound")

    def list_namespaced_pod(self, namespace, label_selector=""):
        name = label_selector.split("=", 1)[1]
        with self.lock:
            rec = self.jobs.get(name)
        pods = [] if rec is None else self._pods(name, rec)
        return client.V1PodList(items=pods)

    def read_namespaced_pod_log(self, name, namespace, container=None, tail_lines=None, limit_bytes=None):
        assert tail_lines and limit_bytes, "a pod's log is read bounded"
        return f"log of {name} container {container}\n"

    # -- BatchV1Api --------------------------------------------------------------------------
    def create_namespaced_job(self, namespace, body):
        name = body["metadata"]["name"]
        self._check(namespace, name)
        job = _deserialize(body, "V1Job")  # raises on a malformed Job, as the API server would
        assert job.spec.template.spec.containers, "no containers"
        scenario, env = self._scenario(body)
        if scenario == "forbidden":
            raise ApiException(status=403, reason="Forbidden")
        with self.lock:
            if name in self.jobs:
                raise ApiException(status=409, reason="AlreadyExists")
            self.jobs[name] = {"body": body, "created": time.monotonic(), "polls": 0, "scenario": scenario,
                               "env": env, "reported": False}
            self.created.append(name)
        return job

    def delete_namespaced_job(self, name, namespace, propagation_policy=None, **kw):
        with self.lock:
            self.deleted_jobs.append(name)
            if self.jobs.pop(name, None) is None:
                raise ApiException(status=404, reason="NotFound")

    def read_namespaced_job_status(self, name, namespace):
        with self.lock:
            rec = self.jobs.get(name)
            if rec is None:
                raise ApiException(status=404, reason="NotFound")
            rec["polls"] += 1
        return client.V1Job(metadata=client.V1ObjectMeta(name=name), status=self._status(rec))

    # -- the scripted course of a Job ----------------------------------------------------------
    def _phase(self, rec: dict) -> str:
        s, polls = rec["scenario"], rec["polls"]
        if s == "succeed":
            return "pending" if polls <= 1 else "running" if polls == 2 else "complete"
        if s == "fail":
            return "running" if polls <= 1 else "failed"
        if s == "deadline":
            limit = rec["body"]["spec"].get("activeDeadlineSeconds") or 1e9
            return "deadline" if time.monotonic() - rec["created"] >= limit else "running"
        if s == "imagepull":
            return "imagepull"
        return "running"

    def _status(self, rec: dict) -> client.V1JobStatus:
        phase = self._phase(rec)
        now = None
        if phase == "complete":
            if not rec["reported"]:
                rec["reported"] = True
                self._post_reward(rec)
            cond = client.V1JobCondition(type="Complete", status="True", last_transition_time=now)
            return client.V1JobStatus(succeeded=1, conditions=[cond])
        if phase == "failed":
            cond = client.V1JobCondition(type="Failed", status="True", reason="BackoffLimitExceeded",
                                         message="Job has reached the specified backoff limit")
            return client.V1JobStatus(failed=1, conditions=[cond])
        if phase == "deadline":
            cond = client.V1JobCondition(type="Failed", status="True", reason="DeadlineExceeded",
                                         message="Job was active longer than specified deadline")
            return client.V1JobStatus(failed=1, conditions=[cond])
        if phase in ("running", "imagepull"):
            return client.V1JobStatus(active=1)
        return client.V1JobStatus()

    def _pods(self, job_name: str, rec: dict) -> list:
        phase = self._phase(rec)
        cname = rec["body"]["spec"]["template"]["spec"]["containers"][0]["name"]
        if phase == "pending":
            state = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason="ContainerCreating"))
        elif phase == "imagepull":
            state = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason="ImagePullBackOff",
                                                                                   message="image not found"))
        elif phase == "running":
            state = client.V1ContainerState(running=client.V1ContainerStateRunning())
        else:
            code = {"complete": 0, "failed": 2, "deadline": 137}[phase]
            state = client.V1ContainerState(terminated=client.V1ContainerStateTerminated(
                exit_code=code, reason="Completed" if code == 0 else "Error"))
        cs = client.V1ContainerStatus(name=cname, state=state, image="img", image_id="", ready=phase == "running",
                                      restart_count=0)
        return [client.V1Pod(metadata=client.V1ObjectMeta(name=f"{job_name}-abcde"),
                             status=client.V1PodStatus(container_statuses=[cs]))]

    def _post_reward(self, rec: dict) -> None:
        task = json.loads(rec["env"]["LIGHTNING_TASK"])
        if "reward" not in task:
            return
        url = rec["env"]["LIGHTNING_REWARD_URL"]
        req = urllib.request.Request(url, data=json.dumps({"reward": task["reward"]}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=30) as resp:
            resp.read()
        self.rewards_posted.append((rec["env"]["LIGHTNING_ROLLOUT_ID"], task["reward"]))
