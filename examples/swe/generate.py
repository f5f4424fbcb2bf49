"""Generate small bug-fix tasks for a coding agent from the project catalogue in projects.py.

Each task is one project with one injected bug (an `ast` mutation inside one function). A mutant is kept
only if it fails at least one visible test (so the agent has something to chase) and at least one hidden
test (so the reward can tell a fix from a no-op). Train and eval are split by project, so they share no
function. Stdlib only; the same seed gives byte-identical JSONL.

    python examples/swe/generate.py --seed 0 --out examples/swe
    python examples/swe/generate.py --seed 0 --out examples/swe --synth 300   # + tasks_synth.jsonl
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import signal
import sys
import threading
import types
from collections import Counter
from contextlib import contextmanager
from pathlib import Path


def _load_catalogue(filename: str, attribute: str) -> dict:
    """A catalogue module by file path, so importing the generator leaves sys.path alone."""
    spec = importlib.util.spec_from_file_location(f"swe_{Path(filename).stem}", Path(__file__).with_name(filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attribute)


PROJECTS = _load_catalogue("projects.py", "PROJECTS")          # the held-out projects are drawn from these
TRAIN_ONLY = _load_catalogue("projects_train.py", "TRAIN_ONLY_PROJECTS")  # never held out
if PROJECTS.keys() & TRAIN_ONLY.keys():
    raise RuntimeError(f"projects in both catalogues: {sorted(PROJECTS.keys() & TRAIN_ONLY.keys())}")
CATALOGUE = {**PROJECTS, **TRAIN_ONLY}
synth_projects = _load_catalogue("synth.py", "synth_projects")  # generated train-only projects (--synth)

FAMILIES = ("wrong_operator", "off_by_one", "swapped_args", "wrong_constant",
            "inverted_condition", "missing_return")
EVAL_PROJECTS = 5          # projects held out for the eval split
PER_FAMILY_CAP = 3         # mutants kept per (function, family), so no family swamps a function
TEST_TIME_LIMIT = 0.3      # CPU seconds per suite run in-process; a mutant that hangs is dropped

OP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
            ast.Div: ast.Mult, ast.Mod: ast.FloorDiv, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
            ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
            ast.In: ast.NotIn, ast.NotIn: ast.In, ast.And: ast.Or, ast.Or: ast.And,
            ast.Is: ast.IsNot, ast.IsNot: ast.Is}

PROMPTS = (
    "{test} fails when I run `python -m pytest {tests}`. Please fix the bug in {module}.",
    "The test {test} in {tests} is failing. Find and fix the bug in {module} without changing the tests.",
    "{test} is broken: fix {module} so that the tests in {tests} pass.",
    "Running pytest on {tests} shows {test} failing. Can you fix {module}?",
)


# ---------------------------------------------------------------- functions and mutation sites

def functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef]]:
    """Top-level functions and class methods with their qualified names, in source order."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            found += [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
    return found


def body_nodes(func: ast.FunctionDef) -> list[ast.AST]:
    """Nodes of a function's body (not its docstring), in a stable walk order used as site ids."""
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [n for stmt in body for n in ast.walk(stmt)]


def last_return(func: ast.FunctionDef) -> ast.Return | None:
    """The return statement with a value that comes last in the source, if any."""
    returns = [n for n in ast.walk(func) if isinstance(n, ast.Return) and n.value is not None
               and not (isinstance(n.value, ast.Constant) and n.value.value is None)]
    return max(returns, key=lambda n: (n.lineno, n.col_offset)) if returns else None


def _touches_text(node: ast.AST) -> bool:
    """String arithmetic (`s + " "`) mutated to `-` is a TypeError nobody would write; skip it."""
    operands = [getattr(node, "left", None), getattr(node, "right", None), getattr(node, "value", None)]
    return any(isinstance(o, ast.JoinedStr) or (isinstance(o, ast.Constant) and isinstance(o.value, str))
               for o in operands)


