"""Proxy options are declared once (``ProxyConfig``): each one is a ``serve`` flag, a YAML key, and
reaches the child's command line (or environment, for secrets) that ``ProxyProcess`` starts."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lightning_harness.proxy.cli import serve
from lightning_harness.proxy.client import ProxyProcess
from lightning_harness.proxy.config import ProxyConfig, flag_names, parse_pairs


def _changed_everywhere(tmp_path) -> ProxyConfig:
    """A config whose every option differs from its default (so every one must travel)."""
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    values = {
        "traces": str(tmp_path / "t"), "listen_host": "127.0.0.2", "forward_port": 1111, "reverse_port": 2222,
        "token": "tok", "control_token": "ctl", "confdir": str(tmp_path / "conf"),
        "upstreams": ["http://a:1/v1", "https://b"], "route_hosts": ["api.openai.com", "*"],
        "public_hosts": ["proxy.ns.svc"],
        "model_map": {"gpt-4o": "policy", "x": "y=z"}, "served_model": "served", "reverse_target": "https://c",
        "no_intercept": ["pinned:443"], "model_version": 7, "idle_timeout": 12.5, "max_body_size": 3,
        "max_decoded_size": 4, "max_inflight_bytes": 5, "max_connections": 9, "shutdown_grace": 0.25,
        "ssl_insecure": True,
        "upstream_ca": str(ca), "lean": False, "gc_young": 2000, "flush_seconds": 0.2, "flush_rows": 6,
        "flush_bytes": 7, "fsync": False, "compact_seconds": 0.0, "capture_failure": "serve", "max_buffer_bytes": 8,
        "inject_token_ids": False,
    }
    names = {f.name for f in dataclasses.fields(ProxyConfig)}
    assert set(values) == names, "a new option needs a value here: " + str(names ^ set(values))
    config = ProxyConfig.from_mapping(values)
    for f in dataclasses.fields(ProxyConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert getattr(config, f.name) != default, f.name
    return config


def _parse_serve(argv: list[str], env: dict[str, str], monkeypatch) -> ProxyConfig:
    """What ``serve`` would run with, parsed by its own click command (nothing started)."""
    for var in ("LIGHTNING_PROXY_TOKEN", "LIGHTNING_PROXY_CONTROL_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    ctx = serve.make_context("serve", list(argv))
    params = dict(ctx.params)
    return ProxyConfig.load(params.pop("config_path"), **params)


def test_every_option_is_a_flag_a_yaml_key_and_survives_the_child_command_line(tmp_path, monkeypatch):
    config = _changed_everywhere(tmp_path)
    flags = {opt for p in serve.params for opt in (*p.opts, *p.secondary_opts)}
    for f in dataclasses.fields(ProxyConfig):
        flag, off = flag_names(f)
        assert flag in flags and (off is None or off in flags), f.name
    # config file: every field name is a key
    as_yaml = tmp_path / "all.yaml"
    as_yaml.write_text(yaml.safe_dump({**dataclasses.asdict(config), "upstreams": [u.url for u in config.upstreams]}))
    assert ProxyConfig.load(as_yaml) == config
    # child command line: config -> argv + env -> serve's parser -> the same config
    proc = ProxyProcess(config, python="python", log_path=tmp_path / "p.log")
    argv = proc.command()
    assert argv[:4] == ["python", "-m", "lightning_harness.proxy", "serve"]
    assert "tok" not in argv and "ctl" not in argv  # secrets never on argv
    child_env = proc._child_env()
    secrets = {k: child_env[k] for k in ("LIGHTNING_PROXY_TOKEN", "LIGHTNING_PROXY_CONTROL_TOKEN")}
    assert secrets == {"LIGHTNING_PROXY_TOKEN": "tok", "LIGHTNING_PROXY_CONTROL_TOKEN": "ctl"}
    assert _parse_serve(argv[4:], secrets, monkeypatch) == config


def test_defaults_stay_off_the_command_line_so_a_config_file_keeps_its_say(tmp_path, monkeypatch):
    proc = ProxyProcess(tmp_path / "t", python="python", confdir=tmp_path / "conf", control_token="")
    argv = proc.command()[4:]
    assert argv == ["--traces", str(tmp_path / "t"), "--control-token", "", "--confdir", str(tmp_path / "conf")]
    parsed = _parse_serve(argv, {"LIGHTNING_PROXY_TOKEN": proc.token}, monkeypatch)
    assert parsed == proc.config and parsed.control_token == "" and parsed.token == proc.token


def test_process_keywords_and_config_object_give_the_same_process(tmp_path):
    by_name = ProxyProcess(tmp_path / "t", upstreams=["http://a:1"], served_model="m", token="t", control_token="c",
                           confdir=tmp_path, python="python")
    given = ProxyProcess(ProxyConfig.from_mapping({"traces": tmp_path / "t", "upstreams": ["http://a:1"],
                                                  "served_model": "m", "token": "t", "control_token": "c",
                                                  "confdir": tmp_path}), python="python")
    assert by_name.command() == given.command() and by_name.config == given.config
    with pytest.raises(ValueError, match="unknown proxy config keys \\['served_name'\\]"):
        ProxyProcess(tmp_path, served_name="typo")
    with pytest.raises(ValueError, match="per-upstream inject_token_ids has no flag"):
        ProxyProcess(tmp_path, upstreams=[{"url": "http://a:1", "inject_token_ids": False}], python="p").command()


def test_key_value_pairs_one_parser():
    assert parse_pairs(["A=1", "B=x=y", "C="], "--env") == {"A": "1", "B": "x=y", "C": ""}
    assert parse_pairs([" a = b "], "--model-map", strip=True) == {"a": "b"}
    with pytest.raises(ValueError, match="--env expects KEY=VALUE, got 'oops'"):
        parse_pairs(["oops"], "--env")


def test_started_proxy_runs_with_the_declared_options(make_proxy):
    """A real proxy from ProxyProcess: options reach it (the model version it reports)."""
    p = make_proxy(model_version=4, served_model="policy", flush_seconds=0.2, gc_young=1234)
    state = p.control.state()
    assert state["model_version"] == 4 and state["forward_port"] == p.forward_port
    assert "python gc thresholds (1234, 10, 10)" in p.log_path.read_text()  # the collector's young generation
