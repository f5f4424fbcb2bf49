"""The lightning-proxy CLI: env printing, ctl, YAML config, and an unmodified harness end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from fixtures_proxy import read_rewards, read_spans

from lightning_harness.proxy.client import harness_env
from lightning_harness.proxy.credentials import attempt_credential
from lightning_harness.proxy.locate import proxy_python

pytestmark = pytest.mark.timeout(300)


def _cli(*args, env=None, check=True):
    r = subprocess.run([proxy_python(), "-m", "lightning_harness.proxy", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"lightning-proxy {args} failed: {r.stderr}")
    return r


def test_env_formats_match_contract(tmp_path):
    args = ["env", "roll.1", "--attempt", "2", "--token", "t0k", "--forward-port", "1111", "--reverse-port", "2222",
            "--confdir", str(tmp_path)]
    as_json = json.loads(_cli(*args, "--format", "json", env={"OPENAI_API_KEY": ""}).stdout)
    expected = harness_env("roll.1", 2, "t0k", "http://127.0.0.1:1111", "http://127.0.0.1:2222",
                           tmp_path / "lightning-ca-bundle.pem")
    assert as_json == expected
    cred = attempt_credential("t0k", "roll.1", 2)  # the harness never sees the token itself
    assert as_json["HTTPS_PROXY"] == f"http://roll.1~2:{cred}@127.0.0.1:1111"
    assert as_json["OPENAI_BASE_URL"] == f"http://127.0.0.1:2222/lh/roll.1~2/{cred}/v1"
    assert as_json["OPENAI_API_KEY"] == "sk-lightning-placeholder" and as_json["NO_PROXY"] == ""
    # export lines evaluate in a shell to the same values
    exported = _cli(*args).stdout
    shell = subprocess.run(["bash", "-c", exported + "\nenv -0"], capture_output=True, env={}, timeout=30)
    got = dict(kv.split("=", 1) for kv in shell.stdout.decode().split("\0") if "=" in kv)
    assert all(got.get(k) == v for k, v in expected.items())
    dotenv = _cli(*args, "--format", "dotenv").stdout
    assert "LIGHTNING_ROLLOUT_ID=roll.1" in dotenv
    assert "warning" in _cli(*args).stderr  # no CA bundle yet in that confdir
    bad = _cli("env", "roll/1", "--confdir", str(tmp_path), check=False)  # outside the id rule
    assert bad.returncode == 2 and "[A-Za-z0-9._-]" in bad.stderr


def test_user_api_key_is_passed_through(tmp_path):
    out = json.loads(_cli("env", "r", "--format", "json", "--confdir", str(tmp_path),
                          env={"OPENAI_API_KEY": "sk-user"}).stdout)
    assert out["OPENAI_API_KEY"] == "sk-user"


def test_ctl_commands(proxy):
    env = {"LIGHTNING_PROXY_URL": proxy.reverse_url, "LIGHTNING_PROXY_CONTROL_TOKEN": proxy.control_token}
    assert json.loads(_cli("ctl", "pause", env=env).stdout)["paused"] is True
    assert json.loads(_cli("ctl", "resume", env=env).stdout)["paused"] is False
    assert json.loads(_cli("ctl", "model-version", "5", env=env).stdout)["model_version"] == 5
    assert json.loads(_cli("ctl", "drain", "--timeout", "1", env=env).stdout)["drained"] is True
    _cli("ctl", "reward", "cli-r", "0.75", "--attempt", "1", "--info", '{"ok": true}', env=env)
    assert json.loads(_cli("ctl", "flush", env=env).stdout)["rewards_written"] == 1
    bad = _cli("ctl", "state", env={**env, "LIGHTNING_PROXY_CONTROL_TOKEN": "wrong"}, check=False)
    assert bad.returncode != 0 and "401" in bad.stderr
    harness_token = {"LIGHTNING_PROXY_URL": proxy.reverse_url, "LIGHTNING_PROXY_TOKEN": proxy.token,
                     "LIGHTNING_PROXY_CONTROL_TOKEN": "", "XDG_CACHE_HOME": str(proxy.traces_dir)}
    bad = _cli("ctl", "pause", env=harness_token, check=False)  # no fallback to the proxy token
    assert bad.returncode != 0 and "401" in bad.stderr
    bad = _cli("ctl", "reward", "x", "1", "--info", "{oops", env=env, check=False)
    assert bad.returncode != 0 and "--info is not JSON" in bad.stderr
    (row,) = read_rewards(proxy)
    assert (row["rollout_id"], row["attempt"], row["reward"]) == ("cli-r", 1, 0.75)


def test_yaml_config_with_flag_override(make_proxy, tmp_path, stub_server, openai_from_env):
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        route_hosts: [api.anthropic-like.test]
        model_map: {{gpt-4o: from-yaml}}
        served_model: ignored-because-mapped
        upstreams:
          - url: {stub_server.url}
            inject_token_ids: false
        """))
    p = make_proxy(route_hosts=[], extra_args=["--config", str(cfg)])
    env = p.env_for("yaml")
    env["OPENAI_BASE_URL"] = "http://api.anthropic-like.test/v1"
    openai_from_env(env).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    sent = stub_server.requests()[-1]
    # flags given by ProxyProcess (--upstream) override the YAML pool, whose inject flag is gone
    assert sent["model"] == "from-yaml" and sent.get("return_token_ids") is True
    (span,) = read_spans(p)
    assert span["host"] == "api.anthropic-like.test" and span["served_model"] == "from-yaml"


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("upstreamz: [x]\n")
    r = _cli("serve", "--config", str(cfg), check=False)
    assert r.returncode == 2 and "unknown proxy config keys ['upstreamz']" in r.stderr