def site_variants(node: ast.AST, func: ast.FunctionDef) -> list[tuple[str, int]]:
    """(family, variant) mutations that apply at this node; the variant picks among alternatives."""
    out = []
    if isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)) and type(node.op) in OP_SWAPS \
            and not _touches_text(node):
        out.append(("wrong_operator", 0))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in OP_SWAPS:
        out.append(("wrong_operator", 0))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" \
            and node.args and not node.keywords:
        out += [("off_by_one", 0), ("off_by_one", 1)]
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
            and not isinstance(node.slice, ast.Constant):
        out.append(("off_by_one", 2))
    if isinstance(node, ast.Call) and len(node.args) >= 2 and not node.keywords \
            and not any(isinstance(a, ast.Starred) for a in node.args[:2]) \
            and ast.dump(node.args[0]) != ast.dump(node.args[1]):
        out.append(("swapped_args", 0))
    if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        out.append(("wrong_constant", 0))
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):
        out.append(("inverted_condition", 0))
    if node is last_return(func):
        out.append(("missing_return", 0))
    return out


def shift(expr: ast.expr, delta: int) -> ast.expr:
    """expr + delta; a literal integer is folded so the bug reads like code a person wrote."""
    try:
        value = ast.literal_eval(expr)
    except ValueError:
        value = None
    if type(value) is int:
        return ast.Constant(value + delta)
    op = ast.Add() if delta > 0 else ast.Sub()
    return ast.BinOp(left=expr, op=op, right=ast.Constant(abs(delta)))


def apply_variant(node: ast.AST, family: str, variant: int, parents: dict) -> None:
    """Mutate node in place (or its parent, for statements that must be removed)."""
    if family == "wrong_operator":
        if isinstance(node, ast.Compare):
            node.ops = [OP_SWAPS[type(node.ops[0])]()]
        else:
            node.op = OP_SWAPS[type(node.op)]()
    elif family == "off_by_one" and variant in (0, 1):
        stop = 0 if len(node.args) == 1 else 1
        node.args[stop] = shift(node.args[stop], -1 if variant == 0 else 1)
    elif family == "off_by_one":
        sl = node.slice
        if isinstance(sl, ast.Slice):
            if sl.upper is not None:
                sl.upper = shift(sl.upper, 1)
            else:
                sl.lower = shift(sl.lower or ast.Constant(0), 1)
        else:
            node.slice = shift(sl, 1)
    elif family == "swapped_args":
        node.args[0], node.args[1] = node.args[1], node.args[0]
    elif family == "wrong_constant":
        v = node.value
        node.value = (not v) if isinstance(v, bool) else {0: 1, 1: 0}.get(v, v + 1)
    elif family == "inverted_condition":
        node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
    elif family == "missing_return":
        block = parents[node]
        block.remove(node)
        if not block:
            block.append(ast.Pass())


def statement_lists(func: ast.FunctionDef) -> dict:
    """Map each statement to the list that holds it, so a mutation can remove it."""
    owners = {}
    for node in ast.walk(func):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                for stmt in block:
                    owners[stmt] = block
    return owners


_PARSING = threading.Lock()


def parse(source: str) -> ast.Module:
    """`ast.parse`, one thread at a time: CPython 3.11 keeps the AST builder's recursion depth per
    interpreter, so two threads parsing at once can fail with "AST constructor recursion depth
    mismatch" (the solver's threaded server and the threaded tests call `mutants` concurrently).
    Parsing elsewhere that takes no lock (a traceback being formatted, `ast.literal_eval`) can still
    interleave: parsing has no effects, so that rare failure is tried again."""
    with _PARSING:
        for attempt in range(3):
            try:
                return ast.parse(source)
            except SystemError as exc:
                if "recursion depth mismatch" not in str(exc) or attempt == 2:
                    raise
    raise AssertionError("unreachable")


def mutants(source: str):
    """Yield (function, family, buggy_source) for every mutation site, each on a fresh parse.

    Sites are addressed by (function index, walk index), which a fresh parse of the same text
    reproduces exactly; that keeps every mutant independent and the enumeration deterministic.
    """
    tree = parse(source)
    for fi, (fname, func) in enumerate(functions(tree)):
        for ni, node in enumerate(body_nodes(func)):
            for family, variant in site_variants(node, func):
                fresh = parse(source)
                ffunc = functions(fresh)[fi][1]
                target = body_nodes(ffunc)[ni]
                apply_variant(target, family, variant, statement_lists(ffunc))
                yield fname, family, ast.unparse(ast.fix_missing_locations(fresh)) + "\n"


