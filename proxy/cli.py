"""``lightning-proxy``: run the capture proxy, print a harness environment, drive the control API."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import secrets
import shlex
import sys
import typing
import urllib.parse

import click

from ..process import free_port
from ..schemas.rewards import reward_from_object
from .client import BUNDLE_NAME, ProxyControl, ProxyError, control_token_path, harness_env, read_control_token
from .config import CONTROL_TOKEN_VAR, TOKEN_VAR, MiB, ProxyConfig, default_confdir, flag_names
from .credentials import InvalidId, check_attempt, check_rollout_id


def _load(config_path, **flags) -> ProxyConfig:
    try:
        return ProxyConfig.load(config_path, **flags)
    except (ValueError, OSError) as exc:
        raise click.UsageError(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Capture every OpenAI model call of an unmodified agent harness into Parquet.

    \b
    Quick start:
      export LIGHTNING_PROXY_TOKEN=SECRET   # a token on the command line is readable by every user
      lightning-proxy serve --traces traces --upstream http://127.0.0.1:8000
      eval "$(lightning-proxy env rollout-1)"   # then run any harness
      lightning-proxy ctl state      # control token from the file `serve` wrote in its confdir
    """


def proxy_options(*names: str, prefix: str = ""):
    """Click options for the named :class:`ProxyConfig` options (all when none is named), made from
    their one declaration. Each defaults to None, "not given", so a ``--config`` file keeps its say;
    ``prefix`` names them for a command with options of its own (the launcher's ``--proxy-token``)."""
    hints = typing.get_type_hints(ProxyConfig)
    chosen = [f for f in dataclasses.fields(ProxyConfig) if not names or f.name in names]

    def decorate(fn):
        for f in reversed(chosen):
            flag, off = flag_names(f, prefix)
            kind, meta = hints[f.name], f.metadata
            kw: dict = {"help": meta["help"] + _default_text(f), "default": None}
            if typing.get_origin(kind) in (list, dict):
                kw.update(multiple=True, default=())
            elif kind in (int, float):
                kw["type"] = kind
            if meta["choices"]:
                kw["type"] = click.Choice(meta["choices"])
            if meta["is_file"]:
                kw["type"] = click.Path(exists=True, dir_okay=False)
            if meta["envvar"]:
                kw["envvar"] = meta["envvar"]
            fn = click.option(f"{flag}/{off}" if off else flag, prefix.replace("-", "_") + f.name, **kw)(fn)
        return fn

    return decorate


def _default_text(f: dataclasses.Field) -> str:
    value = f.metadata["shown"] or (f.default if f.default is not dataclasses.MISSING else None)
    if f.metadata["envvar"]:
        return f" [env {f.metadata['envvar']}" + (f"; default: {value}]" if value else "]")
    if isinstance(value, bool):
        value = "on" if value else "off"
    elif isinstance(value, int) and value >= MiB and value % MiB == 0:
        value = f"{value // MiB} MiB"
    elif isinstance(value, float):
        value = f"{value:g}"
    return f" [default: {value}]" if value not in (None, "") else ""


# YAML keys named otherwise than their flag: a repeated flag's list goes under the plural (--upstream: upstreams)
_RENAMED = ", ".join(f"{f.metadata['flag']}: {f.name}" for f in dataclasses.fields(ProxyConfig) if f.metadata["flag"])


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help=f"YAML file; keys are the long option names with '_' (but {_RENAMED}); flags override it.")
@proxy_options()
def serve(config_path, **flags) -> None:
    """Run the proxy: forward and reverse listeners, capture to Parquet, control API under /_lh/."""
    config = _load(config_path, **flags)
    _check_exposure(config)
    if not os.environ.get("LIGHTNING_PROXY_REEXEC"):  # said once, not again by the re-executed process
        _warn_secret_flags(click.get_current_context())
    _reexec_if_no_mitmproxy()
    for name in ("forward_port", "reverse_port"):  # 0, "any free port": chosen now, so that the state, the
        if getattr(config, name) == 0:            # log line and the control token's file name give the real one
            setattr(config, name, free_port(config.listen_host))
    _ensure_control_token(config)
    from .server import serve as run_server  # imports mitmproxy

    sys.exit(run_server(config))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name may resolve to any interface


def _check_exposure(config: ProxyConfig) -> None:
    """A proxy that other machines reach must check who writes its traces and who drives it: listening
    beyond loopback needs a token and an access-checked control API."""
    if _is_loopback(config.listen_host):
        return
    where = f"--listen-host {config.listen_host} lets other machines reach the proxy"
    if not config.token:
        raise click.UsageError(f"{where}: give it a token (${TOKEN_VAR}, or --token), or listen on 127.0.0.1")
    if config.control_token == "":
        raise click.UsageError(f"{where}: --control-token '' would let any of them pause it and post rewards")


