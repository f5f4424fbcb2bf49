"""Synthetic train-only projects, generated: many structurally varied modules instead of a few hand-written.

With a few dozen hand-written train projects a tiny model learns each project's fix by heart and not the
skill (read the failing assertion, find the line, fix the operator, constant or condition). Here every
project is assembled from function templates (counting and filtering loops, accumulators, min/max scans,
clamps and thresholds, index arithmetic, early returns, dict look-ups, string building), named from an
English word list (``count_late_orders(orders, cutoff)``) with random constants and operators, so the
same skill shows up in many shapes. The tests' expected values are computed by running the correct
module on randomly drawn inputs, so they are right by construction. Stdlib only; the same seed gives
the same projects, and project i depends only on (seed, i) and the names it must avoid.

    synth_projects(300, seed=0, taken=names_to_avoid)  # the catalogue shape of projects_train.py
"""

from __future__ import annotations

import ast
import builtins
import keyword
import random
import sys
import textwrap
from collections.abc import Callable, Iterable
from typing import NamedTuple

# (singular, plural) nouns for lists of numbers; none is a local name a template uses (count, total, best...)
NUMBER_NOUNS = (
    ("order", "orders"), ("parcel", "parcels"), ("reading", "readings"), ("score", "scores"),
    ("price", "prices"), ("ticket", "tickets"), ("booking", "bookings"), ("payment", "payments"),
    ("sample", "samples"), ("visit", "visits"), ("trip", "trips"), ("shift", "shifts"),
    ("delivery", "deliveries"), ("invoice", "invoices"), ("bid", "bids"), ("lap", "laps"),
    ("batch", "batches"), ("crate", "crates"), ("sale", "sales"), ("deposit", "deposits"),
    ("rating", "ratings"), ("weight", "weights"), ("height", "heights"), ("speed", "speeds"),
    ("load", "loads"), ("fare", "fares"), ("mark", "marks"), ("vote", "votes"), ("dose", "doses"),
    ("flight", "flights"), ("meal", "meals"), ("loan", "loans"), ("tide", "tides"), ("rent", "rents"),
    ("wage", "wages"), ("bill", "bills"), ("pallet", "pallets"), ("session", "sessions"),
    ("throw", "throws"), ("harvest", "harvests"), ("donation", "donations"), ("parcel_fee", "parcel_fees"),
)
# (singular, plural) nouns for lists of short strings
TEXT_NOUNS = (("name", "names"), ("title", "titles"), ("label", "labels"), ("word", "words"),
              ("tag", "tags"), ("code", "codes"), ("city", "cities"), ("colour", "colours"),
              ("note", "notes"), ("song", "songs"), ("street", "streets"), ("team", "teams"))
HIGH_WORDS = ("late", "large", "heavy", "high", "long", "big", "tall", "busy", "loud", "hot", "costly", "fast")
LOW_WORDS = ("early", "small", "light", "low", "short", "cheap", "quiet", "cold", "slow", "thin", "minor")
HIGHEST = ("largest", "highest", "heaviest", "longest", "latest", "biggest", "top")
LOWEST = ("smallest", "lowest", "lightest", "shortest", "earliest", "cheapest", "bottom")
LIMITS = ("cutoff", "limit", "threshold", "bound", "target", "level", "mark_line", "quota")
RANGES = (("low", "high"), ("floor", "ceiling"), ("least", "most"), ("lower", "upper"), ("start_at", "stop_at"))
SUFFIXES = ("tools", "stats", "utils", "book", "desk", "ledger", "log", "report", "rules", "kit", "shop",
            "board", "notes", "planner", "tracker", "office", "counter", "checks")
LABELS = (("high", "medium", "low"), ("gold", "silver", "bronze", "none"), ("large", "medium", "small", "tiny"),
          ("urgent", "normal", "minor"), ("hot", "warm", "cool", "cold"), ("full", "half", "empty"))
WORD_POOL = ("tea", "jam", "pen", "cup", "box", "map", "oak", "fig", "sun", "ink", "bay", "elm", "owl", "rye",
             "apple", "river", "stone", "cloud", "maple", "lemon", "tiger", "piano", "candle", "garden",
             "window", "silver", "orange", "pepper", "ant", "bee", "kite", "lamp", "rose", "wolf")
