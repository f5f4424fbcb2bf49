"""Hidden tests in one process, the agent's module in another: the scorer's two halves (reward.py).

Why two processes: a module imported into the process that runs the tests owns that process. It
can read any secret the runner holds (a nonce included), print a pass line and exit 0, patch the
runner, or return an object whose ``__eq__`` always says True, so that ``assert f(1) == 2`` passes.
So the module is imported only by ``serve``, which answers requests and decides nothing; the hidden
tests run in ``drive``, which never imports the module: its ``<project>`` module is a stand-in
whose functions, classes and objects are remote references. Each call crosses the pipe as plain
data (None, bool, int, float, str, bytes, and lists, tuples, dicts and sets of them); anything else
the module returns stays in ``serve`` and comes back as a reference, so an ``assert`` compares
values the module computed and never runs the module's code. A reference equals only a reference
(the module's own ``__eq__`` decides between its objects), never a plain value, and meets a plain
value in no arithmetic (the module would see the test's expected value and choose the result). An exception
comes back as the nearest built-in ``Exception`` class by name (never ``SystemExit``;
``StopIteration`` as ``RuntimeError``, so it cannot end a test's ``map`` early). Lists,
dicts and sets passed as arguments are copied back after the call, as a function that sorts or
fills its argument in place would have left them. ``drive``'s exit status is the verdict: 0 when
every test passed. Both run in their own bubblewrap sandbox; ``reward.py`` wires them together.

    python remote.py serve DIR PROJECT   # imports DIR/PROJECT.py; requests on stdin, answers on stdout
    python remote.py drive TESTS PROJECT # runs TESTS against the stand-in; requests on stdout
"""

from __future__ import annotations

import builtins
import json
import operator
import os
import sys
import types

MAX_TEXT = 300  # of a remote repr or error message


# -- the wire: plain values as JSON, each JSON object a tagged form --------------------------------
def encode(value, ref):
    """JSON-able form of value; ``ref(obj)`` names what is not plain data (only serve has such)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, ref) for v in value]
    if kind is tuple:
        return {"t": [encode(v, ref) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, ref), encode(v, ref)] for k, v in value.items()]}
    if kind in (set, frozenset):
        return {"s" if kind is set else "f": [encode(v, ref) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if value is NotImplemented:
        return {"n": 0}
    return {"r": ref(value)}


def decode(data, deref):
    """The value encode wrote; ``deref(n)`` turns reference n into an object."""
    if isinstance(data, list):
        return [decode(v, deref) for v in data]
    if not isinstance(data, dict):
        return data
    (tag, body), = data.items()
    if tag == "t":
        return tuple(decode(v, deref) for v in body)
    if tag == "d":
        return {decode(k, deref): decode(v, deref) for k, v in body}
    if tag in ("s", "f"):
        return (set if tag == "s" else frozenset)(decode(v, deref) for v in body)
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "n":
        return NotImplemented
    if tag == "r" and type(body) is int:
        return deref(body)
    raise ValueError(f"unknown form {tag!r}")


def channel() -> tuple:
    """(reader, writer) over the process's stdin/stdout; prints then go to stderr, not the wire."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return sys.stdin, out


# -- serve: owns the module, decides nothing --------------------------------------------------------
def serve(folder: str, project: str) -> None:
    """Answer requests until stdin ends. Untrusted by design: whatever runs here can write anything
    to the wire, and drive treats every answer as data."""
    reader, writer = channel()
    objects: list = []
    index: dict[int, int] = {}

    def ref(obj) -> int:
        if id(obj) not in index:  # (objects keeps each alive, so its id stays its own)
            index[id(obj)] = len(objects)
            objects.append(obj)
        return index[id(obj)]

    def deref(n: int):
        return objects[n]

    sys.path.insert(0, folder)
    try:
        ref(__import__(project))
        failure = None
    except BaseException as exc:  # noqa: BLE001 - the module's problem, reported on every request
        failure = exc
    for line in reader:
        try:
            if failure is not None:
                raise ImportError(f"{project}.py did not import: {type(failure).__name__}: {failure}")
            answer = json.dumps({"v": encode(_perform(json.loads(line), deref, ref), ref)})
        except BaseException as exc:  # noqa: BLE001 - reported to drive, which picks the class
            names = [c.__name__ for c in type(exc).__mro__]
            answer = json.dumps({"e": names, "m": str(exc)[:MAX_TEXT]})
        writer.write(answer + "\n")
        writer.flush()


OPERATIONS = {
    "len": len, "bool": bool, "list": list, "repr": repr, "str": str, "int": int, "float": float, "abs": abs,
    "index": operator.index, "neg": operator.neg, "getitem": operator.getitem, "setitem": operator.setitem,
    "delitem": operator.delitem, "contains": operator.contains, "eq": operator.eq, "ne": operator.ne,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "add": operator.add,
    "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv, "floordiv": operator.floordiv,
    "mod": operator.mod}


def _perform(req: dict, deref, ref):
    obj = deref(req["o"])
    op = req["op"]
    if op == "get":
        return getattr(obj, req["name"])
    if op == "set":
        return setattr(obj, req["name"], decode(req["v"], deref))
    args = decode(req["a"], deref)
    if op == "call":
        kwargs = decode(req["k"], deref)
        return obj(*args, **kwargs), args, kwargs  # with the arguments as the call left them
    value = OPERATIONS[op](obj, *args)
    return value[:MAX_TEXT] if op in ("repr", "str") and type(value) is str else value


# -- drive: runs the tests, never the module -------------------------------------------------------
class RemoteError(Exception):
    """What a remote exception becomes when no built-in Exception class matches its names."""