def _warn_secret_flags(ctx: click.Context, secrets_: tuple[tuple[str, str], ...] = (
        ("token", TOKEN_VAR), ("control_token", CONTROL_TOKEN_VAR))) -> None:
    """A token given as a flag sits in /proc/<pid>/cmdline, readable by every user (harnesses too).
    ``secrets_``: (parameter, the variable to give it in instead) of the command in ``ctx``."""
    for name, var in secrets_:
        if ctx.params.get(name) and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-")
            click.echo(f"warning: {flag} on the command line is readable by every user of this machine "
                       f"(/proc/<pid>/cmdline); give it as ${var}", err=True)


def _reexec_if_no_mitmproxy() -> None:
    """Run from the training environment (no mitmproxy there): hand over to the proxy's Python."""
    import importlib.util

    if importlib.util.find_spec("mitmproxy") is not None:
        return
    from .locate import proxy_python

    try:
        python = proxy_python()
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    if os.environ.get("LIGHTNING_PROXY_REEXEC") or os.path.abspath(python) == os.path.abspath(sys.executable):
        raise click.ClickException(f"{python} cannot import mitmproxy; set LIGHTNING_PROXY_PYTHON")
    os.environ["LIGHTNING_PROXY_REEXEC"] = "1"
    os.execv(python, [python, "-m", "lightning_harness.proxy", *sys.argv[1:]])


def _ensure_control_token(config: ProxyConfig) -> None:
    """Without --control-token, generate one (never the harness token) into a 0600 file that
    `lightning-proxy ctl` reads; ``--control-token ""`` leaves the control API open on purpose."""
    if config.control_token == "":
        click.echo("warning: --control-token '': anyone reaching the reverse port can drive the proxy", err=True)
        return
    if config.control_token is not None:
        if config.token and config.control_token == config.token:
            click.echo("warning: control token = proxy token, set explicitly", err=True)
        return
    config.control_token = secrets.token_urlsafe(24)
    path = control_token_path(config.resolved_confdir, config.reverse_port)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(config.control_token + "\n")
    os.replace(tmp, path)
    click.echo(f"control token generated: {path} (read by `lightning-proxy ctl --confdir {path.parent}`)", err=True)