HIGH_OPS, LOW_OPS = (">", ">="), ("<", "<=")
# mini.yaml keeps an observation's last 1,500 characters: a first `cat -n` of module and tests longer than
# that loses the top of the module (maybe the bug) and hides it from the solver and the model alike.
LISTING_LIMIT = 1400
VISIBLE_SUFFIXES = ("basic", "example", "simple", "small")
HIDDEN_SUFFIXES = ("more", "edges", "mixed", "extra", "cases", "checks")


class Func(NamedTuple):
    """One generated function: its source pieces and how to draw arguments for it (a NamedTuple, not a
    dataclass: generate.py loads this file by path, without a sys.modules entry)."""
    name: str
    params: tuple[str, ...]
    body: str
    doc: str
    draw: Callable[[random.Random], tuple]
    source: str = ""  # the whole definition, for a class (else rendered from params and body)
    call: Callable[[tuple], str] | None = None  # the tested expression for drawn args (else name(args))

    def expression(self, args: tuple) -> str:
        return self.call(args) if self.call else f"{self.name}({', '.join(map(repr, args))})"

    def defined_names(self) -> set[str]:
        """The names this definition adds (a class's methods too), lower case; dunders are Python's, not ours."""
        if not self.source:
            return {self.name}
        tree = ast.parse(self.source)
        return {n.name.lower() for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("__")}

    def test_stem(self) -> str:
        """``ParcelRack`` -> ``parcel_rack``: test names stay snake_case like the functions'."""
        return "".join(f"_{c.lower()}" if c.isupper() else c for c in self.name).lstrip("_")


# ---------------------------------------------------------------- input drawing

def numbers(rng: random.Random, low: int = 0, high: int = 40, min_len: int = 0) -> list[int]:
    """A short list of ints; empty or single-element now and then, as edge cases must be."""
    n = rng.choice((0, 1, 2, 3, 4, 4, 5, 5, 6, 7)) if min_len == 0 else rng.randint(min_len, 7)
    return [rng.randint(low, high) for _ in range(max(n, min_len))]


def near(rng: random.Random, xs: list[int], low: int = 0, high: int = 40) -> int:
    """A threshold; half the time one of the values itself, so `<` and `<=` give different answers."""
    return rng.choice(xs) if xs and rng.random() < 0.5 else rng.randint(low, high)


def words(rng: random.Random, min_len: int = 0) -> list[str]:
    return [rng.choice(WORD_POOL) for _ in range(rng.randint(min_len, 5))]


# ---------------------------------------------------------------- templates: loops over numbers
# A template takes (rng, words) and returns a Func: the function's name, parameters, body and docstring,
# and how to draw valid arguments. Operators, constants and names are drawn so that each function offers
# the generator's families several sites (a comparison, an accumulator, a range or index, a constant, an
# `if`, a last `return`); the draws include boundary values so that `<` and `<=` answer differently.


def count_filter(rng, w):
    high = rng.random() < 0.5
    op, adj, (s, p), limit = rng.choice(HIGH_OPS if high else LOW_OPS), w.adjective(high), w.noun(), rng.choice(LIMITS)
    var = rng.choice(("count", "found", "hits"))
    body = f"""
        {var} = 0
        for {s} in {p}:
            if {s} {op} {limit}:
                {var} += 1
        return {var}"""
    return Func(f"count_{adj}_{p}", (p, limit), body, f"How many {p} are {'over' if high else 'under'} the {limit}.",
                lambda r: (lambda xs: (xs, near(r, xs)))(numbers(r)))


def sum_filter(rng, w):
    high = rng.random() < 0.5
    op, adj, (s, p), limit = rng.choice(HIGH_OPS if high else LOW_OPS), w.adjective(high), w.noun(), rng.choice(LIMITS)
    term = rng.choice((s, f"{s} - {limit}" if high else f"{limit} - {s}", f"{s} * {rng.randint(2, 5)}"))
    body = f"""
        total = 0
        for {s} in {p}:
            if {s} {op} {limit}:
                total += {term}
        return total"""
    return Func(f"{rng.choice(('total', 'sum'))}_{adj}_{p}", (p, limit), body,
                f"Adds up the {adj} {p} against the {limit}.", lambda r: (lambda xs: (xs, near(r, xs)))(numbers(r)))