# ---------------------------------------------------------------- running tests in-process

class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so test code's `except Exception` cannot swallow it."""


@contextmanager
def _time_limit(seconds: float):
    """Bounds the CPU time the suite uses (ITIMER_VIRTUAL), not wall time: on a loaded machine a
    descheduled suite must not count as a hang, or the same seed would give other tasks."""
    def _raise(signum, frame):
        raise _Timeout()
    previous = signal.signal(signal.SIGVTALRM, _raise)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def run_suite(module_name: str, module_src: str, test_src: str) -> list[str] | None:
    """Names of failing test functions, or None if the suite hung (such mutants are dropped).

    In-process (fresh module object, fresh test namespace) because a subprocess per mutant would
    dominate generation time; the alarm bounds infinite loops a mutation can create.
    """
    module = types.ModuleType(module_name)
    saved = sys.modules.get(module_name)
    sys.modules[module_name] = module
    failed = []
    try:
        with _time_limit(TEST_TIME_LIMIT):
            exec(compile(module_src, f"{module_name}.py", "exec"), module.__dict__)  # noqa: S102 - our own catalogue
            namespace = {"__name__": f"test_{module_name}"}
            exec(compile(test_src, f"test_{module_name}.py", "exec"), namespace)  # noqa: S102
            for name, fn in list(namespace.items()):
                if name.startswith("test_") and callable(fn):
                    try:
                        fn()
                    except Exception:  # noqa: BLE001 - any exception is a failing test
                        failed.append(name)
    except _Timeout:
        return None
    except Exception:  # noqa: BLE001 - the test file did not even import
        return ["<collection>"]
    finally:
        if saved is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = saved
    return failed


# ---------------------------------------------------------------- tasks and splits

def original_source(name: str, catalogue: dict = CATALOGUE) -> str:
    """The project module as the agent's tools will show it (unparsed, so only the bug differs)."""
    return ast.unparse(parse(catalogue[name]["module"])) + "\n"


def candidate_bugs(name: str, catalogue: dict = CATALOGUE) -> dict[tuple[str, str], list[tuple[str, list[str]]]]:
    """Valid mutants of one project grouped by (function, family): they fail visible and hidden tests.
    "Hidden" here is the project's own hidden suite, never the visible checks a train-only project's
    reward repeats (``reward_extra``): the hidden tests themselves must tell a fix from a no-op."""
    spec = catalogue[name]
    original = original_source(name, catalogue)
    for suite in ("visible", "hidden"):
        if run_suite(name, original, spec[suite]) != []:
            raise RuntimeError(f"project {name}: original fails its {suite} tests")
    groups: dict = {}
    seen = {original}
    for fname, family, buggy in mutants(original):
        if buggy in seen:
            continue
        seen.add(buggy)
        visible = run_suite(name, buggy, spec["visible"])
        if not visible or "<collection>" in visible:
            continue
        if not run_suite(name, buggy, spec["hidden"]):
            continue
        groups.setdefault((fname, family), []).append((buggy, visible))
    return groups


def project_tasks(name: str, seed: int, catalogue: dict = CATALOGUE) -> list[dict]:
    """Tasks of one project; its own RNG so a subset of projects generates the same tasks."""
    rng = random.Random(f"{seed}:{name}")
    spec = catalogue[name]
    tasks = []
    for (fname, family), cands in candidate_bugs(name, catalogue).items():
        picks = sorted(rng.sample(range(len(cands)), min(PER_FAMILY_CAP, len(cands))))
        for i in picks:
            buggy, failing = cands[i]
            template = rng.choice(PROMPTS)
            prompt = template.format(test=rng.choice(failing), tests=f"test_{name}.py", module=f"{name}.py")
            tasks.append({
                "id": f"{name}-{fname.replace('.', '_')}-{family}-{i}",
                "project": name, "function": fname, "family": family,
                "files": {f"{name}.py": buggy, f"test_{name}.py": spec["visible"].lstrip("\n")},
                "hidden_tests": spec["hidden"].lstrip("\n") + spec.get("reward_extra", ""),
                "failing_visible_tests": failing,
                "prompt": prompt,
                "solution": original_source(name, catalogue),
                "seed": seed,
            })
    return tasks


