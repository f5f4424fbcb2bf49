#!/usr/bin/env python
"""Build the SWE example's tiny tool-calling model from nothing, deterministically (no model hub).

Conversations come from ``--trajectories`` (one JSON line per model call that mini-swe-agent made
against the scripted solver: ``request`` body, solver ``reply`` message, ``task_id``, ``call_index``;
the last call of each episode plus its reply is the whole conversation) or, without it, from an
in-process imitation of the same loop (mini-swe-agent's message shapes and default observation
template, short prompts of our own, commands run in bubblewrap). A byte-level BPE tokenizer is
trained on them, a small Qwen2 learns every assistant turn (loss on those tokens only), and held-out
success is measured by running the same loop in-process with the model sampling.

Noise: ``--p-wrong`` of the solver's episodes first apply a wrong edit (wrong line or wrong
replacement); half of those then retry with the right one, the rest submit the broken state. With
the model's own errors this keeps held-out success low while the right fix stays in reach.

\b
    python scripts/build_swe_model.py                       # rebuild examples/swe/model
    python scripts/build_swe_model.py --trajectories /path/trajectories.jsonl
"""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm

SWE_DIR = tm.ROOT / "examples" / "swe"
sys.path.insert(0, str(SWE_DIR))
import generate as swe_tasks  # noqa: E402
import reward as swe_reward  # noqa: E402 (the sandboxed hidden-test scorer: these folders hold model-written code)

console = Console(stderr=True)
SPECIALS = tm.SPECIALS + ["<tool_call>", "</tool_call>"]
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {
        "type": "string", "description": "The bash command to execute"}}, "required": ["command"]}}}
SYSTEM = ("You fix bugs in a small Python project. Run one bash command per reply with the bash tool. "
          "When the tests pass, run: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")  # examples/swe/mini.yaml
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TEST_CMD = "python -m pytest -q --tb=no"
NO_CALL = ('Reply with exactly one bash tool call ({"command": "..."}). '
           "No tool calls found in the response. Every response MUST include at least one tool call.")


def observation(rc: int, out: str) -> str:
    """mini.yaml's observation template (exit code, output cut to its last 1,500 characters)."""
    if len(out) > 1500:
        out = f"[... {len(out) - 1500} characters cut]\n{out[-1500:]}"
    return f"exit code {rc}\n{out}"


# ---------------------------------------------------------------- sandboxed execution
def run_sandboxed(command: str, folder: Path, timeout: float = 10.0) -> tuple[int, str]:
    """Run a command in bubblewrap: no network, empty environment, only the task folder writable
    (seen as /repo) and this interpreter's environment read-only (for ``python -m pytest``)."""
    prefix = Path(sys.prefix)
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--ro-bind", str(prefix.resolve()), str(prefix),
            "--ro-bind", str(Path(sys.base_prefix).resolve()), sys.base_prefix, "--bind", str(folder), "/repo",
            "--chdir", "/repo",
            "--setenv", "PATH", f"{prefix}/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--", "bash", "-c", command]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    out = proc.stdout + proc.stderr
    return proc.returncode, re.sub(r" in \d+\.\d+s", "", out)  # timings would make outputs unique


# ---------------------------------------------------------------- scripted solver (imitation)
def module_name(task: dict) -> str:
    return next(k for k in task["files"] if not k.startswith("test_"))


def _sed_escape(text: str, replacement: bool) -> str:
    specials = "\\/&" if replacement else "\\/.*[]^$"
    return "".join("\\" + c if c in specials else c for c in text)


def _span(old: str, new: str) -> tuple[str, str]:
    """The smallest change of whole space-separated words turning line ``old`` into ``new``, widened to the line's
    start when a shorter span would not be its first occurrence (sed replaces the first)."""
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    s = 0
    while s < min(len(old), len(new)) - p and old[-1 - s] == new[-1 - s]:
        s += 1
    a, end = p, len(old) - s
    while a > 0 and not old[a - 1].isspace():
        a -= 1
    while end < len(old) and not old[end].isspace():
        end += 1
    while end == a and end < len(old):  # a pure insertion: take the next word along
        end += 1
        while end < len(old) and old[end - 1] != " " and old[end] != " ":
            end += 1
    if old.find(old[a:end]) != a:
        a = len(old) - len(old.lstrip())
    tail = len(old) - end
    return old[a:end], new[a:len(new) - tail]


def fix_command(task: dict) -> str:
    """The solver's one-line sed for the task's bug (line replaced in part, or the return added)."""
    name = module_name(task)
    buggy, good = task["files"][name].splitlines(), task["solution"].splitlines()
    tag, i1, _, j1, _ = next(o for o in difflib.SequenceMatcher(None, buggy, good).get_opcodes() if o[0] != "equal")
    if tag == "insert":
        script = f"{i1}a\\{good[j1]}"
    else:
        old, new = _span(buggy[i1], good[j1])
        script = f"{i1 + 1}s/{_sed_escape(old, False)}/{_sed_escape(new, True)}/"
    return "sed -i '" + script.replace("'", "'\\''") + f"' {name}"


def wrong_command(task: dict, rng: random.Random) -> str:
    """A plausible wrong edit: the right change on a neighbouring line, or a wrong replacement."""
    right = fix_command(task)
    m = re.match(r"sed -i '(\d+)(.*)", right)
    line, rest = int(m.group(1)), m.group(2)
    swaps = [("<=", "<"), ("<", "<="), (">", ">="), ("+", "-"), ("-", "+"), ("0", "1"), ("1", "0"),
             ("and", "or"), ("==", "!="), ("a, b", "b, a")]
    if "s/" in rest and rng.random() < 0.5:
        before, new, after = rest.rsplit("/", 2)[0], rest.rsplit("/", 2)[1], rest.rsplit("/", 2)[2]
        for a, b in rng.sample(swaps, len(swaps)):
            if a in new and new.replace(a, b, 1) not in (new, before.split("s/", 1)[-1]):
                return right.replace(rest, f"{before}/{new.replace(a, b, 1)}/{after}")
    return right.replace(f"'{line}", f"'{max(1, line + rng.choice([-2, -1, 1, 2]))}", 1)


def call_message(command: str, call_id: str) -> dict:
    """An assistant message as vLLM's hermes parser returns it (arguments: json.dumps, ensure_ascii off)."""
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": command}, ensure_ascii=False)}}]}


def conversation(task: dict, steps: list[tuple[str, str]]) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for k, (command, obs) in enumerate(steps):
        messages.append(call_message(command, f"call_{k}"))
        if command != SUBMIT:
            messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": obs})
    return messages


