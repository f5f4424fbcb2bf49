"""Fixtures for compatibility tests: third-party clients run as separate processes that get ONLY the
environment ``ProxyProcess.env_for()`` prints (Contract 2), plus PATH/HOME so they can start.

``client_env(env)`` builds that environment; ``run_client(cmd, env)`` runs a client program from
``tests/support/compat/`` and returns its JSON output; ``node_openai`` installs the official
``openai`` npm package once into ``~/.cache/lightning-harness/node/<key>`` (keyed on the package
and Node major version, so CI on a fresh clone installs it and later runs reuse it) and returns a
directory with ``node_modules`` to run Node clients from. It skips only if ``node``/``npm`` are missing.
``node_anthropic`` does the same for the official ``@anthropic-ai/sdk`` npm package;
``openai_agents_python`` likewise builds a virtual environment with the OpenAI Agents SDK.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COMPAT = Path(__file__).parent / "support" / "compat"
OPENAI_NODE_VERSION = "6.39.1"  # the official `openai` npm package, pinned: the cache key follows it
ANTHROPIC_NODE_VERSION = "1.14.0"  # the official `@anthropic-ai/sdk` npm package, pinned likewise
OPENAI_AGENTS_VERSION = "0.24.0"  # the OpenAI Agents SDK (PyPI `openai-agents`), pinned likewise
PASS_THROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT")


def client_env(env: dict[str, str], **extra: str) -> dict[str, str]:
    """Exactly the printed harness environment plus what any process needs to start at all."""
    base = {k: os.environ[k] for k in PASS_THROUGH if k in os.environ}
    return {**base, **env, **extra}


def run_client(cmd: list[str], env: dict[str, str], timeout: float = 180, cwd: str | os.PathLike | None = None) -> dict:
    """Run a client program; it must exit 0 and print one JSON object on its last stdout line."""
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd, start_new_session=True)
    assert p.returncode == 0, \
        f"{cmd[:3]} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert lines, f"{cmd[:3]} printed nothing; stderr:\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


def python_client(name: str, *args: str) -> list[str]:
    """Command running tests/support/compat/<name> with the training environment's Python."""
    return [sys.executable, str(COMPAT / name), *map(str, args)]


def _node_major() -> str:
    out = subprocess.run(["node", "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    return out.lstrip("v").split(".")[0] or "unknown"


def _direct_env() -> dict[str, str]:
    """The test process may itself run inside a harness environment: installers must reach their
    registry directly."""
    return {k: v for k,
            v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}


def install_once(kind: str, key: str, ready: str, build) -> Path:
    """Build ``~/.cache/lightning-harness/<kind>/<key>`` once: ``build(tmp_dir)`` fills a temp folder
    (locked against parallel runs) that is renamed into place; ``ready`` is a path inside it that
    exists only when a build completed."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning-harness" / kind
    base.mkdir(parents=True, exist_ok=True)
    dest = base / key
    if (dest / ready).exists():
        return dest
    with open(base / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / ready).exists():
            return dest
        tmp = base / f".{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            build(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return dest


def _run_installer(cmd: list[str], cwd: Path) -> None:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, env=_direct_env())
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def install_node_package(spec: str, key: str) -> Path:
    """``npm install spec`` into ``~/.cache/lightning-harness/node/<key>`` once."""
    name = spec.rsplit("@", 1)[0]

    def build(tmp: Path) -> None:
        (tmp / "package.json").write_text(json.dumps({"name": f"lh-{key}", "private": True}))
        _run_installer(["npm", "install", "--no-audit", "--no-fund", "--no-save", "--loglevel=error", spec], tmp)

    return install_once("node", key, f"node_modules/{name}/package.json", build)


def install_python_app_env(spec: str, key: str) -> Path:
    """A virtual environment of its own holding ``spec`` (a third-party framework a harness is
    written with), in ``~/.cache/lightning-harness/pyapps/<key>``; returns its Python."""

    def build(tmp: Path) -> None:
        # only `<venv>/bin/python -m ...` is used: it keeps working after the folder is renamed
        _run_installer([sys.executable, "-m", "venv", str(tmp / "venv")], tmp)
        _run_installer([str(tmp / "venv" / "bin" / "python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", spec], tmp)

    return install_once("pyapps", key, "venv/bin/python", build) / "venv" / "bin" / "python"


@pytest.fixture(scope="session")
def node_openai() -> Path:
    """A directory whose ``node_modules`` holds the official openai npm package."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node/npm not installed: the Node openai client cannot be tested here")
    key = f"openai-{OPENAI_NODE_VERSION}-node{_node_major()}"
    return install_node_package(f"openai@{OPENAI_NODE_VERSION}", key)


@pytest.fixture(scope="session")
def node_anthropic() -> Path:
    """A directory whose ``node_modules`` holds the official Anthropic npm package."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node/npm not installed: the Node Anthropic client cannot be tested here")
    key = f"anthropic-{ANTHROPIC_NODE_VERSION}-node{_node_major()}"
    return install_node_package(f"@anthropic-ai/sdk@{ANTHROPIC_NODE_VERSION}", key)


@pytest.fixture(scope="session")
def openai_agents_python() -> Path:
    """A Python with the OpenAI Agents SDK, in an environment of its own (as a user's app has)."""
    key = f"openai-agents-{OPENAI_AGENTS_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}"
    return install_python_app_env(f"openai-agents=={OPENAI_AGENTS_VERSION}", key)


@pytest.fixture
def node_app(node_openai, tmp_path):
    """``node_app(script)``: command running tests/support/compat/<script> with node_modules beside it."""
    app = tmp_path / "node-app"
    app.mkdir(exist_ok=True)
    link = app / "node_modules"
    if not link.exists():
        link.symlink_to(node_openai / "node_modules", target_is_directory=True)

    def make(script: str, *args: str) -> list[str]:
        shutil.copy(COMPAT / script, app / script)
        return ["node", str(app / script), *map(str, args)]

    return make