def index_of_best(rng, w):
    high = rng.random() < 0.5
    op, sup, (s, p) = rng.choice(HIGH_OPS if high else LOW_OPS), rng.choice(HIGHEST if high else LOWEST), w.noun()
    body = f"""
        best = 0
        for i in range(1, len({p})):
            if {p}[i] {op} {p}[best]:
                best = i
        return best"""
    return Func(f"{rng.choice(('index', 'position'))}_of_{sup}_{s}", (p,), body,
                f"Where the {sup} {s} is; {p} is never empty.", lambda r: (numbers(r, 0, 9, min_len=1),))


def best_value(rng, w):
    high = rng.random() < 0.5
    op, sup, (s, p) = rng.choice(HIGH_OPS if high else LOW_OPS), rng.choice(HIGHEST if high else LOWEST), w.noun()
    default = rng.choice((0, -1, rng.randint(1, 9)))
    body = f"""
        if not {p}:
            return {default}
        best = {p}[0]
        for {s} in {p}[1:]:
            if {s} {op} best:
                best = {s}
        return best"""
    return Func(f"{sup}_{s}", (p,), body, f"The {sup} {s}, or {default} when there are none.",
                lambda r: (numbers(r),))


def largest_step(rng, w):
    rise = rng.random() < 0.5
    s, p = w.noun()
    gap = f"{p}[i + 1] - {p}[i]" if rise else f"{p}[i] - {p}[i + 1]"
    body = f"""
        best = 0
        for i in range(len({p}) - 1):
            step = {gap}
            if step > best:
                best = step
        return best"""
    name = f"{rng.choice(('largest', 'biggest', 'steepest'))}_{s}_{'rise' if rise else 'drop'}"
    return Func(name, (p,), body, f"The biggest {'rise' if rise else 'drop'} between neighbouring {p}.",
                lambda r: (numbers(r),))


def window_total(rng, w):
    s, p = w.noun()

    def draw(r):
        xs = numbers(r, min_len=2)
        start = r.randint(0, len(xs) - 1)
        return xs, start, r.randint(1, len(xs) - start)
    body = f"""
        total = 0
        for i in range(start, start + width):
            total += {p}[i]
        return total"""
    return Func(f"{rng.choice(('window', 'run', 'stretch'))}_of_{p}", (p, "start", "width"), body,
                f"Sum of `width` {p} from index `start`.", draw)


def first_index(rng, w):
    high = rng.random() < 0.5
    op, adj, (s, p), limit = rng.choice(HIGH_OPS if high else LOW_OPS), w.adjective(high), w.noun(), rng.choice(LIMITS)
    missing = rng.choice(("-1", f"len({p})"))
    body = f"""
        for i in range(len({p})):
            if {p}[i] {op} {limit}:
                return i
        return {missing}"""
    return Func(f"first_{adj}_{s}", (p, limit), body, f"Index of the first {adj} {s}, or {missing} if there is none.",
                lambda r: (lambda xs: (xs, near(r, xs)))(numbers(r)))


def count_between(rng, w):
    s, p = w.noun()
    low, high = rng.choice(RANGES)
    upper = rng.choice(("<", "<="))
    body = f"""
        count = 0
        for {s} in {p}:
            if {s} >= {low} and {s} {upper} {high}:
                count += 1
        return count"""

    def draw(r):
        xs = numbers(r)
        a, b = sorted((near(r, xs), near(r, xs)))
        return xs, a, b
    return Func(f"count_{p}_between", (p, low, high), body, f"How many {p} fall between {low} and {high}.", draw)


def running_extreme(rng, w):
    lowest = rng.random() < 0.5
    s, p = w.noun()
    var, op = ("lowest", "<") if lowest else ("highest", ">")
    body = f"""
        balance = opening
        {var} = opening
        for {s} in {p}:
            balance += {s}
            if balance {op} {var}:
                {var} = balance
        return {var}"""
    return Func(f"{var}_{s}_balance", ("opening", p), body, f"The {var} running balance after each {s}.",
                lambda r: (r.randint(-10, 20), numbers(r, -15, 15)))


def pair_count(rng, w):
    s, p = w.noun()
    body = f"""
        count = 0
        for i in range(len({p})):
            for j in range(i + 1, len({p})):
                if {p}[i] + {p}[j] == target:
                    count += 1
        return count"""

    def draw(r):
        xs = numbers(r, 0, 9)
        return xs, (xs[0] + xs[-1]) if xs and r.random() < 0.7 else r.randint(0, 18)
    return Func(f"count_{s}_pairs", (p, "target"), body, f"Pairs of {p} that add up to the target.", draw)


