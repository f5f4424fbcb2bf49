"""``lightning-launch``: run a batch of harness rollouts against a model, captured and rewarded.

Why a CLI over the Python API: evaluation and data collection are the same batch as a training
step without the update; a person runs it by hand, the trainer calls :mod:`.batch` directly.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import click
from rich.console import Console
from rich.markup import escape

from lightning_harness.process import exit_code
from lightning_harness.proxy.cli import proxy_options
from lightning_harness.proxy.client import BUNDLE_NAME, ProxyError, ProxyProcess
from lightning_harness.proxy.config import CONTROL_TOKEN_VAR, TOKEN_VAR, ProxyConfig, parse_pairs
from lightning_harness.schemas.states import FINISHED, RETRY_FAILURES

from .identity import batch_run_id
from .local import passed_env
from .proxy_link import ProxyLink
from .tasks import TaskFileError, load_tasks

console = Console(stderr=True)
EXIT_FAILURES = 1
EXIT_CANCELLED = 130


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Run agent harnesses on tasks through the capture proxy; record spans, rewards and rollouts.

    \b
    Quick start (an OpenAI-compatible server already running):
      lightning-launch run tasks.jsonl --upstream http://127.0.0.1:8000 --traces traces \\
          --samples 4 --concurrency 8 -- python examples/calc/harness.py
    \b
    Or let it start vLLM from a model directory:
      lightning-launch run tasks.jsonl --model examples/calc/model --traces traces -- python my_agent.py
    """