HARNESS = textwrap.dedent("""\
    import os, openai
    client = openai.OpenAI()  # configured only by the environment
    base = os.environ.get("HARNESS_BASE")
    if base:
        client = openai.OpenAI(base_url=base)
    s = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "q"}],
                                       max_tokens=3, stream=True)
    print("".join(c.choices[0].delta.content or "" for c in s if c.choices))
    import httpx
    httpx.post(os.environ["LIGHTNING_REWARD_URL"], json={"reward": 0.5})
""")


@pytest.mark.parametrize("base", [None, "https://api.openai.com/v1"], ids=["reverse-base-url", "https-forward"])
def test_unmodified_harness_with_printed_environment(proxy, tmp_path, base):
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    printed = _cli("env", "e2e", "--token", proxy.token, "--forward-port", str(proxy.forward_port),
                   "--reverse-port", str(proxy.reverse_port), "--confdir", str(proxy.confdir)).stdout
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    if base:
        env["HARNESS_BASE"] = base
    r = subprocess.run(["bash", "-c", f'{printed}\nexec "{sys.executable}" {script}'], capture_output=True,
                       text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "w0 w1 w2"
    (span,) = read_spans(proxy)
    assert span["rollout_id"] == "e2e" and span["stream"] is True and span["response_token_ids"] == [100, 101, 102]
    assert span["mode"] == ("forward" if base else "reverse")
    (reward,) = read_rewards(proxy)
    assert (reward["rollout_id"], reward["reward"], reward["source"]) == ("e2e", 0.5, "proxy")


def test_env_prints_what_anthropic_clients_read(tmp_path):
    args = ("env", "r", "--format", "json", "--confdir", str(tmp_path), "--token", "tok")
    out = json.loads(_cli(*args, env={"ANTHROPIC_API_KEY": ""}).stdout)
    assert out["ANTHROPIC_BASE_URL"] == out["OPENAI_BASE_URL"][: -len("/v1")] and "tok" not in out["ANTHROPIC_BASE_URL"]
    assert out["ANTHROPIC_API_KEY"] == "sk-lightning-placeholder"  # a placeholder only where none is set
    out = json.loads(_cli(*args, env={"ANTHROPIC_API_KEY": "sk-ant-user"}).stdout)
    assert out["ANTHROPIC_API_KEY"] == "sk-ant-user"