class Link:
    """drive's end of the pipe: one request, one answer, in order."""

    def __init__(self) -> None:
        self.reader, self.writer = channel()
        self.refs: dict[int, Remote] = {}

    def deref(self, n: int) -> Remote:
        if n not in self.refs:  # one stand-in per remote object, so `is` means what it means there
            self.refs[n] = Remote(self, n)
        return self.refs[n]

    def ask(self, **req):
        self.writer.write(json.dumps(req) + "\n")  # (every value in it went through send)
        self.writer.flush()
        line = self.reader.readline()
        if not line:
            raise RemoteError("the module's process ended")
        answer = json.loads(line)
        if type(answer) is not dict:
            raise RemoteError("answer not understood")
        if "e" in answer:
            raise _builtin_exception(answer["e"])(str(answer.get("m", ""))[:MAX_TEXT])
        return decode(answer["v"], self.deref)

    def send(self, value):
        """value in wire form: references to remote objects by number; our own objects refused."""
        return encode(value, self._number)

    def _number(self, obj) -> int:
        if isinstance(obj, Remote) and obj._link is self:
            return obj._n
        raise TypeError(f"{type(obj).__name__} cannot be passed to the module")


# what tells the caller of a function "no more items" (map, filter, zip, next): raised by the module inside a
# test's map(), it would end the iteration early, so all(map(f, xs)) held whatever f computed. It arrives as
# RuntimeError instead, as PEP 479 has it inside a generator.
ENDS_ITERATION = (StopIteration, StopAsyncIteration)


def _builtin_exception(names) -> type:
    for name in names if isinstance(names, list) else []:
        cls = getattr(builtins, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, Exception):
            return RuntimeError if issubclass(cls, ENDS_ITERATION) else cls
    return RemoteError


def _copy_back(mine, theirs) -> None:
    """Leave the caller's list, dict or set as the call left the module's copy."""
    for a, b in zip(mine, theirs):
        if type(a) is list and type(b) is list:
            a[:] = b
        elif type(a) in (dict, set) and type(b) is type(a):
            a.clear()
            a.update(b)


class Remote:
    """A function, class or object living in serve. Calls, attribute reads, iteration, indexing and
    unary arithmetic go there; a comparison or binary arithmetic only with another remote object
    (there too): nothing is evaluated here with the module's code."""

    def __init__(self, link: Link, n: int) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_n", n)

    def _apply(self, op: str, *args):
        return self._link.ask(op=op, o=self._n, a=self._link.send(list(args)))

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocol look-ups (copy, import) are not the module's
        return self._link.ask(op="get", o=self._n, name=name)

    def __setattr__(self, name, value):
        self._link.ask(op="set", o=self._n, name=name, v=self._link.send(value))

    def __call__(self, *args, **kwargs):
        link = self._link
        value, args_after, kwargs_after = link.ask(op="call", o=self._n, a=link.send(list(args)),
                                                   k=link.send(dict(kwargs)))
        _copy_back(args, args_after)
        _copy_back(list(kwargs.values()), [kwargs_after.get(k) for k in kwargs])
        return value

    def __iter__(self):
        return iter(self._apply("list"))

    def __repr__(self):
        text = self._apply("repr")
        return text if type(text) is str else "<remote object>"

    def __str__(self):
        text = self._apply("str")
        return text if type(text) is str else "<remote object>"

    def __hash__(self):
        return hash((Remote, self._n))


def _forward(op: str, remote_only: bool = False):
    def method(self, *args):
        if remote_only and not isinstance(args[0], Remote):
            return NotImplemented  # the module's object never equals, nor orders against, a plain value
        return self._apply(op, *args)
    method.__name__ = f"__{op}__"
    return method


for _op in ("len", "bool", "int", "float", "index", "abs", "neg", "getitem", "setitem", "delitem", "contains"):
    setattr(Remote, f"__{_op}__", _forward(_op))
# arithmetic only between the module's objects: with a plain operand the module saw the test's expected
# value and chose the result (``abs(c_to_f(37) - 98.6) < 1e-9`` passed for an object whose __sub__ gave 0)
for _op in ("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod"):
    setattr(Remote, f"__{_op}__", _forward(_op, remote_only=True))


class StandIn(types.ModuleType):
    """The project's module as the tests import it: each name is read from serve."""

    def __init__(self, project: str, link: Link) -> None:
        super().__init__(project)
        self._remote = link.deref(0)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        try:
            return getattr(self._remote, name)
        except AttributeError as exc:
            raise ImportError(f"cannot import name {name!r} from {self.__name__!r}") from exc


def drive(tests_path: str, project: str) -> int:
    """Run every test_ function of the hidden tests; 0 when all passed (and there was one)."""
    link = Link()
    sys.modules[project] = StandIn(project, link)
    namespace = {"__name__": "hidden_tests"}
    with open(tests_path, encoding="utf-8") as f:
        exec(compile(f.read(), "hidden_tests.py", "exec"), namespace)  # noqa: S102 - the task's own tests
    tests = [(k, v) for k, v in list(namespace.items()) if k.startswith("test_") and callable(v)]
    failed = 0
    for name, fn in tests:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - any exception is a failing test
            failed += 1
            print("FAILED", name, type(exc).__name__, str(exc)[:200], file=sys.stderr)
    print(f"{len(tests) - failed} of {len(tests)} hidden tests passed", file=sys.stderr)
    return 1 if failed or not tests else 0


if __name__ == "__main__":
    sys.set_int_max_str_digits(0)  # (an exact answer may be a very long integer: the tests decide, not a limit)
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        sys.exit(drive(sys.argv[2], sys.argv[3]))
