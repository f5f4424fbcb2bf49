#!/usr/bin/env python
"""The shape of the core (proxy, launcher, trainer, schemas, lightning_harness/process.py): functions over
100 lines, signatures over 12 parameters (click commands excepted, their options are their parameters)
and the count of non-blank lines. Exits 1 if a function or a signature is over its limit.

    python scripts/check_shape.py            # the core
    python scripts/check_shape.py trainer    # one folder
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ["proxy", "launcher", "trainer", "schemas", "lightning_harness/process.py"]
MAX_LINES, MAX_PARAMS = 100, 12


def files(roots: list[str]) -> list[Path]:
    out = []
    for r in roots:
        p = ROOT / r
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def is_click_command(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(".command" in ast.unparse(d) or ".option" in ast.unparse(d) or "click." in ast.unparse(d)
               for d in fn.decorator_list)


def n_params(a: ast.arguments) -> int:
    names = [x.arg for x in a.posonlyargs + a.args]
    n = len(names) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - (names[:1] in (["self"], ["cls"]))


def main(roots: list[str]) -> int:
    problems, total, found = 0, 0, files(roots)
    for f in found:
        src = f.read_text()
        total += sum(1 for line in src.splitlines() if line.strip())
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{f.relative_to(ROOT)}:{fn.lineno} {fn.name}"
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES:
                print(f"long: {where} ({fn.end_lineno - fn.lineno + 1} lines)")
                problems += 1
            if n_params(fn.args) > MAX_PARAMS and not is_click_command(fn):
                print(f"wide: {where} ({n_params(fn.args)} parameters)")
                problems += 1
    print(f"{len(found)} files, {total} non-blank lines; {problems} over the limits "
          f"({MAX_LINES} lines a function, {MAX_PARAMS} parameters a signature)")
    return 1 if problems else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("roots", nargs="*", default=CORE, help="folders or files under the repository (default: the core)")
    sys.exit(main(ap.parse_args().roots))