def boost_list(rng, w):
    high = rng.random() < 0.5
    op, adj, (s, p), limit = rng.choice(HIGH_OPS if high else LOW_OPS), w.adjective(high), w.noun(), rng.choice(LIMITS)
    change = f"{s} - step" if high else f"{s} + step"
    body = f"""
        result = []
        for {s} in {p}:
            if {s} {op} {limit}:
                result.append({change})
            else:
                result.append({s})
        return result"""
    verb = "trim" if high else "boost"
    return Func(f"{verb}_{adj}_{p}", (p, limit, "step"), body, f"{verb.capitalize()}s every {adj} {s} by step.",
                lambda r: (lambda xs: (xs, near(r, xs), r.randint(1, 5)))(numbers(r)))


def average(rng, w):
    s, p = w.noun()
    body = f"""
        if len({p}) == 0:
            return 0
        return sum({p}) // len({p})"""
    return Func(f"{rng.choice(('average', 'mean', 'typical'))}_{s}", (p,), body,
                f"Whole-number average of the {p}; 0 for none.", lambda r: (numbers(r),))


# ---------------------------------------------------------------- templates: single values

def clamp(rng, w):
    s, _ = w.noun()
    low, high = rng.choice(RANGES)
    body = f"""
        if {s} < {low}:
            return {low}
        elif {s} > {high}:
            return {high}
        else:
            return {s}"""

    def draw(r):
        a = r.randint(0, 20)
        b = a + r.randint(1, 20)
        return r.choice((r.randint(-5, 45), a, b, r.randint(a, b))), a, b
    return Func(f"{rng.choice(('clamp', 'limit', 'bound'))}_{s}", (s, low, high), body,
                f"The {s} kept between {low} and {high}.", draw)


def classify(rng, w):
    s, _ = w.noun()
    labels = rng.choice(LABELS)
    cuts = sorted(rng.sample(range(5, 100), len(labels) - 1), reverse=True)
    op = rng.choice((">=", ">"))
    lines = [f"if {s} {op} {cuts[0]}:", f"    return '{labels[0]}'"]
    for cut, label in zip(cuts[1:], labels[1:]):
        lines += [f"elif {s} {op} {cut}:", f"    return '{label}'"]
    lines.append(f"return '{labels[-1]}'")
    body = "\n" + "\n".join(lines)
    return Func(f"{rng.choice(('rate', 'grade', 'classify', 'label', 'rank'))}_{s}", (s,), body,
                f"A {s} as one of {', '.join(labels)}.", lambda r: (r.choice((*cuts, r.randint(0, 110))),))


def digit_count(rng, w):
    s, _ = w.noun()
    base = rng.choice((10, 10, 2, 8, 16))
    body = f"""
        count = 1
        while {s} >= {base}:
            {s} = {s} // {base}
            count += 1
        return count"""
    return Func(f"{s}_digits_base_{base}" if base != 10 else f"{s}_digit_count", (s,), body,
                f"Digits a non-negative {s} needs in base {base}.",
                lambda r: (r.choice((0, 1, base - 1, base, base * base, r.randint(0, 5000))),))


def percent(rng, w):
    s, p = w.noun()
    body = """
        if whole == 0:
            return 0
        return part * 100 // whole"""
    return Func(f"{s}_{rng.choice(('percent', 'share', 'ratio'))}", ("part", "whole"), body,
                f"What percent of the whole {p} the part is, rounded down.",
                lambda r: (lambda whole: (r.randint(0, whole), whole))(r.choice((0, r.randint(1, 60)))))


def containers_needed(rng, w):
    s, p = w.noun()
    box, boxes = rng.choice((("box", "boxes"), ("crate", "crates"), ("van", "vans"), ("shelf", "shelves"),
                             ("tray", "trays"), ("page", "pages")))
    body = f"""
        if count <= 0:
            return 0
        return (count + per_{box} - 1) // per_{box}"""
    return Func(f"{boxes}_for_{p}", ("count", f"per_{box}"), body, f"How many {boxes} hold `count` {p}, rounding up.",
                lambda r: (r.randint(-2, 40), r.randint(1, 9)))


def grid_cell(rng, w):
    s, _ = w.noun()
    body = """
        row = index // width
        col = index % width
        return (row + first, col + first)"""
    return Func(f"{s}_cell", ("index", "width", "first"), body, f"Row and column of a {s} in a grid of given width.",
                lambda r: (r.randint(0, 60), r.randint(1, 9), r.choice((0, 1))))