def imitation_episodes(task: dict, rng: random.Random, p_wrong: float) -> list[dict]:
    """The solver on one task: the clean episode (read, fix, test, submit) and, with ``p_wrong``, a
    noisy one (a wrong edit tested first; then the right fix, or submitting the broken state).
    Every command really runs (bubblewrap); one run per task yields the observations of both."""
    name = module_name(task)
    with tempfile.TemporaryDirectory() as tmp:
        folder = swe_tasks.write_task(task, Path(tmp) / "repo")
        cmds = [f"cat -n {name}", wrong_command(task, rng)]
        obs = {}
        obs["cat"] = observation(*run_sandboxed(cmds[0], folder))
        obs["wrong"] = observation(*run_sandboxed(cmds[1], folder))
        obs["test_wrong"] = observation(*run_sandboxed(TEST_CMD, folder))
        wrong_reward = swe_reward.score(task, folder)[0]
        swe_tasks.write_task(task, folder)
        fix = fix_command(task)
        obs["fix"] = observation(*run_sandboxed(fix, folder))
        obs["test_fix"] = observation(*run_sandboxed(TEST_CMD, folder))
        reward = swe_reward.score(task, folder)[0]
    read = [(cmds[0], obs["cat"])]
    fixed = [(fix, obs["fix"]), (TEST_CMD, obs["test_fix"]), (SUBMIT, "")]
    wrong = [(cmds[1], obs["wrong"]), (TEST_CMD, obs["test_wrong"])]
    out = [{"task_id": task["id"], "messages": conversation(task, read + fixed), "reward": reward}]
    if rng.random() < p_wrong:
        if rng.random() < 0.5:
            out.append({"task_id": task["id"], "messages": conversation(task, read + wrong + fixed), "reward": reward})
        else:
            out.append({"task_id": task["id"], "messages": conversation(task, read + wrong + [(SUBMIT, "")]),
                        "reward": wrong_reward})
    for episode in out:
        episode["tools"] = [BASH_TOOL]
    return out


def _lines(path: Path) -> list[str]:
    """A trajectory file's lines: plain JSONL, or gzip-compressed (``.gz``: the committed, packed data)."""
    import gzip

    return (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).decode().splitlines()


def load_trajectories(paths: list[Path]) -> list[dict]:
    """Whole conversations from per-call lines: the last call of each episode plus the solver's reply,
    with the solver's action kind per assistant turn (``kinds``: look, test, fix, wrong, submit).
    A packed file (:func:`pack_trajectories`) holds only each episode's last call, with every call's
    kind in ``actions``; both kinds of file give the same episodes."""
    last: dict = {}
    kinds: dict = {}
    for path in paths:
        for line in _lines(path):
            row = json.loads(line)
            key = (path.name.removesuffix(".gz"), row.get("task_id"), row.get("episode", 0))
            kinds.setdefault(key, {}).update(enumerate(row["actions"]) if "actions" in row
                                             else [(row["call_index"], row.get("action"))])
            if key not in last or row["call_index"] > last[key]["call_index"]:
                last[key] = row
    episodes = []
    for key, row in last.items():
        req = row["request"]
        messages = [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
                    for m in req["messages"] + [row["reply"]]]
        episodes.append({"task_id": row.get("task_id"), "messages": messages, "tools": req.get("tools"),
                         "reward": row.get("reward"), "source": key[0],
                         "kinds": [kinds[key].get(i) for i in range(row["call_index"] + 1)]})
    return episodes


def _write_gz(out: Path, lines: list[str]) -> None:
    """``lines`` gzip-compressed without a timestamp: the same lines always give the same bytes."""
    import gzip

    out.write_bytes(gzip.compress("".join(lines).encode(), compresslevel=9, mtime=0))


def pack_trajectories(path: Path, out: Path) -> tuple[dict, set[str]]:
    """The collector's per-call file as the SFT reads it, small enough to commit: each episode's last
    call (its request holds the whole conversation) with every call's action kind (:func:`_write_gz`).
    Per-call lines repeat every earlier turn of their episode; this keeps one copy. Returns what was
    written and the ids of the tasks its episodes ran."""
    last: dict = {}
    for line in _lines(path):
        row = json.loads(line)
        key = (row.get("task_id"), row.get("episode", 0))
        prev = last.get(key)
        actions = prev["actions"] if prev else []
        actions += [None] * (row["call_index"] + 1 - len(actions))
        actions[row["call_index"]] = row.get("action")
        if prev is None or row["call_index"] > prev["call_index"]:
            last[key] = {**{k: v for k, v in row.items() if k != "action"}, "actions": actions}
    _write_gz(out, [json.dumps(row, sort_keys=True) + "\n" for row in last.values()])
    return ({"file": out.name, "episodes": len(last), "bytes": out.stat().st_size,
             "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}, {task for task, _ in last})


# ---------------------------------------------------------------- the unaddressed edit form
_SED = re.compile(r"sed -i '(\d*)(?:s/([^/]*)/([^/]*)/|a\\(.*))' (\S+)", re.DOTALL)


def apply_edit(text: str, command: str) -> str | None:
    """The module after one of the solver's edit commands (its sed forms, literal spans, or its python
    replace heredoc), computed without running it; None for any other command."""
    import ast

    m = _SED.fullmatch(command)
    if m:
        number, old, new, added, _ = m.groups()
        lines = text.splitlines(keepends=True)
        if added is not None:
            return "".join(lines[:int(number)] + [added + "\n"] + lines[int(number):]) if number else None
        targets = [int(number) - 1] if number else [i for i, x in enumerate(lines) if old in x]
        for i in targets:
            lines[i] = (new + "\n") if old == ".*" else lines[i].replace(old, new, 1)
        return "".join(lines) if old and "\\" not in old + new else None
    if command.startswith("python - <<'EOF'"):
        calls = re.findall(r"^s = s\.replace\((.*), 1\)$", command, re.MULTILINE)
        for call in calls:
            old, new = ast.literal_eval(f"({call})")
            text = text.replace(old, new, 1)
        return text if calls else None
    return None


def unaddress_edits(episode: dict, task: dict) -> dict:
    """The episode with every edit rewritten as ``solver.edit_command(..., addressed=False)`` gives it
    (the line number dropped where the span is on one line only). The file states, hence every
    observation, stay the same; an episode with an edit this cannot follow is returned unchanged."""
    import solver as swe_solver

    name = module_name(task)
    text = task["files"][name]
    messages = copy.deepcopy(episode["messages"])
    for m in messages:
        for call in m.get("tool_calls") or []:
            command = json.loads(call["function"]["arguments"])["command"]
            if not (command.startswith("sed -i") or command.startswith("python - <<")):
                continue
            after = apply_edit(text, command)
            if after is None:
                return episode
            new = swe_solver.edit_command(name, text, after, addressed=False)
            if apply_edit(text, new) != after:
                return episode
            call["function"]["arguments"] = json.dumps({"command": new})
            text = after
    return {**episode, "messages": messages}


# ---------------------------------------------------------------- renamed projects
def made_up_name(rng: random.Random, pieces: tuple[str, ...] = ()) -> str:
    """A pronounceable made-up name (two or three consonant-vowel syllables). With ``pieces`` (the
    tokenizer's alphabetic pieces, ``name_pieces``), half the names are two to five short pieces (one to
    three letters) run together, and a quarter one to three pieces of any length, joined plainly or
    snake_case. A model taught to copy syllable names copies only those; a held-out name is a word the
    tokenizer never saw, split into short fragments (``bsearch``: b/se/ar/ch), so most made-up names must be too."""
    draw = rng.random() if pieces else 1.0
    if draw < 0.5:
        return "".join(rng.choice(_short(pieces)) for _ in range(rng.randint(2, 5)))
    if draw < 0.75:
        return ("_" if rng.random() < 0.3 else "").join(rng.choice(pieces) for _ in range(rng.choice([1, 2, 2, 3])))
    syllables = [rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.choice([2, 3]))]
    return "".join(syllables) + rng.choice(["", "s", "n", "x"])


@functools.cache
def _short(pieces: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p for p in pieces if len(p) <= 3)


def name_pieces(tok) -> tuple[str, ...]:
    """The tokenizer's purely alphabetic pieces (lower case, leading-space marker dropped), single
    letters included. A piece may be a word a held-out task uses; a whole name never is a held-out
    project or function (``fresh_name``, ``identifier_mapping``)."""
    pieces = {t.lstrip("\u0120").lower() for t in tok.get_vocab()}
    return tuple(sorted(p for p in pieces if p.isascii() and p.isalpha()))


def fresh_name(rng: random.Random, pieces: tuple[str, ...], taken=frozenset()) -> str:
    """``made_up_name`` not in ``taken`` and, for broad names, never a held-out project or function."""
    name = made_up_name(rng, pieces)
    while name in taken or (pieces and name in held_out_names()):
        name = made_up_name(rng, pieces)
    return name


@functools.cache
def held_out_names() -> frozenset[str]:
    """What the splits must not share: the held-out projects and the functions and classes they
    define (lower case). Common words (``high``, ``items``) stay available as pieces."""
    import ast

    names = set()
    for t in read_tasks("eval"):
        names.add(t["project"].lower())
        names |= {n.name.lower() for n in ast.walk(ast.parse(t["solution"]))
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return frozenset(names)


def rename_project(episode: dict, old: str, new: str) -> dict:
    """The episode as it would read had the project been called ``new``: every standalone occurrence
    of ``old`` (``old.py``, ``test_old.py``, ``from old import``) replaced, in text and commands alike.
    With only 19 train projects a tiny model can name the file from the project it recognises; renamed
    copies leave copying from the prompt and the listing as the only way."""
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(old)}(?![A-Za-z0-9])")
    messages = copy.deepcopy(episode["messages"])
    for m in messages:
        if isinstance(m.get("content"), str):
            m["content"] = pattern.sub(new, m["content"])
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = pattern.sub(new, call["function"]["arguments"])
    return {**episode, "messages": messages}


# ---------------------------------------------------------------- renamed identifiers
@functools.cache
def _fixed_words() -> frozenset[str]:
    """Words the episodes carry that are not the project's: the prompts (file and test names aside),
    the system text, the solver's commands, pytest's and the observation template's words."""
    import builtins
    import keyword

    import generate as swe_generate

    texts = [SYSTEM, TEST_CMD, SUBMIT, NO_CALL, observation(0, ""), *swe_generate.PROMPTS,
             "short test summary info passed failed error errors warnings skipped FAILED ERROR characters cut",
             "cat sed python bash echo pytest from pathlib import Path read_text write_text replace EOF self cls"]
    words = {w for t in texts for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", t)}
    return frozenset(words | set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)))