def split_projects(seed: int, names: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Train and eval project names; eval is drawn from projects.py's whole catalogue so subsets agree,
    and train-only projects (projects_train.py) come after the rest of the train split, so adding
    one changes neither the draw nor a task that existed before."""
    everything = sorted(PROJECTS)
    held_out = set(random.Random(seed).sample(everything, EVAL_PROJECTS))
    unknown = sorted(set(names or ()) - CATALOGUE.keys())
    if unknown:
        raise ValueError(f"unknown projects: {unknown}")
    chosen = sorted(n for n in names if n in PROJECTS) if names else everything
    extra = sorted(n for n in names if n in TRAIN_ONLY) if names else sorted(TRAIN_ONLY)
    return [n for n in chosen if n not in held_out] + extra, [n for n in chosen if n in held_out]


def build(seed: int, names: list[str] | None = None) -> dict[str, list[dict]]:
    train, held_out = split_projects(seed, names)
    return {"train": [t for n in train for t in project_tasks(n, seed)],
            "eval": [t for n in held_out for t in project_tasks(n, seed)]}


def catalogue_names() -> frozenset[str]:
    """Every hand-written project, function and class name, lower case. projects.py holds every project the
    held-out draw can pick whatever the seed, so a generated name outside this set is never a held-out one."""
    names = set()
    for name, spec in CATALOGUE.items():
        names.add(name.lower())
        names |= {n.name.lower() for n in ast.walk(parse(spec["module"]))
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return frozenset(names)


def synth_tasks(n: int, synth_seed: int, seed: int) -> list[dict]:
    """Tasks of n generated train-only projects (synth.py): the same mutations and checks as the catalogue's,
    kept apart from the splits (tasks_synth.jsonl) so the committed train and eval files never change."""
    catalogue = synth_projects(n, synth_seed, taken=catalogue_names())
    clash = sorted(catalogue.keys() & CATALOGUE.keys())
    if clash:
        raise RuntimeError(f"generated projects named like hand-written ones: {clash}")
    return [t for name in catalogue for t in project_tasks(name, seed, catalogue)]


def dump(tasks: list[dict]) -> str:
    return "".join(json.dumps(t, sort_keys=True) + "\n" for t in tasks)


# ---------------------------------------------------------------- materialise

def write_task(task: dict, dest: str | Path) -> Path:
    """Write the task's visible files (buggy module and visible tests) into dest. A task file may come
    from anywhere: each name must be a plain file name (no folder, no ``..``), so nothing lands
    outside dest."""
    dest = Path(dest)
    for rel in task["files"]:
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\\" in rel or "\0" in rel:
            raise ValueError(f"task {task.get('id')!r}: file name {rel!r} is not a plain file name")
    dest.mkdir(parents=True, exist_ok=True)
    for rel, text in task["files"].items():
        (dest / rel).write_text(text)
    return dest


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--projects", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--synth", type=int, default=0,
                        help="also write tasks_synth.jsonl: tasks of this many generated train-only projects")
    parser.add_argument("--synth-seed", type=int, default=0, help="seed of the generated projects")
    args = parser.parse_args(argv)
    names = [n for n in args.projects.split(",") if n] or None
    splits = build(args.seed, names)
    if args.synth:
        splits["synth"] = synth_tasks(args.synth, args.synth_seed, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, tasks in splits.items():
        (out / f"tasks_{split}.jsonl").write_text(dump(tasks))
        counts = Counter(t["family"] for t in tasks)
        projects = sorted({t["project"] for t in tasks})
        shown = ", ".join(projects) if len(projects) <= 80 else f"{', '.join(projects[:10])}, ..."
        print(f"{split}: {len(tasks)} tasks, {len(projects)} projects ({shown})")
        for family in FAMILIES:
            print(f"  {family:20s} {counts.get(family, 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