# ---------------------------------------------------------------- templates: dicts and text

def lookup_default(rng, w):
    s, p = w.noun()
    default = rng.choice((0, 1, rng.randint(2, 9)))
    body = f"""
        base = {p}.get(key, {default})
        if base > discount:
            return base - discount
        return 0"""

    def draw(r):
        table = {k: r.randint(0, 30) for k in r.sample(WORD_POOL, r.randint(0, 4))}
        key = r.choice(sorted(table)) if table and r.random() < 0.7 else r.choice(WORD_POOL)
        return table, key, r.randint(0, 12)
    return Func(f"{s}_after_discount", (p, "key", "discount"), body,
                f"The {s} for a key less the discount, never below zero.", draw)


def tally(rng, w):
    s, p = w.text_noun()
    body = f"""
        counts = {{}}
        for {s} in {p}:
            if len({s}) >= shortest:
                counts[{s}] = counts.get({s}, 0) + 1
        return counts"""
    return Func(f"tally_{p}", (p, "shortest"), body, f"How often each {s} of at least `shortest` letters occurs.",
                lambda r: (words(r), r.randint(2, 5)))


def numbered(rng, w):
    s, p = w.text_noun()
    first, sep, joiner = rng.choice((0, 1)), rng.choice((":", ".", ")")), rng.choice((",", " ", ";"))
    body = f"""
        parts = []
        for i in range(len({p})):
            parts.append(str(i + {first}) + '{sep}' + {p}[i][:width])
        return '{joiner}'.join(parts)"""
    return Func(f"{rng.choice(('number', 'list', 'format'))}_{p}", (p, "width"), body,
                f"The {p} numbered from {first}, each cut to `width` letters.",
                lambda r: (words(r), r.randint(1, 6)))


def fit_text(rng, w):
    s, _ = w.text_noun()
    body = f"""
        if len({s}) > width:
            return {s}[:width - 1] + '~'
        return {s} + '.' * (width - len({s}))"""
    return Func(f"fit_{s}", (s, "width"), body, f"The {s} padded with dots or cut with a tilde to exactly width.",
                lambda r: (r.choice(words(r, 1)), r.randint(1, 8)))


def count_marks(rng, w):
    s, _ = w.text_noun()
    body = f"""
        count = 0
        for i in range(len({s})):
            if {s}[i] == mark and i >= skip:
                count += 1
        return count"""

    def draw(r):
        text = "".join(r.choice("aab.-") for _ in range(r.randint(1, 9)))
        return text, r.choice(text), r.randint(0, 3)
    return Func(f"count_marks_in_{s}", (s, "mark", "skip"), body,
                f"How often mark occurs in the {s} after `skip`.", draw)


def initials(rng, w):
    s, p = w.text_noun()
    body = f"""
        letters = ''
        for {s} in {p}:
            if len({s}) > minimum:
                letters += {s}[0].upper()
        return letters"""
    return Func(f"initials_of_{p}", (p, "minimum"), body, f"First letters of the {p} longer than minimum.",
                lambda r: (words(r), r.randint(0, 4)))


# ---------------------------------------------------------------- templates: small classes

def capacity_class(rng, w):
    s, p = w.noun()
    kind = rng.choice(("Rack", "Bin", "Truck", "Shelf", "Cart", "Tray"))
    name = f"{s.title().replace('_', '')}{kind}"
    source = f"""
class {name}:
    \"\"\"A {kind.lower()} that holds {p} up to a fixed capacity.\"\"\"

    def __init__(self, capacity):
        self.capacity = capacity

    def spare(self, {p}):
        left = self.capacity - sum({p})
        if left < 0:
            return 0
        return left

    def count_fitting(self, {p}):
        used = 0
        count = 0
        for {s} in {p}:
            if used + {s} <= self.capacity:
                used += {s}
                count += 1
        return count
"""

    def draw(r):
        return r.choice(("spare", "count_fitting")), r.randint(5, 60), numbers(r, 1, 20)
    return Func(name, (), "", "", draw, source.strip("\n") + "\n",
                lambda a: f"{name}({a[1]!r}).{a[0]}({a[2]!r})")