def project_identifiers(task: dict) -> set[str]:
    """The names the task's module defines (functions, classes, parameters, assigned names), found with
    ``ast``; never a keyword, builtin, pytest or template word, a name under 3 characters, a dunder,
    the project's name, or a name the code also uses as a library's (a method called on a value, a
    keyword argument of a call to something the module does not define, an import)."""
    import ast

    tree = ast.parse(task["solution"])
    names: set[str] = set()
    defs: set[str] = set()
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.add(node.name)
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            foreign |= {(a.asname or a.name).split(".")[0] for a in node.names} | {a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if callee not in defs:
                foreign |= {k.arg for k in node.keywords if k.arg}
                if isinstance(node.func, ast.Attribute):
                    foreign.add(node.func.attr)
    fixed = _fixed_words()
    return {n for n in names - foreign - fixed
            if len(n) >= 3 and not n.startswith("__") and n != task["project"] and not n.startswith("test")}


def _name_pattern(names) -> re.Pattern:
    """``rename_project``'s boundary (no letter or digit either side), longest name first, and never
    inside a dunder (``__init__`` stays when a parameter is called ``init``). The fixed words with an
    underscore are alternatives too, so that ``text`` is renamed in ``test_text_wraps`` but not in
    the solver's ``read_text``; they map to themselves."""
    protected = {w for w in _fixed_words() if "_" in w.strip("_")}
    alternatives = "|".join(re.escape(n) for n in sorted(set(names) | protected, key=len, reverse=True))
    return re.compile(rf"(?<![A-Za-z0-9])(?<!__)(?:{alternatives})(?![A-Za-z0-9])(?!__)")


def identifier_mapping(task: dict, rng: random.Random, taken: set[str], pieces: tuple[str, ...] = ()) -> dict[str, str]:
    """Made-up names for the task's identifiers, distinct, unused in ``taken`` (the episode's words);
    a class keeps its capital, a constant its capitals; the project's name maps to itself (rename_project
    renames it)."""
    mapping: dict[str, str] = {}
    used = set(taken) | set(_fixed_words()) | (held_out_names() if pieces else set())
    for name in sorted(project_identifiers(task)):
        new = made_up_name(rng, pieces)
        while new in used or new.capitalize() in used or new.upper() in used:
            new = made_up_name(rng, pieces)
        used.add(new)
        mapping[name] = new.upper() if name.isupper() else new.capitalize() if name[:1].isupper() else new
    mapping[task["project"]] = task["project"]  # whole: `batch` renamed must leave `batch_tracker` (the module)
    return mapping


def rename_text(text: str, mapping: dict[str, str]) -> str:
    return _name_pattern(mapping).sub(lambda m: mapping.get(m.group(0), m.group(0)), text) if mapping else text


def _renamed_tests_pass(task: dict, mapping: dict[str, str]) -> bool:
    """The renamed solution still passes the renamed visible tests (in process: the generator's own
    trusted code). A name the renamer should have left alone breaks it."""
    import types

    name = module_name(task)
    test_file = next(k for k in task["files"] if k.startswith("test_"))
    module = types.ModuleType(name[:-3])
    saved = sys.modules.get(name[:-3])
    try:
        exec(compile(rename_text(task["solution"], mapping), name, "exec"), module.__dict__)
        sys.modules[name[:-3]] = module
        ns: dict = {"__name__": "renamed_visible_tests"}
        exec(compile(rename_text(task["files"][test_file], mapping), test_file, "exec"), ns)
        for key, fn in list(ns.items()):
            if key.startswith("test") and callable(fn):
                fn()
        return True
    except Exception:  # noqa: BLE001 (any failure means the renaming changed the program)
        return False
    finally:
        if saved is None:
            sys.modules.pop(name[:-3], None)
        else:
            sys.modules[name[:-3]] = saved


def _commands(episode: dict) -> list[str]:
    """The episode's bash commands in order. A call without a ``command`` string (a model can write
    one) is skipped; the solver's episodes have none."""
    out = []
    for call in [c for m in episode["messages"] for c in m.get("tool_calls") or []]:
        try:
            command = json.loads(call["function"]["arguments"])["command"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(command, str):
            out.append(command)
    return out


def rename_identifiers(episode: dict, task: dict, mapping: dict[str, str]) -> dict | None:
    """The episode as it would read had the project's identifiers been called by ``mapping``: task
    text, observations (``cat -n``, pytest) and the command inside each tool call; the system text and
    the tool-call JSON keys stay. None when an edit of the episode no longer does to the renamed file
    what it did to the original (its span would not be found: the copy would teach garbage)."""
    messages = copy.deepcopy(episode["messages"])
    for m in messages:
        if m["role"] != "system" and isinstance(m.get("content"), str):
            m["content"] = rename_text(m["content"], mapping)
        for call in m.get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"])
            args["command"] = rename_text(args["command"], mapping)
            call["function"]["arguments"] = json.dumps(args, ensure_ascii=False)
    renamed = {**episode, "messages": messages}
    text = task["files"][module_name(task)]
    for before, after in zip(_commands(episode), _commands(renamed)):
        if not before.startswith(("sed -i", "python - <<")):
            continue
        new_text = apply_edit(text, before)
        if new_text is None or apply_edit(rename_text(text, mapping), after) != rename_text(new_text, mapping):
            return None
        text = new_text
    return renamed


def id_renamed_copies(episodes: list[dict], tasks: dict[str, dict], copies: int, seed: int,
                      pieces: tuple[str, ...] = ()) -> tuple[list, dict]:
    """``copies`` renamed copies of each episode (identifiers and project, made-up names, new ones per
    copy); a task whose renamed solution fails its renamed visible tests gets none. Returns the
    copies and counts (kept, dropped by the edit check, tasks refused)."""
    rng = random.Random(f"id-rename-{seed}")
    used = sorted({e["task_id"] for e in episodes})  # only tasks with episodes (--extra-tasks holds thousands)
    refused = {tid for tid in used if not _renamed_tests_pass(tasks[tid], identifier_mapping(tasks[tid], rng, set()))}
    out, dropped = [], 0
    for _ in range(copies):
        for e in episodes:
            task = tasks[e["task_id"]]
            if e["task_id"] in refused:
                continue
            words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", json.dumps(e["messages"])))
            mapping = identifier_mapping(task, rng, words, pieces)
            project = fresh_name(rng, pieces, words | set(mapping.values()))
            renamed = rename_identifiers(e, task, mapping)
            if renamed is None:
                dropped += 1
                continue
            out.append(rename_project(renamed, task["project"], project))
    return out, {"kept": len(out), "dropped_edit_check": dropped, "tasks_refused": sorted(refused)}


# ---------------------------------------------------------------- weighted SFT samples
def turn_runs(target: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) token ranges of the assistant turns in a chat sample (its runs of targets)."""
    runs, start = [], None
    for i, t in enumerate(target + [False]):
        if t and start is None:
            start = i
        elif not t and start is not None:
            runs.append((start, i))
            start = None
    return runs


def weighted_sample(tok, episode: dict, edit_weight: float, mask_wrong: bool) -> tuple[list[int], list[float]]:
    """A chat sample whose target weights follow the solver's action per turn: a deliberate wrong
    edit teaches nothing (weight 0 with ``mask_wrong``; it stays in the context, so the recovery is
    still learnt) and the fix, the one turn that must copy a line number and a span, counts
    ``edit_weight`` times."""
    ids, target = tm.chat_sample(tok, episode["messages"], episode["tools"])
    weights = [1.0 if t else 0.0 for t in target]
    kinds = episode.get("kinds") or []
    for kind, (a, b) in zip(kinds, turn_runs(target)):
        w = 0.0 if (kind == "wrong" and mask_wrong) else edit_weight if kind == "fix" else 1.0
        weights[a:b] = [w] * (b - a)
    return ids, weights


def weighted_samples(tok, episodes: list[dict], edit_weight: float, mask_wrong: bool, workers: int) -> list:
    """``weighted_sample`` of each episode, in ``workers`` forked processes (rendering every turn's
    prefix is most of a build's preparation: ~5 min for 37k episodes on one core)."""
    if workers <= 1:
        return [weighted_sample(tok, e, edit_weight, mask_wrong) for e in episodes]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(functools.partial(weighted_sample, tok, edit_weight=edit_weight, mask_wrong=mask_wrong),
                        episodes, chunksize=256)


def weighted_nll(model, batch: list[tuple[list[int], list[float]]], pad_id: int):
    """Weighted mean negative log-likelihood of the target tokens of a right-padded batch."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    w = torch.zeros((len(batch), width))
    for row, (seq, weights) in enumerate(batch):
        ids[row, :len(seq)], attn[row, :len(seq)], w[row, :len(seq)] = torch.tensor(seq), 1, torch.tensor(weights)
    device = next(model.parameters()).device
    ids, attn, w = ids.to(device), attn.to(device), w.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * w[:, 1:]).sum() / w[:, 1:].sum().clamp(min=1.0)


def length_batches(samples: list, batch: int, rng: random.Random, pool: int = 32) -> list[list]:
    """One epoch of batches of similar length (little padding): shuffle, sort within pools, shuffle batches."""
    order = rng.sample(samples, len(samples))
    batches = []
    for i in range(0, len(order), pool * batch):
        chunk = sorted(order[i:i + pool * batch], key=lambda s: len(s[0]))
        batches += [chunk[j:j + batch] for j in range(0, len(chunk), batch)]
    rng.shuffle(batches)
    return batches


# ---------------------------------------------------------------- teacher-forced edit accuracy
def cat_n(text: str) -> str:
    """What ``cat -n`` prints for a file."""
    return "".join(f"{i:6d}\t{line}" for i, line in enumerate(text.splitlines(keepends=True), 1))


def edit_conversation(task: dict, addressed: bool = True) -> list[dict]:
    """The prefix of a clean episode up to and including the fix (as the solver writes it):
    prompt, ``cat -n`` of the module and its output, the edit. The same on train and held-out tasks."""
    import solver as swe_solver

    name = module_name(task)
    buggy = task["files"][name]
    fix = swe_solver.edit_command(name, buggy, task["solution"], addressed)
    steps = [(f"cat -n {name}", observation(0, cat_n(buggy))), (fix, "")]
    return conversation(task, steps)[:-1]


_PARTS = re.compile(r"sed -i '(?P<line>\d*)(?:s/(?P<span>[^/]*)/(?P<repl>[^/]*)/|a\\\\(?P<added>.*?))' "
                    r"(?P<file>[\w.]+)")


def _segments(tok, turn_ids: list[int]) -> dict[str, list[int]]:
    """Token indices of the fix turn's parts: ``line`` (the sed address digits), ``span`` (what
    ``s///`` replaces), ``repl`` (its replacement, or the appended line), ``file`` and ``edit`` (the
    whole command after the address)."""
    pieces = [tok.decode([t], skip_special_tokens=False) for t in turn_ids]
    text = "".join(pieces)
    start = text.find('"command": "') + len('"command": "')
    end = text.find('"}}', start)
    m = _PARTS.match(text, start)
    ranges = {"edit": (start + (m.end("line") - m.start() if m else 0), end)}
    for name in ("line", "span", "repl", "added", "file"):
        if m and m.group(name):
            ranges[name] = m.span(name)
    if "added" in ranges:
        ranges["repl"] = ranges.pop("added")
    segs: dict[str, list[int]] = {name: [] for name in ("line", "span", "repl", "file", "edit")}
    pos = 0
    for k, piece in enumerate(pieces):
        lo, hi = pos, pos + len(piece)
        pos = hi
        for name, (x, y) in ranges.items():
            if lo < y and hi > x:
                segs[name].append(k)
    return segs


def teacher_forced(model, tok, tasks: list[dict], addressed: bool = True) -> dict:
    """Per task, the fix turn scored under teacher forcing: greedy-correct line number (sed address),
    span, replacement, file name (each over the tasks whose command has it), rest of the command
    after the address, whole turn, and the mean probability of
    sampling the exact turn at temperature 1 (an upper bound on an episode's success through this path)."""
    import math

    import torch

    stats = {"line": [], "span": [], "repl": [], "file": [], "edit": [], "turn": [], "p_turn": []}
    model.eval()
    with torch.no_grad():
        for task in tasks:
            ids, target = tm.chat_sample(tok, edit_conversation(task, addressed), [BASH_TOOL])
            a, b = turn_runs(target)[-1]
            logits = model(input_ids=torch.tensor([ids])).logits[0, a - 1:b - 1].float()
            gold = torch.tensor(ids[a:b])
            right = (logits.argmax(-1) == gold).tolist()
            logp = torch.log_softmax(logits, -1).gather(-1, gold[:, None]).sum().item()
            segs = _segments(tok, ids[a:b])
            for name in ("line", "span", "repl", "file"):
                if segs[name]:
                    stats[name].append(all(right[k] for k in segs[name]))
            stats["edit"].append(all(right[k] for k in segs["edit"]))
            stats["turn"].append(all(right))
            stats["p_turn"].append(math.exp(logp))
    return ({k: round(sum(v) / max(1, len(v)), 4) for k, v in stats.items()}
            | {"n": len(tasks), "n_sed_address": len(stats["line"]), "n_sed_span": len(stats["span"])})


def renamed_task(task: dict, rng: random.Random) -> dict:
    """The task with its project and identifiers renamed (made-up names), as
    ``--id-renames`` copies read: the same bug and fix, whose names a model can only copy. Everything
    the record names is renamed alike (files, prompt, solution, hidden and failing tests, function),
    so the reward scores the renamed task as it scored the original; the id is the caller's to set."""
    mapping = identifier_mapping(task, rng, set())
    project = made_up_name(rng)
    while project in mapping.values():
        project = made_up_name(rng)
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(task['project'])}(?![A-Za-z0-9])")
    sub = lambda text: pattern.sub(project, rename_text(text, mapping))  # noqa: E731
    return {**task, "project": project, "prompt": sub(task["prompt"]), "solution": sub(task["solution"]),
            "files": {sub(k): sub(v) for k, v in task["files"].items()}, "hidden_tests": sub(task["hidden_tests"]),
            "failing_visible_tests": [sub(t) for t in task["failing_visible_tests"]],
            "function": ".".join(mapping.get(part, part) for part in task["function"].split("."))}


def tf_report(model, tok, seed: int, addressed: bool = True, n: int = 84) -> dict:
    """:func:`teacher_forced` on the held-out tasks, on as many train tasks (memorised vs learnt) and on
    the same train tasks renamed (``train_renamed``: copying names from the prompt, on known shapes)."""
    train = random.Random(seed).sample(read_tasks("train"), n)
    rng = random.Random(f"tf-renamed-{seed}")
    was_training = model.training
    out = {"held_out": teacher_forced(model, tok, read_tasks("eval")[:n], addressed),
           "train": teacher_forced(model, tok, train, addressed),
           "train_renamed": teacher_forced(model, tok, [renamed_task(t, rng) for t in train], addressed)}
    model.train(was_training)
    return out


# ---------------------------------------------------------------- the agent loop, in process
def parse_reply(text: str) -> dict:
    """The assistant message vLLM's hermes parser makes of ``text`` (no parse: plain content)."""
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)
    try:
        calls = [json.loads(a or b) for a, b in blocks]
        tool_calls = [{"id": f"call_{i}", "type": "function", "function": {
            "name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(calls)]
    except (ValueError, KeyError, TypeError):
        tool_calls = []
    if not tool_calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text[:text.find("<tool_call>")] or None, "tool_calls": tool_calls}


def step_episode(state: dict, message: dict) -> None:
    """mini-swe-agent's step on one reply: run every call, or answer a format error; submit ends."""
    state["messages"].append(message)
    calls = message.get("tool_calls") or []
    if not calls:
        state["messages"].append({"role": "user", "content": NO_CALL})
        return
    for call in calls:
        try:
            command = json.loads(call["function"]["arguments"])["command"]
        except (ValueError, KeyError, TypeError):
            state["messages"].append({"role": "tool", "tool_call_id": call["id"],
                                      "content": "Missing 'command' argument in bash tool call."})
            continue
        rc, out = run_sandboxed(command, state["folder"])
        if rc == 0 and out.lstrip().splitlines()[:1] == ["COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]:
            state["done"] = state["submitted"] = True
            return
        state["messages"].append({"role": "tool", "tool_call_id": call["id"], "content": observation(rc, out)})


def agent_rollouts(model, tok, tasks: list[dict], step_limit: int, temperature: float, generator,
                   max_new_tokens: int = 96, max_len: int = 2048) -> list[dict]:
    """Held-out episodes through the same loop as mini-swe-agent, the model sampling in process."""
    with tempfile.TemporaryDirectory() as tmp:
        states = [{"task": t, "folder": swe_tasks.write_task(t, Path(tmp) / f"r{i}"), "done": False, "calls": 0,
                   "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t["prompt"]}]}
                  for i, t in enumerate(tasks)]
        for step in range(step_limit):
            active = [s for s in states if not s["done"]]
            print(f"[eval] call {step + 1}/{step_limit}: {len(active)} of {len(states)} episodes still running",
                  file=sys.stderr, flush=True)
            prompts = [tok(tok.apply_chat_template(s["messages"], tools=[BASH_TOOL], add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False)["input_ids"]
                       for s in active]
            keep = [(s, p) for s, p in zip(active, prompts) if len(p) + max_new_tokens <= max_len]
            for s, p in zip(active, prompts):
                if len(p) + max_new_tokens > max_len:  # mini-swe-agent ends on a context-length error
                    s["done"], s["overflow"] = True, True
            if not keep:
                break
            outs = []
            for i in range(0, len(keep), 16):
                outs += tm.sample_turn(model, tok, [p for _, p in keep[i:i + 16]], max_new_tokens, temperature,
                                       generator)
            for (s, _), out in zip(keep, outs):
                s["calls"] += 1
                s["submitted"] = False
                text = tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=False)
                step_episode(s, parse_reply(text))
        print(f"[eval] scoring {len(states)} episodes with the hidden tests", file=sys.stderr, flush=True)
        for s in states:
            s["reward"] = swe_reward.score(s["task"], s["folder"])[0]
    return [{"task_id": s["task"]["id"], "reward": s["reward"], "calls": s["calls"],
             "submitted": s.get("submitted", False),
             "messages": s["messages"]} for s in states]


def summarise(runs: list[dict], tasks: list[dict]) -> dict:
    """Success plus how far episodes got (``runs`` in the order of ``tasks``): ``looked`` ran
    ``cat -n`` on the task's module, ``sed_right_file`` made a sed edit of it, ``span_found`` a
    ``s///`` whose span is in the module. Zero success says little; these say where it stops."""
    calls = sorted(r["calls"] for r in runs)
    progress = {"looked": 0, "sed_right_file": 0, "span_found": 0}
    for r, t in zip(runs, tasks):
        name, commands = module_name(t), _commands(r)
        seds = [c for c in commands if c.startswith("sed -i")]
        spans = [m.group(1).replace("\\", "") for c in seds if (m := re.match(r"sed -i '\d*s/((?:[^/\\]|\\.)*)/", c))]
        progress["looked"] += any(c.strip() == f"cat -n {name}" for c in commands)
        progress["sed_right_file"] += any(c.endswith(" " + name) for c in seds)
        progress["span_found"] += any(span in t["files"][name] for span in spans)
    return {"episodes": len(runs), "success": round(sum(r["reward"] for r in runs) / len(runs), 4),
            "submitted": round(sum(r["submitted"] for r in runs) / len(runs), 4),
            "tasks_ever_solved": len({r["task_id"] for r in runs if r["reward"]}),
            "calls_min_median_max": [calls[0], calls[len(calls) // 2], calls[-1]],
            **{k: round(v / len(runs), 4) for k, v in progress.items()}}


def upsampled(episodes: list[dict], rules: tuple[str, ...]) -> list[dict]:
    """Each episode ``K`` times when its source file is named in ``NAME=K`` (``--upsample``)."""
    times = {}
    for rule in rules:
        name, _, k = rule.rpartition("=")
        if not name or not k.isdigit():
            raise click.BadParameter(f"{rule!r}: expected NAME=K (a --trajectories file name, a count)")
        times[name] = int(k)
    unknown = set(times) - {e["source"] for e in episodes}
    if unknown:
        raise click.BadParameter(f"no --trajectories file named {', '.join(sorted(unknown))}")
    return [e for e in episodes for _ in range(times.get(e["source"], 1))]


def pack_all(trajectories: list[Path], extra_tasks: list[Path], folder: Path) -> None:
    """``--pack``: each trajectory file packed, and of each ``--extra-tasks`` file the rows those
    episodes name (all that a build needs of it), both as ``<name>.gz`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    for path in trajectories:
        info, tasks = pack_trajectories(path, folder / f"{path.name.removesuffix('.gz')}.gz")
        used |= tasks
        console.print(json.dumps(info))
    for path in extra_tasks:
        rows = [line + "\n" for line in _lines(path) if json.loads(line)["id"] in used]
        out = folder / f"{path.name.removesuffix('.gz')}.gz"
        _write_gz(out, rows)
        console.print(json.dumps({"file": out.name, "tasks": len(rows), "bytes": out.stat().st_size}))


def tasks_by_id(tasks: list[dict]) -> dict[str, dict]:
    """Task rows by id; two different rows under one id (generated projects of two ``--synth-seed``
    runs can share a name) are an error: an episode would be rewritten against the wrong module."""
    out: dict[str, dict] = {}
    for t in tasks:
        if out.setdefault(t["id"], t) != t:
            raise click.UsageError(f"task id {t['id']!r} names two different tasks in the task files given")
    return out


def read_tasks(split: str) -> list[dict]:
    return [json.loads(line) for line in (SWE_DIR / f"tasks_{split}.jsonl").read_text().splitlines()]


def solver_data(train: list[dict], p_wrong: float, seed: int, workers: int) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    rngs = [random.Random(f"{seed}-{t['id']}") for t in train]  # per task: independent of scheduling
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda tr: imitation_episodes(tr[0], tr[1], p_wrong), zip(train, rngs)))
    return [e for part in parts for e in part]


def make_tokenizer(episodes: list[dict], vocab: int, max_len: int):
    template = (SWE_DIR / "chat_template.jinja").read_text()
    renderer = tm.build_tokenizer(["x"], vocab_size=300, specials=SPECIALS, chat_template=template)
    corpus = [renderer.apply_chat_template(e["messages"], tools=e["tools"], tokenize=False) for e in episodes]
    return tm.build_tokenizer(corpus, vocab_size=vocab, specials=SPECIALS, chat_template=template, max_length=max_len)


def served_tokenizer(tok, config):
    """The tokenizer as vLLM, ``--eval-only`` and the trainer will load it from the saved model. With
    transformers 5, ``AutoTokenizer`` maps a qwen2 config to ``Qwen2Tokenizer``, which replaces the
    trained pre-tokenizer with Qwen's split pattern: ids differ from the ones the BPE was built with
    (``tests/test_swe_build.py``). SFT must see the ids the served model will see."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        config.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


@click.command(help=__doc__)
@click.option("--out", type=click.Path(path_type=Path), default=SWE_DIR / "model", show_default=True)
@click.option("--trajectories", type=click.Path(path_type=Path, exists=True), multiple=True,
              help="mini-swe-agent x scripted solver calls (JSONL, repeatable); default: the in-process imitation")
@click.option("--extra-tasks", type=click.Path(path_type=Path, exists=True), multiple=True,
              help="task files besides tasks_train.jsonl that --trajectories episodes come from (e.g. the "
                   "generated projects' tasks_synth.jsonl: generate.py --synth)")
@click.option("--upsample", multiple=True, metavar="NAME=K",
              help="the episodes of the --trajectories file named NAME count K times (renamed copies draw "
                   "fresh names for each), to give a smaller source its share")
@click.option("--mask-wrong/--learn-wrong", default=False, show_default=True,
              help="no loss on the solver's deliberate wrong edits (they stay in the context)")
@click.option("--edit-weight", default=1.0, show_default=True, help="loss weight of the fix turn's tokens")
@click.option("--edit-form", type=click.Choice(["line", "unaddressed"]), default="line", show_default=True,
              help="unaddressed: rewrite the solver's sed edits without line numbers where the span allows "
                   "(solver.py --edit-form)")
@click.option("--init", type=click.Path(path_type=Path, exists=True), default=None,
              help="continue SFT from this built model (its tokenizer and weights) instead of a fresh one")
@click.option("--tokenizer", "tokenizer_from", type=click.Path(path_type=Path, exists=True), default=None,
              help="a fresh model of --layers/--hidden on this built model's tokenizer (and, with --names "
                   "broad, its name pieces): a larger model on the same ids")
@click.option("--grow-layers", default=0, show_default=True,
              help="add this many layers to the --init model, each a silent copy of the layer below it "
                   "(the same function until SFT trains them)")
@click.option("--renames", default=0, show_default=True,
              help="copies of each episode with the project renamed (made-up names)")
@click.option("--id-renames", default=0, show_default=True,
              help="copies of each episode with the project and its identifiers renamed (made-up names)")
@click.option("--names", type=click.Choice(["syllables", "broad"]), default="syllables", show_default=True,
              help="made-up names of renamed copies: syllables, or broad (three in four made of the --init "
                   "tokenizer's alphabetic pieces, most of them runs of short ones; never a held-out "
                   "project or function)")
@click.option("--originals/--no-originals", default=True, show_default=True,
              help="keep the episodes under their own names beside the --id-renames copies (off: every "
                   "episode's names can only be copied, none recalled)")
@click.option("--max-tokens", default=0, show_default=True, help="drop SFT conversations longer than this (0: max-len)")
@click.option("--seed", default=0, show_default=True)
@click.option("--p-wrong", default=0.5, show_default=True, help="share of tasks that also get a noisy episode")
@click.option("--vocab", default=2048, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--hidden", default=128, show_default=True)
@click.option("--max-len", default=2048, show_default=True)
@click.option("--steps", default=360, show_default=True, help="SFT steps")
@click.option("--minutes", default=0.0, show_default=True, help="stop SFT after this wall time (0: no limit)")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--batch", default=6, show_default=True)
@click.option("--eval-tasks", default=84, show_default=True, help="held-out tasks evaluated (first N)")
@click.option("--eval-split", type=click.Choice(["eval", "train"]), default="eval", show_default=True,
              help="train: the same episodes on train tasks (what was learnt vs what generalises)")
@click.option("--eval-shard", default="0/1", show_default=True,
              help="i/n: evaluate every n-th task from i (parallel runs)")
@click.option("--eval-samples", default=1, show_default=True, help="sampled episodes per held-out task")
@click.option("--temperature", default=1.0, show_default=True, help="sampling temperature of the evaluation")
@click.option("--step-limit", default=8, show_default=True, help="model calls per episode")
@click.option("--threads", default=1, show_default=True)
@click.option("--workers", default=2, show_default=True, help="parallel solver episodes, and tokenising processes")
@click.option("--episodes", "episodes_file", type=click.Path(path_type=Path), default=None,
              help="reuse the imitation episodes saved in this JSONL (written there when missing)")
@click.option("--device", default="cpu", show_default=True, help="where SFT runs (cuda if you have one)")
@click.option("--eval/--no-eval", "run_eval", default=True, help="measure held-out success after the build")
@click.option("--pack", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="skip the build: write each --trajectories file packed (<name>.gz) into this folder, "
                   "and of each --extra-tasks file the tasks they use")
@click.option("--eval-only", is_flag=True, help="skip the build: evaluate the model in --out")
@click.option("--tf-only", is_flag=True, help="skip the build: teacher-forced fix-turn accuracy of the model in --out")
@click.option("--tf-every", default=0, show_default=True,
              help="log teacher-forced accuracy every N SFT steps (0: at snapshots only)")
@click.option("--snapshots", default="",
              help="comma-separated SFT steps at which to also save OUT-stepN "
                   "(pick a warm start by its held-out success)")
def main(out, trajectories, extra_tasks, upsample, mask_wrong, edit_weight, edit_form, init, tokenizer_from,
         grow_layers, renames, id_renames, names, originals, max_tokens, seed, p_wrong, vocab, layers, hidden, max_len,
         steps, minutes, lr, batch, eval_tasks, eval_split, eval_shard, eval_samples, temperature, step_limit, threads,
         workers, episodes_file, device, run_eval, pack, eval_only, tf_only, tf_every, snapshots):
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    if pack:
        pack_all(list(trajectories), list(extra_tasks), pack)
        return
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    shard, shards = (int(x) for x in eval_shard.split("/"))
    evals = read_tasks(eval_split)[:eval_tasks][shard::shards]
    if eval_only or tf_only:
        model, tok = Qwen2ForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
        built = json.loads((out / "build_info.json").read_text()) if (out / "build_info.json").exists() else {}
        result = (tf_report(model, tok, seed, built.get("edit_form", "line") == "line") if tf_only
                  else evaluate(model, tok, evals, eval_samples, step_limit, seed, max_len, temperature))
        print(json.dumps(result))
        return
    t0 = time.monotonic()
    id_rename_counts = None
    if init and tokenizer_from:
        raise click.UsageError("--init continues a model (its tokenizer too); --tokenizer starts a fresh one")
    init_tok = AutoTokenizer.from_pretrained(init or tokenizer_from) if init or tokenizer_from else None
    if trajectories:
        episodes = upsampled(load_trajectories(list(trajectories)), upsample)
        by_id = tasks_by_id(read_tasks("train") + [json.loads(line) for f in extra_tasks for line in _lines(f)])
        if edit_form == "unaddressed":
            episodes = [unaddress_edits(e, by_id[e["task_id"]]) for e in episodes]
        base = episodes
        if names == "broad" and init_tok is None:
            raise click.UsageError("--names broad draws from the tokenizer of --init or --tokenizer")
        pieces = name_pieces(init_tok) if names == "broad" else ()
        if renames:
            projects = {i: t["project"] for i, t in by_id.items()}
            rng = random.Random(f"rename-{seed}")
            episodes = episodes + [rename_project(e, projects[e["task_id"]], fresh_name(rng, pieces))
                                   for _ in range(renames) for e in base]
        if id_renames:
            copies, id_rename_counts = id_renamed_copies(base, by_id,
                                                         id_renames, seed, pieces)
            episodes = (episodes if originals else episodes[len(base):]) + copies
            console.print(f"identifier-renamed copies: {json.dumps(id_rename_counts)}")
    elif episodes_file and episodes_file.exists():
        episodes = [json.loads(line) for line in episodes_file.read_text().splitlines()]
    else:
        episodes = solver_data(read_tasks("train"), p_wrong, seed, workers)
        if episodes_file:
            tm.write_jsonl(episodes, episodes_file)
    console.print(f"{len(episodes)} SFT episodes ({time.monotonic() - t0:.0f}s), solver success "
                  f"{sum(e['reward'] or 0 for e in episodes) / len(episodes):.3f}")
    tok = init_tok if init_tok is not None else make_tokenizer(episodes, vocab, max_len)
    if not init:
        config = tm.model_config(tok, layers=layers, hidden=hidden, heads=hidden // 64, max_positions=max_len)
        tok = served_tokenizer(tok, config)
    samples = weighted_samples(tok, episodes, edit_weight, mask_wrong, workers)
    samples = [s for s in samples if len(s[0]) <= (max_tokens or max_len)]
    heads = hidden // 64
    model = (Qwen2ForCausalLM.from_pretrained(init) if init else
             Qwen2ForCausalLM(tm.model_config(tok, layers=layers, hidden=hidden, heads=heads, max_positions=max_len)))
    if grow_layers:
        if not init:
            raise click.UsageError("--grow-layers adds layers to the --init model")
        model = grown(model, grow_layers)
    layers, hidden, heads = model.config.num_hidden_layers, model.config.hidden_size, model.config.num_attention_heads
    lengths = sorted(len(s[0]) for s in samples)
    console.print(f"vocab {len(tok)}, params {sum(p.numel() for p in model.parameters()):,}, {len(samples)} samples, "
                  f"tokens median {lengths[len(lengths) // 2]} max {lengths[-1]}")
    t1 = time.monotonic()
    curve: dict = {}

    def snapshot(step: int, save: bool) -> None:  # an untied copy on CPU, as shipped; the learning curve
        copy_ = shipped(copy.deepcopy(model).cpu())
        curve[step] = tf_report(copy_, tok, seed, edit_form == "line")
        console.print(f"teacher-forced at step {step}: {json.dumps(curve[step])}")
        if save:
            tm.save_checkpoint(copy_, tok, out.with_name(f"{out.name}-step{step}"))
            (out.with_name(f"{out.name}-step{step}") / "teacher_forced.json").write_text(json.dumps(curve[step]) + "\n")

    marks = {int(x) for x in snapshots.split(",") if x.strip()}
    done = sft(model.to(device), tok, samples, steps, lr, batch, seed, minutes, marks, snapshot, tf_every)
    sft_s = time.monotonic() - t1
    model = shipped(model.cpu())  # trained tied (unless continued from a shipped one), shipped untied
    tm.save_checkpoint(model, tok, out)
    source = ([{"trajectories": t.name, "sha256": hashlib.sha256(t.read_bytes()).hexdigest()} for t in trajectories]
              if trajectories else "imitation")
    info = {"seed": seed, "source": source, "p_wrong": p_wrong,
            "episodes": len(samples), "vocab": len(tok), "layers": layers, "hidden": hidden, "heads": heads,
            "max_len": max_len, "steps": done, "planned_steps": steps, "minutes_budget": minutes, "device": device,
            "lr": lr, "batch": batch, "sft_seconds": round(sft_s),
            "params": sum(p.numel() for p in model.parameters()), "untied_after_sft": True,
            "grow_layers": grow_layers, "tokenizer": tokenizer_from and str(tokenizer_from),
            "init": init and {"model": str(init),
                              "steps": json.loads((init / "build_info.json").read_text()).get("steps")
                              if (init / "build_info.json").exists() else None},
            "mask_wrong": mask_wrong, "edit_weight": edit_weight, "edit_form": edit_form, "max_tokens": max_tokens,
            "renames": renames, "id_renames": id_renames, "names": names, "originals": originals,
            "id_rename_counts": id_rename_counts,
            "teacher_forced": tf_report(model, tok, seed, edit_form == "line"),
            "teacher_forced_curve": curve}
    (out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    console.print(f"SFT {sft_s:.0f}s, wrote {out}")
    if not run_eval:
        return
    info["held_out_in_process"] = evaluate(model, tok, evals, eval_samples, step_limit, seed, max_len, temperature)
    (out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    console.print({k: v for k, v in info["held_out_in_process"].items() if k != "runs"})


def grown(model, extra: int):
    """The same function with ``extra`` more decoder layers: after each of the first ``extra`` layers a
    copy of it whose attention and MLP output projections are zero, so it adds nothing to the residual
    stream until SFT moves them. Depth for a model that underfits its data (train and held-out
    teacher-forced accuracy close), without starting the warm start over."""
    from transformers import Qwen2ForCausalLM

    old = model.config.num_hidden_layers
    if not 0 < extra <= old:
        raise click.BadParameter(f"--grow-layers {extra}: between 1 and the model's {old} layers")
    sources = [(i, False) for i in range(old)]
    for i in reversed(range(extra)):
        sources.insert(i + 1, (i, True))
    config = model.config.to_dict()
    config.update(num_hidden_layers=len(sources),
                  layer_types=[config["layer_types"][i] for i, _ in sources] if config.get("layer_types") else None)
    bigger = Qwen2ForCausalLM(model.config.__class__.from_dict(config))
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.")}
    for j, (i, silent) in enumerate(sources):
        for key, value in model.model.layers[i].state_dict().items():
            zero = silent and key in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            state[f"model.layers.{j}.{key}"] = value.new_zeros(value.shape) if zero else value.detach().clone()
    bigger.load_state_dict(state)
    return bigger


def shipped(model):
    """The model as committed: untied (see tm.untie); one continued from a shipped model already is."""
    return tm.untie(model) if model.config.tie_word_embeddings else model


def sft(model, tok, samples, steps: int, lr: float, batch: int, seed: int, minutes: float,
        marks: set = frozenset(), snapshot=None, tf_every: int = 0) -> int:
    """Supervised warm start on the weighted assistant turns (short warm-up, then a linear decay to
    whichever ends first: the planned steps or the wall-time budget, so a run stopped by ``minutes``
    has still annealed), batches of similar length; returns the steps done. On a GPU the forward
    pass runs under bf16 autocast (weights and optimizer stay float32). ``snapshot(step, save)`` at
    the marks (saved) and every ``tf_every`` steps (the teacher-forced curve only)."""
    import contextlib

    import torch

    rng = random.Random(seed)
    t0 = time.monotonic()

    def progress(s: int) -> float:
        return max(s / steps, (time.monotonic() - t0) / (60 * minutes) if minutes else 0.0)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - progress(s)))
    cuda = next(model.parameters()).is_cuda
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    model.train()
    queue: list = []
    for step in range(steps):
        if not queue:
            queue = length_batches(samples, batch, rng)
        with autocast():
            loss = weighted_nll(model, queue.pop(), tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step + 1 in marks or (tf_every and (step + 1) % tf_every == 0):
            snapshot(step + 1, step + 1 in marks)
        if step % 20 == 0:
            console.print(f"SFT step {step}/{steps} loss {loss.item():.4f} {time.monotonic() - t0:.0f}s")
        if minutes and time.monotonic() - t0 > 60 * minutes:
            return step + 1
    return steps


def evaluate(model, tok, evals, samples: int, step_limit: int, seed: int, max_len: int,
             temperature: float = 1.0) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    model.eval()
    runs = agent_rollouts(model, tok, evals * samples, step_limit, temperature, gen, max_len=max_len)
    return {"temperature": temperature, "step_limit": step_limit, **summarise(runs, evals * samples),
            "runs": [{k: r[k] for k in ("task_id", "reward", "calls", "submitted")} for r in runs]}


if __name__ == "__main__":
    main()
