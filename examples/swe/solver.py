#!/usr/bin/env python
"""A scripted teacher that plays the coding agent: an OpenAI-compatible chat-completions server.

mini-swe-agent sends it the conversation; it answers with one `bash` tool call, the way a model
would, so the trajectories it produces are in the harness's own format (for the supervised warm
start) and it can stand in for vLLM in tests. It reads the task records (including `solution`: it is
the teacher) and plays a short policy from what the conversation shows so far:

    look at the module (sometimes run the tests first) -> edit -> run the tests -> submit

With the noise knobs it first applies a plausible wrong edit (another mutation inside the buggy
function), gives up, or submits without re-running the tests, so episodes vary from 2 to 8 calls and
in correctness. `--script FILE` (a JSON list of commands) makes it emit those commands in order and
then submit, for hostile tests. Stdlib only.

    python examples/swe/solver.py --port 8011 --tasks examples/swe/tasks_train.jsonl --noise 0.4
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate  # noqa: E402  (examples/swe is a folder of scripts, not a package)

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_CAT_N = re.compile(r"^ *\d+\t", re.MULTILINE)


@dataclass
class Noise:
    """Probabilities of the solver's mistakes (noise=0: always look, fix, test, submit)."""
    wrong_first: float = 0.35      # the first edit is a plausible wrong one
    give_up: float = 0.08          # submit right after looking, nothing fixed
    retry_wrong: float = 0.25      # after a failed test, another wrong edit instead of the fix
    test_first: float = 0.4        # run the tests before looking at the module
    skip_tests: float = 0.2        # submit right after the (correct) edit
    look_tests_too: float = 0.3    # cat the tests along with the module

    @classmethod
    def scaled(cls, level: float) -> Noise:
        """level 0 = a perfect solver; 1 = the defaults; in between, mistakes scale linearly."""
        base = cls()
        return cls(wrong_first=base.wrong_first * level, give_up=base.give_up * level,
                   retry_wrong=base.retry_wrong * level, test_first=base.test_first,
                   skip_tests=base.skip_tests * level, look_tests_too=base.look_tests_too)


def module_name(task: dict) -> str:
    return f"{task['project']}.py"


def test_name(task: dict) -> str:
    return f"test_{task['project']}.py"


# ---------------------------------------------------------------- edits as shell commands

SED_PATTERN_SPECIALS = set("\\/.*[]^$&'\n")
SED_REPLACEMENT_SPECIALS = set("\\/&'\n")


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"