@main.command(context_settings={"max_content_width": 110})
@click.argument("task_file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("harness_argv", nargs=-1, type=click.UNPROCESSED)
@click.option("--cmd", "shell_cmd",
              help="Harness as a shell command line instead of argv after '--'. {task_id}, {rollout_id}, {attempt}, "
                   "{output_dir} and task fields are substituted (shell-quoted).")
@click.option("--traces", type=click.Path(file_okay=False, path_type=Path), default=Path("traces"), show_default=True,
              help="Traces root: spans/, rewards/, rollouts/ Parquet and launch/ (per-attempt logs and files).")
@click.option("--samples", "-n", type=click.IntRange(1), default=1, show_default=True,
              help="Rollouts per task (the group size).")
@click.option("--concurrency", "-j", type=click.IntRange(1), default=4, show_default=True,
              help="Harnesses running at once.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds per attempt; then its whole process tree (or Job) is killed.")
@click.option("--retries", type=click.IntRange(0), default=0, show_default=True,
              help="Extra attempts for a crashed or timed-out rollout (each a new attempt id).")
@click.option("--run-id",
              help="Batch id (prefix of every rollout id). [default: derived from the task file and command, so a "
                   "re-run resumes]")
@click.option("--split", default="train", show_default=True, help="Label stored on rollouts ('train', 'eval', ...).")
@click.option("--step", type=int, help="Training step stored on rollouts (and in rollout/group ids).")
@click.option("--id-field", help="Task field holding the task id. [default: task_id or id]")
@click.option("--private-field", "private_fields", multiple=True,
              help="Task field only the reward command sees (a solution, hidden tests); the harness gets the row "
                   "without it. Repeatable.")
@click.option("--limit", type=click.IntRange(1), help="Only the first N tasks.")
@proxy_options("upstreams")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Start vLLM on this model directory (stopped at the end).")
@click.option("--served-name",
              help="Model name served by --model / sent to the upstreams. [default: the model folder name]")
@click.option("--max-model-len", type=click.IntRange(16),
              help="Context length of the vLLM started by --model. [default: the model's, at most 4096]")
@click.option("--engine-arg", "engine_args", multiple=True,
              help="Extra argument for the vLLM server started by --model (repeat; e.g. --engine-arg=--seed=0).")
@proxy_options("route_hosts")
@click.option("--proxy-url", help="Use this running proxy (its reverse listener URL) instead of starting one.")
@proxy_options("token", prefix="proxy-")
@proxy_options("control_token", prefix="proxy-")
@click.option("--proxy-forward-url", help="Forward listener of the running proxy. [default: asked from the proxy]")
@click.option("--proxy-ca", type=click.Path(exists=True, dir_okay=False),
              help="CA bundle of the running proxy. [default: the proxy's default confdir]")
@proxy_options("confdir", prefix="proxy-")
@click.option("--api-key", envvar=["LIGHTNING_API_KEY", "OPENAI_API_KEY"], show_envvar=False,
              help="OPENAI_API_KEY handed to harnesses (never recorded). [env LIGHTNING_API_KEY, then OPENAI_API_KEY; "
                   "default: a placeholder]")
@click.option("--reward-cmd",
              help="Shell command scoring a finished attempt; prints a number or {\"reward\": x}. Sees LIGHTNING_TASK, "
                   "LIGHTNING_OUTPUT_DIR, LIGHTNING_LOG_FILE; {placeholders} as in --cmd.")
@click.option("--self-reward/--no-self-reward", default=True, show_default=True,
              help="Without --reward-cmd, take the harness's own report (LIGHTNING_REWARD_FILE, a POST to "
                   "LIGHTNING_REWARD_URL) as its reward. Off: only the verifier (--reward-cmd, the operator's "
                   "control-API post) counts. With --reward-cmd, self-reports never count.")
@click.option("--run-as", multiple=True,
              help="Run every harness as this unprivileged USER (or USER:GROUP; names or ids), no supplementary "
                   "groups, from its private attempt folder: it cannot read the proxy's secrets, write the traces, "
                   "signal the proxy or vLLM, or read other attempts (docs/LAUNCH.md). Repeat for one user per running "
                   "attempt (at most that many run at once). Needs root; refuses root. The --reward-cmd verifier keeps "
                   "the launcher's user.")
@click.option("--reward-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds allowed to --reward-cmd.")
@click.option("--k8s", "k8s_template", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Run each attempt as a Kubernetes Job rendered from this Jinja2 YAML template.")
@click.option("--k8s-namespace", default="default", show_default=True, help="Namespace of the Jobs.")
@click.option("--k8s-proxy-host",
              help="Host/IP at which pods reach this machine's proxy (the started proxy then listens on 0.0.0.0).")
@click.option("--k8s-keep", is_flag=True, help="Keep finished Jobs (debugging); their TTL still applies.")
@click.option("--cwd", type=click.Path(exists=True, file_okay=False),
              help="Working directory of the harnesses. [default: here]")
@click.option("--env", "extra_env", multiple=True, help="KEY=VALUE added to every harness environment. Repeatable.")
@click.option("--pass-env", "pass_env", multiple=True, metavar="NAME",
              help="Pass this variable of the launcher's environment (glob: 'HF_*') to every harness and scorer. "
                   "Unasked they get only PATH, HOME, USER, LOGNAME, SHELL, locale, TZ, TERM, TMPDIR, PYTHONPATH, "
                   "VIRTUAL_ENV (and the proxy's own variables): "
                   "harnesses run model-written commands. Repeatable.")
@click.option("--service", metavar="CMD",
              help="Shell command of a harness service started once before the rollouts and stopped after: it and "
                   "every harness get its Unix socket path as LIGHTNING_HARNESS_SERVICE (launcher/service.py).")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Skip rollouts this run id already finished in --traces.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Live progress bar.")
def run(task_file, harness_argv, shell_cmd, **opts) -> None:
    """Run every task of TASK_FILE (.jsonl, .json or .parquet) SAMPLES times with the harness after '--'.

    \b
    Each harness gets (docs/ARCHITECTURE.md, Contract 2): HTTP(S)_PROXY with its rollout credentials,
    a CA bundle (SSL_CERT_FILE, REQUESTS_CA_BUNDLE, NODE_EXTRA_CA_CERTS), OPENAI_BASE_URL/OPENAI_API_KEY,
    LIGHTNING_ROLLOUT_ID, LIGHTNING_ATTEMPT, LIGHTNING_TASK (JSON), LIGHTNING_TASK_FILE,
    LIGHTNING_REWARD_URL, LIGHTNING_REWARD_FILE and LIGHTNING_OUTPUT_DIR.
    \b
    Exit status: 0 all rollouts finished without failure, 1 some failed or timed out, 2 bad usage, 130 interrupted
    (run the same command again to resume).
    """
    from .batch import BatchSettings

    o = SimpleNamespace(**opts)
    harness = _harness(shell_cmd, harness_argv, o)
    try:
        env = o.harness_env = {**passed_env(o.pass_env), **parse_pairs(o.extra_env, "--env")}
        tasks = load_tasks(task_file, id_field=o.id_field, limit=o.limit, private_fields=o.private_fields)
    except (TaskFileError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    runner = _runner(o)
    harness_text = harness if isinstance(harness, str) else shlex.join(harness)
    run_id = o.run_id or batch_run_id(task_file.stem, *(t.id for t in tasks), harness_text, o.split, str(o.step))
    (o.traces / "launch").mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]run[/] {run_id}: {len(tasks)} tasks x {o.samples} samples, concurrency {o.concurrency}, "
                  f"traces {o.traces}")
    _describe_runner(runner, o)
    settings = BatchSettings(
        traces_dir=o.traces, run_id=run_id, runner=runner, samples=o.samples, concurrency=o.concurrency,
        timeout=o.timeout, retries=o.retries, reward_cmd=o.reward_cmd, reward_timeout=o.reward_timeout,
        self_reward=o.self_reward, step=o.step, split=o.split, cwd=o.cwd, extra_env=env, skip_finished=o.resume,
        progress=o.progress)
    batch, results, code = _run_batch(harness or None, tasks, settings, o)
    sys.exit(_report(batch, results, code, o.traces, run_id))


def _harness(shell_cmd, harness_argv, o) -> list[str] | str:
    """The harness command, after the checks that need no file read (bad usage exits 2)."""
    harness = shell_cmd if shell_cmd else list(harness_argv)
    if shell_cmd and harness_argv:
        raise click.UsageError("give the harness either after '--' or with --cmd, not both")
    if not harness and not o.k8s_template:
        raise click.UsageError("no harness command: put it after '--' (e.g. -- python agent.py) or use --cmd")
    if not (o.upstreams or o.model_dir or o.proxy_url):
        raise click.UsageError("no model: give --upstream URL, --model DIR, or --proxy-url of a running proxy")
    if o.model_dir and o.upstreams:
        raise click.UsageError("--model starts an engine; do not also give --upstream")
    if o.proxy_url and (o.model_dir or o.upstreams):
        raise click.UsageError("--proxy-url uses a running proxy with its own upstreams; drop --model/--upstream")
    if o.k8s_template and not o.k8s_proxy_host:
        raise click.UsageError("--k8s needs --k8s-proxy-host: the address at which pods reach this machine's proxy")
    if o.run_as and o.k8s_template:
        raise click.UsageError("--run-as is for local harnesses; a Job's pod sets its own user (securityContext)")
    return harness


def _runner(o):
    """The runner of the attempts: local (as --run-as users) or Kubernetes Jobs; None = plain local."""
    if o.run_as:
        from .local import LocalRunner
        from .runas import RunAsError

        try:
            return LocalRunner(run_as=o.run_as)
        except RunAsError as exc:
            raise click.UsageError(str(exc)) from None
    if o.k8s_template:
        from .k8s import K8sRunner, K8sTemplateError

        try:
            return K8sRunner(o.k8s_template, namespace=o.k8s_namespace, proxy_host=o.k8s_proxy_host, keep=o.k8s_keep)
        except K8sTemplateError as exc:
            raise click.UsageError(f"{o.k8s_template}: {exc}") from None
    return None


def _describe_runner(runner, o) -> None:
    if runner is None or runner.name == "local":
        from .proctree import ProcessTree

        console.print(f"process trees: {ProcessTree.mechanism()} (every process a harness starts ends with it)")
    if o.run_as:
        who = ", ".join(f"{u.user} ({u.uid}:{u.gid})" for u in runner.run_as)
        console.print(f"harnesses run as {who}, no supplementary groups, one user per running attempt")
        if (users := len(runner.run_as)) < o.concurrency:
            console.print(f"[yellow]--run-as: {users} user(s), so at most {users} harness(es) at once (--concurrency "
                          f"{o.concurrency}); give one user per running attempt[/]")
        _warn_secret_argv()


def _run_batch(harness, tasks, settings, o):
    """Start the services, run the batch; SIGTERM and Ctrl-C stop every harness, flush, and return
    with code 130. Returns (batch or None, results, exit code so far)."""
    from .batch import BatchRunner

    def on_signal(signum, frame):  # SIGTERM behaves like Ctrl-C: stop children, flush, exit
        raise KeyboardInterrupt

    old_term, old_int = signal.signal(signal.SIGTERM, on_signal), signal.getsignal(signal.SIGINT)
    batch, results, code = None, [], 0
    with contextlib.ExitStack() as stack:
        try:
            checks: list = []
            try:
                link, service_env = _services(stack, checks, o)
            except click.ClickException:
                raise
            except Exception as exc:  # engine or proxy did not start: say why, stop what did start
                raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
            health = lambda: next((p for p in (c() for c in checks) if p), None)  # noqa: E731
            settings.extra_env = {**settings.extra_env, **service_env}
            batch = stack.enter_context(BatchRunner(harness, settings, proxy=link, health_check=health))
            batch.submit(tasks)
            if batch.stats.skipped:
                console.print(f"resuming: {batch.stats.skipped} rollouts already finished in {o.traces}")
            results = batch.wait()
        except KeyboardInterrupt:
            # a second Ctrl-C must not cut the cleanup short (harness groups, proxy, engine)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            console.print("[yellow]interrupted: stopping every harness and flushing...[/]")
            if batch is not None:
                batch.cancel()
                results = batch.results()
            code = EXIT_CANCELLED
    signal.signal(signal.SIGTERM, old_term)
    signal.signal(signal.SIGINT, old_int)
    return batch, results, code


def _report(batch, results, code: int, traces: Path, run_id: str) -> int:
    """Print the summary tables and the totals; the exit status (see ``run``)."""
    from .progress import summary_tables

    for table in summary_tables(results):
        console.print(table)
    if batch is not None:
        st = batch.stats
        console.print(f"{st.finished}/{st.total} finished ({st.skipped} from earlier runs) · {st.line()}",
                      highlight=False)
    failed = sum(r.state in RETRY_FAILURES for r in results)
    if batch is not None and batch.error:
        console.print(f"[red]batch stopped: {escape(batch.error)}[/]; run the same command again to resume")
        code = EXIT_FAILURES
    console.print(f"rollouts {traces / 'rollouts'}, spans {traces / 'spans'}; run id {run_id}")
    if code == EXIT_CANCELLED:
        console.print("cancelled: run the same command again to resume")
    elif failed:
        code = EXIT_FAILURES
    return code


def _warn_secret_argv() -> None:
    """Every user can read a process's command line (/proc/<pid>/cmdline): secrets given there reach
    the --run-as user too; the environment variables do not."""
    ctx = click.get_current_context()
    for name, env in (("proxy_token", TOKEN_VAR), ("proxy_control_token", CONTROL_TOKEN_VAR),
                      ("api_key", "LIGHTNING_API_KEY")):
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            opt = "--" + name.replace("_", "-")
            console.print(f"[yellow]warning: {opt} on the command line is readable by every user (harnesses too); use "
                          f"${env}[/]")


def _services(stack, checks, o) -> tuple[ProxyLink, dict[str, str]]:
    """Start (or attach to) the engine and the proxy, and the harness service; ``stack`` stops what was
    started, ``checks`` watch it. Returns the proxy link and what the service adds to each harness's
    environment."""
    service_env = _start_service(stack, checks, o) if o.service else {}
    if o.proxy_url:  # (the service first: harnesses need it with a running proxy too)
        return _attach_proxy(o), service_env
    upstreams, served_name = list(o.upstreams), o.served_name
    if o.model_dir:
        upstreams, served_name = [_start_engine(stack, checks, o)], served_name or Path(o.model_dir).name
    config = ProxyConfig.from_mapping({
        "traces": o.traces, "upstreams": upstreams, "token": o.proxy_token, "control_token": o.proxy_control_token,
        "served_model": served_name,
        "route_hosts": o.route_hosts, "confdir": o.proxy_confdir,
        "listen_host": "0.0.0.0" if o.k8s_template else "127.0.0.1",  # pods reach it from elsewhere
        "public_hosts": [o.k8s_proxy_host] if o.k8s_template and o.k8s_proxy_host else [],  # ... by this name
    })
    return _start_proxy(stack, checks, config, o.traces / "launch", o.api_key), service_env


def _start_service(stack, checks, o) -> dict[str, str]:
    """--service: started in the harnesses' folder; its socket path joins every harness's environment."""
    from .service import HarnessService

    if o.run_as or o.k8s_template:
        raise click.UsageError("--service runs beside local harnesses of one user: not with --run-as or --k8s")
    log = o.traces / "launch" / "harness-service.log"
    service = HarnessService(o.service, cwd=o.cwd or ".", log_path=log, env=o.harness_env)
    stack.callback(service.stop)
    service.start()
    checks.append(service.check)
    console.print(f"harness service ready at {service.socket_path} (log {log})")
    return service.env


def _attach_proxy(o) -> ProxyLink:
    try:
        ca = o.proxy_ca or (Path(o.proxy_confdir) / BUNDLE_NAME if o.proxy_confdir else None)  # the proxy's confdir
        link = ProxyLink.attach(o.proxy_url, o.proxy_token, forward_url=o.proxy_forward_url, ca_bundle=ca,
                                control_token=o.proxy_control_token, api_key=o.api_key)
    except (OSError, ProxyError, ValueError) as exc:
        raise click.ClickException(f"cannot use the proxy at {o.proxy_url}: {exc}") from None
    if not Path(link.ca_bundle).exists():
        raise click.ClickException(f"CA bundle {link.ca_bundle} not found; give the proxy's with --proxy-ca")
    console.print(f"using the running proxy at {o.proxy_url} (forward {link.forward_url})")
    return link


def _start_engine(stack, checks, o) -> str:
    """vLLM on --model; returns its URL."""
    from .engine import VLLMEngine

    served_name, log = o.served_name or Path(o.model_dir).name, o.traces / "launch" / "engine.log"
    with console.status(f"starting vLLM on {o.model_dir} (first start takes a minute or two on CPU)..."):
        engine = VLLMEngine.start(o.model_dir, served_name, max_model_len=o.max_model_len or _context_len(o.model_dir),
                                  extra_args=list(o.engine_args), log_path=log)
    stack.callback(engine.stop)
    checks.append(lambda: None if engine.process is None or (code := exit_code(engine.process)) is None
                  else f"vLLM exited with code {code} (log {log})")
    console.print(f"vLLM serving {served_name} at {engine.url} (log {log})")
    return engine.url


def _start_proxy(stack, checks, config: ProxyConfig, logs: Path, api_key: str | None) -> ProxyLink:
    from .batch import process_check

    proc = ProxyProcess(config, log_path=logs / "proxy.log")  # with a control token of its own: harnesses never hold it
    stack.callback(proc.stop)  # registered first: a signal during start still stops it
    with console.status("starting the capture proxy..."):
        proc.start()
    checks.append(process_check("capture proxy", proc))
    console.print(f"proxy forward {proc.forward_url}, reverse {proc.reverse_url} (log {logs / 'proxy.log'})")
    return ProxyLink.from_process(proc, api_key=api_key)


def _context_len(model_dir: Path, cap: int = 4096) -> int:
    """The model's own context length (config.json), capped: CPU KV cache is small."""
    import json

    try:
        n = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        n = None
    return min(int(n), cap) if n else 2048


@main.command()
@click.option("--traces", type=click.Path(exists=True, file_okay=False, path_type=Path), default=Path("traces"),
              show_default=True)
@click.option("--run-id", help="Only this run. [default: every run in --traces]")
def summary(traces, run_id) -> None:
    """Print reward by task and failures by cause for rollouts already in TRACES (final attempts)."""
    from .progress import summary_tables
    from .results import RolloutResult, load_history

    finals = []
    for _, hist in sorted(load_history(traces, run_id=run_id).items()):
        done = [r for r in hist.rows if r["state"] in FINISHED] or hist.rows  # the finishing attempt, else the latest
        finals.append(RolloutResult.from_row(max(done, key=lambda r: int(r["attempt"]))))
    if not finals:
        raise click.ClickException(f"no rollouts in {traces}" + (f" for run {run_id}" if run_id else ""))
    for table in summary_tables(finals):
        console.print(table)


if __name__ == "__main__":
    main()
