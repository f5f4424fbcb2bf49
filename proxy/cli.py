"""``lightning-proxy``: run the capture proxy, print a harness environment, drive the control API."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
import urllib.parse

import click

from ..schemas.rewards import reward_from_object
from .client import BUNDLE_NAME, ProxyControl, ProxyError, control_token_path, default_confdir, harness_env, read_control_token
from .config import ProxyConfig, parse_model_map
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
      lightning-proxy serve --traces traces --upstream http://127.0.0.1:8000 --token SECRET
      eval "$(lightning-proxy env rollout-1 --token SECRET)"   # then run any harness
      lightning-proxy ctl state      # control token from the file `serve` wrote in its confdir
    """


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="YAML file; keys are the long option names with '_' (flags override it).")
@click.option("--traces", help="Traces root: spans/ and rewards/ Parquet parts go below it. [default: traces]")
@click.option("--listen-host", help="Interface both listeners bind to (0.0.0.0 for pods). [default: 127.0.0.1]")
@click.option("--forward-port", type=int, help="Forward-proxy port (HTTP_PROXY/HTTPS_PROXY). [default: 8080]")
@click.option("--reverse-port", type=int, help="Reverse-proxy port (OPENAI_BASE_URL) and control API. [default: 8081]")
@click.option("--token", envvar="LIGHTNING_PROXY_TOKEN", help="Proxy token harnesses must present; without one anyone can write traces. [env LIGHTNING_PROXY_TOKEN]")
@click.option("--control-token", envvar="LIGHTNING_PROXY_CONTROL_TOKEN", help="Bearer token of the control API, never given to harnesses. [default: generated, written to CONFDIR/control-token-<reverse port> (0600)]")
@click.option("--confdir", help="mitmproxy confdir holding the CA. [default: ~/.cache/lightning-harness/proxy-conf]")
@click.option("--upstream", "upstreams", multiple=True, help="Training upstream replica URL (repeat for a pool; each rollout sticks to one).")
@click.option("--route-host", "route_hosts", multiple=True, help="Host whose calls go to the pool (e.g. api.openai.com; '*' = every host). Repeatable.")
@click.option("--model-map", "model_map", multiple=True, help="NAME=SERVED: rename the model of routed calls. Repeatable.")
@click.option("--served-model", help="Model name every routed call is sent with (after --model-map).")
@click.option("--reverse-target", help="Reverse-mode target when no --upstream is given (e.g. https://api.openai.com).")
@click.option("--no-intercept", "no_intercept", multiple=True, help="Regex of host:port tunnelled without TLS interception (cert-pinned clients); never recorded. Repeatable.")
@click.option("--inject-token-ids/--no-inject-token-ids", default=None, help="Ask the pool for token ids and logprobs (and hide them from harnesses that did not ask). [default: on]")
@click.option("--model-version", type=int, help="Policy version stamped on spans until changed over the control API. [default: 0]")
@click.option("--ssl-insecure/--no-ssl-insecure", default=None, help="Do not verify upstream TLS certificates (test upstreams only).")
@click.option("--upstream-ca", type=click.Path(exists=True, dir_okay=False), help="PEM file of extra CAs trusted for upstream TLS.")
@click.option("--idle-timeout", type=float, help="Seconds without a byte either way before a connection is closed (a hung upstream becomes a 'timeout' error span). [default: 600]")
@click.option("--max-body-size", type=int, help="Largest model-call request body in bytes; larger ones get 413. [default: 32 MiB]")
@click.option("--max-decoded-size", type=int, help="Bytes a compressed body (or one SSE event) may expand to; past it: 413 / error span. [default: 64 MiB]")
@click.option("--max-inflight-bytes", type=int, help="Bytes of large request bodies processed at once; more calls wait their turn. [default: 256 MiB]")
@click.option("--shutdown-grace", type=float, help="Seconds SIGTERM waits for calls in flight; the rest become 'shutdown' error spans. [default: 5]")
@click.option("--lean/--full-mitmproxy", "lean", default=None, help="Load only the mitmproxy built-ins a capture proxy needs (faster), or stock DumpMaster's. [default: lean]")
@click.option("--flush-seconds", type=float, help="Longest time a span waits in memory (what a SIGKILL can lose). [default: 1]")
@click.option("--flush-rows", type=int, help="Write a part after this many rows. [default: 5000]")
@click.option("--flush-bytes", type=int, help="Write a part after this many buffered bytes. [default: 16 MiB]")
@click.option("--compact-seconds", type=float, help="Seconds between compactions of spans/ and rewards/ (many small parts -> a few large ones); 0: never. [default: 60]")
@click.option("--capture-failure", type=click.Choice(["reject", "serve"]), default=None, help="While spans cannot be written (disk full): 'reject' new model calls with 503 + Retry-After (nothing unrecorded), or 'serve' them and count what is not recorded. [default: reject]")
@click.option("--max-buffer-bytes", type=int, help="Most bytes of unwritten rows held per table while writes fail; past it new spans are refused/dropped. [default: 256 MiB]")
def serve(config_path, model_map, **flags) -> None:
    """Run the proxy: forward and reverse listeners, capture to Parquet, control API under /_lh/."""
    try:
        mm = parse_model_map(model_map) if model_map else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    config = _load(config_path, model_map=mm, **flags)
    _reexec_if_no_mitmproxy()
    _ensure_control_token(config)
    from .server import serve as run_server  # imports mitmproxy

    sys.exit(run_server(config))