def sed_span(old: str, new: str, others: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """The shortest whole-token span of the line old that differs from new and is its first
    occurrence in the line (what a line-addressed `s///` replaces), with its
    replacement: `s/i + 1/i/` rather than the whole line, as a person would write it. None when no
    such span avoids sed's special characters (the caller then edits with python). With ``others``
    (the file's other lines) the span is widened until it occurs in none of them."""
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    s = 0
    while s < min(len(old), len(new)) - p and old[-1 - s] == new[-1 - s]:
        s += 1
    a, b = p, len(old) - s
    while a > 0 and _is_word(old[a - 1]):
        a -= 1
    while b < len(old) and _is_word(old[b]):
        b += 1
    for _ in range(len(old) + 1):
        span = old[a:b]
        if span.strip() and old.find(span) == a and not any(span in x for x in others):
            repl = new[a:len(new) - (len(old) - b)]
            if not set(span) & SED_PATTERN_SPECIALS and not set(repl) & SED_REPLACEMENT_SPECIALS:
                return span, repl
            return None
        if a == 0 and b == len(old):
            return None
        a, b = max(0, a - 1), min(len(old), b + 1)
        while a > 0 and _is_word(old[a - 1]):
            a -= 1
        while b < len(old) and _is_word(old[b]):
            b += 1
    return None


def _unique_block(lines: list[str], start: int, stop: int) -> tuple[int, int]:
    """Grow lines[start:stop] by context until it occurs once in the file (so replace(..., 1) is exact)."""
    text = "".join(lines)
    while start > 0 or stop < len(lines):
        block = "".join(lines[start:stop])
        if block and text.count(block) == 1:
            break
        start, stop = max(0, start - 1), min(len(lines), stop + 1)
    return start, stop


def _replacements(a: list[str], b: list[str], hunks: list[tuple]) -> list[tuple[str, str]]:
    """(old, new) text pairs that turn a into b by `replace(old, new, 1)` each. Every hunk's block is
    grown until it is unique; blocks that then overlap are merged into one (a later pair's old text
    would otherwise be gone once the earlier pair is applied), and the pairs run from the bottom of the
    file up (an earlier pair's new text could otherwise hold a later pair's old text first)."""
    blocks: list[list] = []
    for hunk in hunks:
        _, i1, i2, _, _ = hunk
        lo, hi = (i1, i2) if i2 > i1 else (max(0, i1 - 1), i1)  # an insertion keeps the line before it
        lo, hi = _unique_block(a, lo, hi)
        group = [hunk]
        while blocks and lo < blocks[-1][1]:
            prev_lo, prev_hi, prev_group = blocks.pop()
            lo, hi, group = min(lo, prev_lo), max(hi, prev_hi), prev_group + group
        blocks.append([lo, hi, group])
    pairs = []
    for lo, hi, group in blocks:
        new, at = [], lo
        for _, i1, i2, j1, j2 in group:
            new += a[at:i1] + b[j1:j2]
            at = i2
        pairs.append(("".join(a[lo:hi]), "".join(new + a[at:hi])))
    return pairs[::-1]


def edit_command(module: str, current: str, target: str, addressed: bool = True) -> str:
    """A shell command turning current into target, in the simplest form that fits, addressed by the
    line numbers `cat -n` shows: `sed -i '9s/not amount/amount/'` (the shortest differing span),
    `sed -i '9s/.*/NEW LINE/'`, `sed -i '12a\\    return x'` (an inserted line), else a python heredoc.
    Without ``addressed``, the span is widened until no other line contains it and the line number
    dropped (`sed -i 's/if not amount/if amount/'`: the same edit, no number to copy from `cat -n`)."""
    a, b = current.splitlines(keepends=True), target.splitlines(keepends=True)
    hunks = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(hunks) == 1:
        tag, i1, i2, j1, j2 = hunks[0]
        if tag == "replace" and i2 - i1 == 1 == j2 - j1:
            old, new = a[i1].rstrip("\n"), b[j1].rstrip("\n")
            span = sed_span(old, new)
            wide = None if addressed else sed_span(old, new, tuple(a[:i1] + a[i1 + 1:]))
            if wide:
                return f"sed -i 's/{wide[0]}/{wide[1]}/' {module}"
            if span:
                return f"sed -i '{i1 + 1}s/{span[0]}/{span[1]}/' {module}"
            if not set(new) & SED_REPLACEMENT_SPECIALS:
                return f"sed -i '{i1 + 1}s/.*/{new}/' {module}"
        if tag == "insert" and i1 > 0 and j2 - j1 == 1 and not set(b[j1].rstrip("\n")) & SED_REPLACEMENT_SPECIALS:
            return f"sed -i '{i1}a\\{b[j1].rstrip(chr(10))}' {module}"
    body = "".join(f"s = s.replace({old!r}, {new!r}, 1)\n" for old, new in _replacements(a, b, hunks))
    return (f"python - <<'EOF'\nfrom pathlib import Path\np = Path({module!r})\ns = p.read_text()\n"
            f"{body}p.write_text(s)\nEOF")


# Runs a test file against a module in a fresh interpreter: for the solver's own mutants only (trusted
# code; run_suite's in-process alarm cannot be used from the server's handler threads). The reward's
# scorer, for model-written code, is reward.py's sandboxed runner.
_VISIBLE_RUNNER = r'''
import sys
folder, tests_file = sys.argv[1], sys.argv[2]
sys.path.insert(0, folder)
ns = {"__name__": "visible_tests"}
exec(compile(open(tests_file).read(), tests_file, "exec"), ns)
tests = [(k, v) for k, v in list(ns.items()) if k.startswith("test_") and callable(v)]
failed = 0
for name, fn in tests:
    try:
        fn()
    except Exception as exc:
        failed += 1
sys.exit(1 if failed or not tests else 0)
'''


def fails_visible_tests(task: dict, source: str, timeout: float = 5.0) -> bool:
    """True when source (one of our own mutants, not model-written) fails the visible tests without
    hanging: a wrong edit must look wrong to the agent (`not not x` mutants are correct code)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / module_name(task)).write_text(source)
        tests = Path(tmp) / test_name(task)
        tests.write_text(task["files"][test_name(task)])
        try:
            proc = subprocess.run([sys.executable, "-I", "-B", "-c", _VISIBLE_RUNNER, tmp, str(tests)],
                                  cwd=tmp, env={}, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode != 0


def wrong_edits(task: dict, current: str) -> list[str]:
    """Plausible wrong versions of the module: one more mutation inside the buggy function."""
    short = task["function"].split(".")[-1]
    out = []
    for fname, _family, src in generate.mutants(current):
        if fname.split(".")[-1] == short and src not in (task["solution"], current) and src not in out:
            out.append(src)
    return out


# ---------------------------------------------------------------- the policy

@dataclass
class Action:
    kind: str                      # look | test | fix | wrong | submit | script
    command: str
    thought: str
    file_after: str | None = None  # the module text this action leaves (edits only)


@dataclass
class Episode:
    """What the conversation so far says: task candidates, the solver's own past actions, outputs."""
    candidates: list[dict]
    actions: list[tuple[Action | None, str]] = field(default_factory=list)  # (action, observation)

    @property
    def calls(self) -> int:
        return len(self.actions)


class Policy:
    def __init__(self, tasks: list[dict], noise: Noise, seed: int = 0, step_limit: int = 8,
                 script: list[str] | None = None, thoughts: bool = False, addressed: bool = True) -> None:
        self.by_prompt: dict[str, list[dict]] = {}
        for t in tasks:
            self.by_prompt.setdefault(t["prompt"], []).append(t)
        self.noise, self.step_limit, self.script = noise, step_limit, script
        self.thoughts = thoughts  # a one-line reason before each call (off: content null, as a tiny model replies)
        self.addressed = addressed  # sed edits always carry the line number (else only where the span is ambiguous)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.memory: dict[str, Action] = {}  # tool-call id -> the action the solver took

    # -- reading the request
    def episode(self, messages: list[dict]) -> Episode:
        user = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        candidates = [t for p, ts in self.by_prompt.items() if p in user for t in ts]
        ep = Episode(candidates)
        outputs = {m.get("tool_call_id"): str(m.get("content") or "") for m in messages if m.get("role") == "tool"}
        for m in messages:
            for call in (m.get("tool_calls") or []) if m.get("role") == "assistant" else []:
                ep.actions.append((self.memory.get(call.get("id")), outputs.get(call.get("id"), "")))
        return ep

    @staticmethod
    def identify(ep: Episode) -> dict | None:
        if len(ep.candidates) == 1:
            return ep.candidates[0]
        seen = _CAT_N.sub("", "\n".join(out for _, out in ep.actions))  # `cat -n` numbers off
        hits = [t for t in ep.candidates if t["files"][module_name(t)].strip() in seen]
        # A module missing its last `return` is a prefix of its siblings: the longest match is the one shown.
        hits.sort(key=lambda t: -len(t["files"][module_name(t)]))
        if len(hits) > 1 and len(hits[0]["files"][module_name(hits[0])]) == len(hits[1]["files"][module_name(hits[1])]):
            return None
        return hits[0] if hits else None

    # -- deciding
    def decide(self, messages: list[dict]) -> Action:
        with self.lock:
            ep = self.episode(messages)
            action = self._decide(ep)
            return action

    def _decide(self, ep: Episode) -> Action:
        if self.script is not None:
            i = ep.calls
            return Action("script", self.script[i], "Running the next step.") if i < len(self.script) \
                else Action("submit", SUBMIT, "Done.")
        if not ep.candidates:
            return Action("submit", SUBMIT, "I cannot tell which project this is.")
        task = self.identify(ep)
        own = [a for a, _ in ep.actions if a is not None]
        looks = sum(a.kind == "look" for a in own)
        if task is None and looks >= 2:
            return Action("submit", SUBMIT, "I cannot find the bug; submitting.")
        if task is None or not looks:
            return self._explore(ep, ep.candidates[0], own)
        if ep.calls >= self.step_limit - 1:
            return Action("submit", SUBMIT, "Out of steps; submitting.")
        return self._work(ep, task, own)

    def _explore(self, ep: Episode, task: dict, own: list[Action]) -> Action:
        mod, tests = module_name(task), test_name(task)
        if not own and self.rng.random() < self.noise.test_first:
            return Action("test", "python -m pytest -q --tb=no", "Let me run the tests first.")
        if self.rng.random() < self.noise.look_tests_too:
            return Action("look", f"cat -n {mod} {tests}", f"Let me read {mod} and its tests.")
        return Action("look", f"cat -n {mod}", f"Let me read {mod}.")

    def _work(self, ep: Episode, task: dict, own: list[Action]) -> Action:
        mod = module_name(task)
        edits = [a for a in own if a.kind in ("fix", "wrong")]
        current = edits[-1].file_after if edits else task["files"][mod]
        last, last_out = ep.actions[-1]
        r = self.rng.random()
        test = Action("test", "python -m pytest -q --tb=no", "Let me run the tests.")
        if last is not None and last.kind in ("fix", "wrong"):
            if current == task["solution"] and r < self.noise.skip_tests:
                return Action("submit", SUBMIT, "The fix is in; submitting.")
            return test
        if last is not None and last.kind == "test" and edits and _passed(last_out):
            return Action("submit", SUBMIT, "The tests pass; submitting.")
        if not edits and r < self.noise.give_up:
            return Action("submit", SUBMIT, "I could not find the bug; submitting.")
        wrong_p = self.noise.wrong_first if not edits else self.noise.retry_wrong
        if self.rng.random() < wrong_p:
            options = wrong_edits(task, current)
            self.rng.shuffle(options)
            after = next((o for o in options[:6] if fails_visible_tests(task, o)), None)
            if after is not None:
                return Action("wrong", edit_command(mod, current, after, self.addressed),
                              f"The bug is in {task['function']}; fixing it.", after)
        if current == task["solution"]:
            return Action("submit", SUBMIT, "Submitting.")
        return Action("fix", edit_command(mod, current, task["solution"], self.addressed),
                      f"The bug is in {task['function']}; fixing it.", task["solution"])

    def remember(self, call_id: str, action: Action) -> None:
        with self.lock:
            self.memory[call_id] = action


def _passed(output: str) -> bool:
    low = output.lower()
    return " passed" in low and " failed" not in low and " error" not in low


# ---------------------------------------------------------------- the server

def reply_body(request: dict, action: Action, call_id: str, thoughts: bool = False) -> dict:
    message = {"role": "assistant", "content": action.thought if thoughts else None,
               "tool_calls": [{"id": call_id, "type": "function",
                               "function": {"name": "bash", "arguments": json.dumps({"command": action.command})}}]}
    prompt_chars = len(json.dumps(request.get("messages", [])))
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": request.get("model", "solver"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": prompt_chars // 4, "completion_tokens": len(action.command) // 4 + 8,
                      "total_tokens": prompt_chars // 4 + len(action.command) // 4 + 8}}


class SolverServer(ThreadingHTTPServer):
    """Serves the policy; `on_exchange(request, reply_message, action)` sees every call (collect.py)."""
    daemon_threads = True

    def __init__(self, address, policy: Policy, on_exchange=None) -> None:
        super().__init__(address, _Handler)
        self.policy, self.on_exchange = policy, on_exchange


class _Handler(BaseHTTPRequestHandler):
    server: SolverServer

    def log_message(self, fmt, *args) -> None:  # quiet: the proxy and the agent log calls already
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            self._send(200, {"object": "list", "data": [{"id": "solver", "object": "model"}]})
        else:
            self._send(200 if self.path in ("/health", "/") else 404, {"ok": True})

    def do_POST(self) -> None:
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if request.get("stream"):
                raise ValueError("the solver does not stream")
            action = self.server.policy.decide(request["messages"])
        except (ValueError, KeyError, TypeError) as exc:
            self._send(400, {"error": {"message": f"bad request: {exc}"}})
            return
        call_id = f"call_{uuid.uuid4().hex[:16]}"
        self.server.policy.remember(call_id, action)
        body = reply_body(request, action, call_id, self.server.policy.thoughts)
        if self.server.on_exchange:
            self.server.on_exchange(request, body["choices"][0]["message"], action)
        self._send(200, body)


def load_tasks(paths: list[str]) -> list[dict]:
    return [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--tasks", nargs="+", default=[str(here / "tasks_train.jsonl"), str(here / "tasks_eval.jsonl")])
    parser.add_argument("--noise", type=float, default=1.0, help="0 = perfect, 1 = default mistake rates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-limit", type=int, default=8)
    parser.add_argument("--script", help="JSON file with a list of commands to emit in order, then submit")
    parser.add_argument("--thoughts", action="store_true", help="a short reason before each tool call")
    parser.add_argument("--edit-form", choices=["line", "unaddressed"], default="line",
                        help="sed edits with the line number always, or only when the span is ambiguous")
    args = parser.parse_args(argv)
    script = json.loads(Path(args.script).read_text()) if args.script else None
    policy = Policy(load_tasks(args.tasks), Noise.scaled(args.noise), args.seed, args.step_limit, script,
                    args.thoughts, args.edit_form == "line")
    server = SolverServer((args.host, args.port), policy)
    print(f"solver listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