def range_class(rng, w):
    s, p = w.noun()
    kind = rng.choice(("Window", "Band", "Span", "Range"))
    name = f"{s.title().replace('_', '')}{kind}"
    upper = rng.choice(("<", "<="))
    source = f"""
class {name}:
    def __init__(self, low, high):
        self.low = low
        self.high = high

    def covers(self, {s}):
        return {s} >= self.low and {s} {upper} self.high

    def inside(self, {p}):
        kept = []
        for {s} in {p}:
            if self.covers({s}):
                kept.append({s})
        return kept
"""

    def draw(r):
        low = r.randint(0, 20)
        high = low + r.randint(0, 15)
        if r.random() < 0.4:
            return "covers", low, high, r.choice((low, high, r.randint(0, 40)))
        return "inside", low, high, numbers(r) + [low, high][:r.randint(0, 2)]
    return Func(name, (), "", "", draw, source.strip("\n") + "\n",
                lambda a: f"{name}({a[1]!r}, {a[2]!r}).{a[0]}({a[3]!r})")


TEMPLATES = (count_filter, sum_filter, index_of_best, best_value, largest_step, window_total, first_index,
             count_between, running_extreme, pair_count, boost_list, average, clamp, classify, digit_count,
             percent, containers_needed, grid_cell, lookup_default, tally, numbered, fit_text, count_marks,
             initials, capacity_class, range_class)


# ---------------------------------------------------------------- assembling a project

class Words:
    """Picks the English words a project's names are made of; most functions share the module's theme noun,
    so a module reads as one topic (``parcel_desk``: ``count_heavy_parcels``, ``lightest_parcel``)."""

    def __init__(self, rng: random.Random, theme: tuple[str, str]):
        self.rng, self.theme = rng, theme

    def noun(self) -> tuple[str, str]:
        return self.theme if self.rng.random() < 0.6 else self.rng.choice(NUMBER_NOUNS)

    def text_noun(self) -> tuple[str, str]:
        return self.rng.choice(TEXT_NOUNS)

    def adjective(self, high: bool) -> str:
        return self.rng.choice(HIGH_WORDS if high else LOW_WORDS)


def render(func: Func, with_doc: bool) -> str:
    if func.source:
        return func.source
    doc = f'    """{func.doc}"""\n' if with_doc else ""
    body = textwrap.indent(textwrap.dedent(func.body).strip("\n"), "    ")
    return f"def {func.name}({', '.join(func.params)}):\n{doc}{body}\n"


def pick_functions(rng: random.Random, words: Words, avoid: set[str]) -> list[Func]:
    """3-5 functions from distinct templates whose module stays within 40 lines; names never in ``avoid``."""
    funcs, lines = [], -2
    for template in rng.sample(TEMPLATES, rng.randint(3, 5)):
        func = template(rng, words)
        size = len(render(func, True).splitlines()) + 2
        used = set().union(*(f.defined_names() for f in funcs))
        if func.defined_names() & (avoid | used) or lines + size > 40:
            continue
        funcs.append(func)
        lines += size
    return funcs


def module_source(rng: random.Random, funcs: list[Func]) -> str:
    return "\n" + "\n\n".join(render(f, rng.random() < 0.35) for f in funcs)


def _informative(args: tuple, expected) -> bool:
    """No empty argument and a non-trivial answer: a check most wrong versions of the function fail."""
    empty = any(isinstance(a, (list, dict, str)) and not a for a in args)
    return not empty and expected not in (0, "", [], {}, None)


def assertion(rng: random.Random, namespace: dict, func: Func, informative: bool) -> str:
    """``assert f(args) == expected`` with expected computed by the correct function (right by construction).
    An informative check (every visible one) is drawn until ``_informative`` holds, within a few tries."""
    found = None
    for _ in range(50):
        args = func.draw(rng)
        expression = func.expression(args)
        try:  # evaluated from its own text, so the literal in the test is exactly what was run
            expected = eval(expression, dict(namespace))  # noqa: S307 - code this module just assembled
        except Exception:  # noqa: BLE001 - a draw outside the function's domain: draw again
            continue
        if isinstance(expected, bool):  # `assert x`, `assert not x`: how people test a predicate
            found = f"    assert {'' if expected else 'not '}{expression}"
        else:
            found = f"    assert {expression} == {expected!r}"
        if not informative or _informative(args, expected):
            break
    if found is None:
        raise RuntimeError(f"no valid input drawn for {func.name}")
    return found