def _format_env(env: dict[str, str], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(env, indent=2)
    if fmt == "dotenv":
        return "\n".join(f"{k}={shlex.quote(v) if v else ''}" for k, v in env.items())
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


@main.command()
@click.argument("rollout_id")
@click.option("--attempt", type=int, default=0, show_default=True, help="Attempt number of the rollout.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="The proxy's YAML config (ports, token, confdir).")
@click.option("--host", "public_host", default=None,
              help="Host the harness reaches the proxy at. [default: the listen host, or 127.0.0.1]")
@proxy_options("forward_port", "reverse_port", "token", "confdir")
@click.option("--api-key", envvar="OPENAI_API_KEY",
              help="Key the harness sends upstream. [env OPENAI_API_KEY, else a placeholder]")
@click.option("--anthropic-api-key", envvar="ANTHROPIC_API_KEY",
              help="Key Anthropic clients send. [env ANTHROPIC_API_KEY, else a placeholder]")
@click.option("--format", "fmt", type=click.Choice(["export", "json", "dotenv"]), default="export", show_default=True)
def env(rollout_id, attempt, config_path, public_host, api_key, anthropic_api_key, fmt, **proxy_flags) -> None:
    """Print the environment that sends an unmodified harness through the proxy.

    \b
    export LIGHTNING_PROXY_TOKEN=SECRET   # read from the environment: a flag is readable by every user
    eval "$(lightning-proxy env my-rollout)"; python my_agent.py
    """
    _warn_secret_flags(click.get_current_context(), (("token", TOKEN_VAR),))
    cfg = _load(config_path, **proxy_flags)
    host = public_host or cfg.local_host
    bundle = cfg.resolved_confdir / BUNDLE_NAME
    if not bundle.exists():
        click.echo(f"warning: {bundle} does not exist yet; start `lightning-proxy serve` first", err=True)
    try:  # the harness gets a credential for this attempt only, never the token itself
        out = harness_env(rollout_id, attempt, cfg.token, f"http://{host}:{cfg.forward_port}",
                          f"http://{host}:{cfg.reverse_port}", bundle, api_key, anthropic_api_key)
    except InvalidId as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(_format_env(out, fmt))


@main.group()
@click.option("--url", envvar="LIGHTNING_PROXY_URL", default=None,
              help="Reverse listener URL. [env LIGHTNING_PROXY_URL, default http://127.0.0.1:8081]")
@click.option("--token", envvar=CONTROL_TOKEN_VAR,
              help="Control token. [env LIGHTNING_PROXY_CONTROL_TOKEN, else the file `serve` generated in --confdir]")
@click.option("--confdir",
              help="The proxy's confdir (holds control-token-<port>). [default: ~/.cache/lightning-harness/proxy-conf]")
@click.pass_context
def ctl(ctx, url, token, confdir) -> None:
    """Drive a running proxy's control API; prints its JSON answer."""
    url = url or "http://127.0.0.1:8081"
    _warn_secret_flags(ctx, (("token", CONTROL_TOKEN_VAR),))
    if not token:
        port = urllib.parse.urlsplit(url).port or 80
        token = read_control_token(confdir or default_confdir(), port)
    ctx.obj = ProxyControl(url, token)


def _run(fn, *args):
    try:
        click.echo(json.dumps(fn(*args), indent=2))
    except ProxyError as exc:
        raise click.ClickException(str(exc)) from None
    except InvalidId as exc:
        raise click.BadParameter(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot reach the proxy: {exc}") from None


def _plain_call(name: str, doc: str) -> None:
    """A ``ctl`` command that makes one control call without arguments and prints the answer."""
    @ctl.command(name, help=doc)
    @click.pass_obj
    def command(c: ProxyControl) -> None:
        _run(getattr(c, name))


for _name, _doc in (("state", "paused, in_flight, held, spans_written, model_version, rewards_written, ..."),
                    ("pause", "Hold new model requests until resume."), ("resume", "Release held requests."),
                    ("flush", "Write buffered spans and rewards now.")):
    _plain_call(_name, _doc)


@ctl.command()
@click.option("--timeout", type=float, default=60.0, show_default=True)
@click.pass_obj
def drain(c: ProxyControl, timeout) -> None:
    """Wait until no model call is in flight (or the timeout)."""
    _run(c.drain, timeout)


@ctl.command("model-version")
@click.argument("version", type=int)
@click.pass_obj
def model_version(c: ProxyControl, version) -> None:
    """Stamp VERSION on spans forwarded from now on."""
    _run(c.set_model_version, version)


@ctl.command()
@click.argument("rollout_id")
@click.argument("reward", type=float)
@click.option("--attempt", type=int, default=0, show_default=True)
@click.option("--info", default=None, help="JSON object stored with the reward.")
@click.pass_obj
def reward(c: ProxyControl, rollout_id, reward, attempt, info) -> None:
    """Record REWARD for ROLLOUT_ID."""
    try:
        info_obj = json.loads(info) if info else None
    except ValueError as exc:
        raise click.BadParameter(f"--info is not JSON: {exc}") from None
    _run(c.reward, rollout_id, attempt, reward, info_obj)


def read_rewards_file(path: str) -> list[tuple[str, int, float, dict]]:
    """Every line of a rewards JSONL file, checked before any is posted: ``{"rollout_id": str,
    "reward": number, "attempt": int (default 0), "info": {...} (optional)}``. Raises one error
    naming every bad line, so a typo on line 900 does not leave 899 rewards half-imported."""
    rows, bad = [], []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                reward, info = reward_from_object(obj)
                rows.append((check_rollout_id(obj.get("rollout_id")), check_attempt(obj.get("attempt", 0)),
                             reward, info or {}))
            except ValueError as exc:  # InvalidId and JSONDecodeError are ValueErrors
                bad.append(f"line {n}: {exc}")
    if bad:
        raise click.ClickException(f"{path}: {len(bad)} bad line(s), nothing posted:\n  " + "\n  ".join(bad[:20]))
    return rows


@ctl.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.pass_obj
def rewards(c: ProxyControl, path) -> None:
    """Post every reward in PATH, a JSONL file (one {"rollout_id", "reward", "attempt", "info"} per line).

    For rewards that arrive after the traffic (user feedback, a grader run later): the file is checked
    whole first; re-posting it is harmless, since the latest reward of an attempt wins.

    \b
    Example:
      lightning-proxy ctl rewards graded.jsonl
    """
    rows = read_rewards_file(path)
    for done, (rollout_id, attempt, reward, info) in enumerate(rows):
        try:
            c.reward(rollout_id, attempt, reward, info)
        except (ProxyError, OSError) as exc:
            raise click.ClickException(f"posted {done} of {len(rows)}; {rollout_id}~{attempt} failed: {exc} "
                                       f"(re-run to post the rest: reposting is harmless)") from None
    click.echo(json.dumps({"posted": len(rows)}))


@ctl.command()
@click.argument("rollout_id")
@click.option("--attempt", type=int, default=0, show_default=True)
@click.pass_obj
def end(c: ProxyControl, rollout_id, attempt) -> None:
    """Revoke ROLLOUT_ID~ATTEMPT's credential (its model calls and reward posts are refused)."""
    _run(c.end, rollout_id, attempt)


if __name__ == "__main__":
    main()