def _reexec_if_no_mitmproxy() -> None:
    """Run from the training environment (no mitmproxy there): hand over to the proxy's Python."""
    import importlib.util
    import os

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
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="The proxy's YAML config (ports, token, confdir).")
@click.option("--host", "public_host", default=None, help="Host the harness reaches the proxy at. [default: the listen host, or 127.0.0.1]")
@click.option("--forward-port", type=int, help="Forward-proxy port. [default: 8080]")
@click.option("--reverse-port", type=int, help="Reverse-proxy port. [default: 8081]")
@click.option("--token", envvar="LIGHTNING_PROXY_TOKEN", help="Proxy token. [env LIGHTNING_PROXY_TOKEN]")
@click.option("--confdir", help="The proxy's confdir (where its CA bundle is).")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Key the harness sends upstream. [env OPENAI_API_KEY, else a placeholder]")
@click.option("--anthropic-api-key", envvar="ANTHROPIC_API_KEY", help="Key Anthropic clients send. [env ANTHROPIC_API_KEY, else a placeholder]")
@click.option("--format", "fmt", type=click.Choice(["export", "json", "dotenv"]), default="export", show_default=True)
def env(rollout_id, attempt, config_path, public_host, forward_port, reverse_port, token, confdir, api_key,
        anthropic_api_key, fmt) -> None:
    """Print the environment that sends an unmodified harness through the proxy.

    \b
    eval "$(lightning-proxy env my-rollout --token SECRET)"; python my_agent.py
    """
    cfg = _load(config_path, forward_port=forward_port, reverse_port=reverse_port, token=token, confdir=confdir)
    host = public_host or ("127.0.0.1" if cfg.listen_host in ("0.0.0.0", "::") else cfg.listen_host)
    bundle = cfg.resolved_confdir / BUNDLE_NAME
    if not bundle.exists():
        click.echo(f"warning: {bundle} does not exist yet; start `lightning-proxy serve` first", err=True)
    try:  # the harness gets a credential for this attempt only, never the token itself
        out = harness_env(
            rollout_id, attempt, cfg.token, f"http://{host}:{cfg.forward_port}", f"http://{host}:{cfg.reverse_port}", bundle, api_key,
            anthropic_api_key,
        )
    except InvalidId as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(_format_env(out, fmt))


@main.group()
@click.option("--url", envvar="LIGHTNING_PROXY_URL", default=None, help="Reverse listener URL. [env LIGHTNING_PROXY_URL, default http://127.0.0.1:8081]")
@click.option("--token", envvar="LIGHTNING_PROXY_CONTROL_TOKEN", help="Control token. [env LIGHTNING_PROXY_CONTROL_TOKEN, else the file `serve` generated in --confdir]")
@click.option("--confdir", help="The proxy's confdir (holds control-token-<port>). [default: ~/.cache/lightning-harness/proxy-conf]")
@click.pass_context
def ctl(ctx, url, token, confdir) -> None:
    """Drive a running proxy's control API; prints its JSON answer."""
    url = url or "http://127.0.0.1:8081"
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


@ctl.command()
@click.pass_obj
def state(c: ProxyControl) -> None:
    """paused, in_flight, held, spans_written, model_version, rewards_written, ..."""
    _run(c.state)


@ctl.command()
@click.pass_obj
def pause(c: ProxyControl) -> None:
    """Hold new model requests until resume."""
    _run(c.pause)


@ctl.command()
@click.pass_obj
def resume(c: ProxyControl) -> None:
    """Release held requests."""
    _run(c.resume)


@ctl.command()
@click.option("--timeout", type=float, default=60.0, show_default=True)
@click.pass_obj
def drain(c: ProxyControl, timeout) -> None:
    """Wait until no model call is in flight (or the timeout)."""
    _run(c.drain, timeout)


@ctl.command()
@click.pass_obj
def flush(c: ProxyControl) -> None:
    """Write buffered spans and rewards now."""
    _run(c.flush)


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