def check_function(rng, namespace, func: Func, suffix: str, n_asserts: int, visible: bool) -> str:
    lines: list[str] = []
    for _ in range(n_asserts * 3):
        line = assertion(rng, namespace, func, informative=visible or not lines)
        if line not in lines:
            lines.append(line)
        if len(lines) == n_asserts:
            break
    return f"def test_{func.test_stem()}_{suffix}():\n" + "\n".join(lines) + "\n"


def test_file_text(import_line: str, tests: list[str]) -> str:
    """The layout projects_train.py uses: import line, two blank lines, tests two blank lines apart
    (``project()`` splits on the first blank pair to find the visible checks)."""
    return "\n" + import_line + "\n\n\n" + "\n\n".join(tests)


def make_tests(rng: random.Random, name: str, source: str, funcs: list[Func]) -> tuple[str, str]:
    """Visible tests for 2-4 of the functions (1-2 asserts each), hidden ones for every function (2-4 asserts,
    3-6 test functions): the hidden suite is what tells a fix from a no-op, so it covers every function."""
    namespace: dict = {}
    exec(compile(source, f"{name}.py", "exec"), namespace)  # noqa: S102 - code this module just assembled
    import_line = f"from {name} import {', '.join(f.name for f in funcs)}"
    n = len(funcs)
    shown = sorted(rng.sample(range(n), rng.randint(min(n, max(2, n - 1)), min(n, 4))))
    visible = [check_function(rng, namespace, funcs[i], rng.choice(VISIBLE_SUFFIXES), rng.randint(1, 2), True)
               for i in shown]
    extra = sorted(rng.sample(range(n), min(n, max(0, rng.randint(3, 6) - n))))
    hidden = []
    for i in range(n):
        suffixes = rng.sample(HIDDEN_SUFFIXES, 2)
        hidden.append(check_function(rng, namespace, funcs[i], suffixes[0], rng.randint(2, 4), False))
        if i in extra:
            hidden.append(check_function(rng, namespace, funcs[i], suffixes[1], rng.randint(2, 3), False))
    return test_file_text(import_line, visible), test_file_text(import_line, hidden)


def listing_chars(module: str, visible: str) -> int:
    """Characters of ``cat -n <module> <tests>`` on the task folder (7 for each line's number and tab)."""
    shown = ast.unparse(ast.parse(module)) + "\n" + visible.lstrip("\n")
    return sum(len(line) + 8 for line in shown.splitlines())


def build_project(rng: random.Random, avoid: set[str]) -> tuple[str, dict] | None:
    """One project, or None when this draw gave a name in ``avoid``, too small a module, or files too long
    to show whole (draw again)."""
    theme = rng.choice(NUMBER_NOUNS)
    name = f"{theme[0]}_{rng.choice(SUFFIXES)}"
    if rng.random() < 0.3:
        name = f"{rng.choice(HIGH_WORDS + LOW_WORDS)}_{name}"
    if name in avoid:
        return None
    funcs = pick_functions(rng, Words(rng, theme), avoid)
    source = module_source(rng, funcs)
    if len(funcs) < 3 or not 15 <= len(source.strip().splitlines()) <= 40:
        return None
    visible, hidden = make_tests(rng, name, source, funcs)
    if listing_chars(source, visible) > LISTING_LIMIT:
        return None
    checks = visible.split("\n\n\n", 1)[1]
    return name, {"module": source, "visible": visible, "hidden": hidden, "reward_extra": "\n\n" + checks}


def reserved_names() -> set[str]:
    """Names a project or function must never take: keywords, builtins, and stdlib modules (a task folder's
    ``queue.py`` would shadow the real one for pytest itself)."""
    return set(keyword.kwlist) | set(dir(builtins)) | set(sys.stdlib_module_names)


def synth_projects(n: int, seed: int, taken: Iterable[str] = ()) -> dict[str, dict[str, str]]:
    """n projects in projects_train.py's catalogue shape, none named (project or function) as in ``taken``.

    Project i draws from its own RNG (seed, i, attempt), so a name added to ``taken`` changes only the
    projects that used it; an attempt that hits a used name or misses the size bounds is drawn again."""
    avoid = {t.lower() for t in taken} | reserved_names()
    out: dict[str, dict[str, str]] = {}
    for i in range(n):
        for attempt in range(1000):
            got = build_project(random.Random(f"synth:{seed}:{i}:{attempt}"), avoid | out.keys())
            if got is not None:
                break
        else:
            raise RuntimeError(f"no fresh project name left for project {i}: ask for fewer")
        out[got[0]] = got[1]
    return out
