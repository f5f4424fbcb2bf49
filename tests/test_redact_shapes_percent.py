"""The redactor's ``%XX`` pre-check (found by review): code full of printf formats (``%4d`` is 'M',
``%2d`` '-') was parsed and searched whole on every call, while secrets spelled with escapes it did not
know (``%25252D``: quoted three times, ``%5Cu002D``, a JSON ``\\u0025``, a ``%3D`` or ``\\u000a`` right
before a key) were not looked for at all. On the redactor alone: the fast path must give what the
slow path (parse, then mask every string) gives.
"""

from __future__ import annotations

import json
import random

from lightning_harness.proxy.redact import MASK, Redactor, dumps

SECRET = "team-gateway-credential-2741"  # a known value of no provider's shape
KEY = "sk-proj-" + "qg6YYZYn9ZhyiA4uoRgnatmUdjAWtGSU" + "T3BlbkFJ" + "PtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA"
PRINTF = ["%4d", "%2d", "%6d", "%-5s", "%2x", "%08x", "%5.2f", "%4f", "%6.3f", "%s", "%d", "%3d", "%-10s",
          "%lu", "%2e", "%5c", "%4d%%", "%6f"]


def printf_source(size: int = 170_000, seed: int = 11) -> str:
    """C and Python source as an agent reads it: printf formats on most lines."""
    rnd = random.Random(seed)
    lines: list[str] = []
    while sum(map(len, lines)) < size:
        f = " ".join(rnd.choice(PRINTF) for _ in range(rnd.randint(1, 4)))
        lines.append(rnd.choice([f'    printf("row {f}\\n", i, n, name);',
                                 f'    fprintf(stderr, "{f} items\\n", count, total);',
                                 f'    print("%s: {f}" % (label, value, x))',
                                 f'    log.info("step {f} loss=%.4f", step, loss)',
                                 "    for (int i = 0; i < n; i++) { total += a[i] * b[i]; }"]))
    return "\n".join(lines)


def _request(content: str) -> str:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def _slow_path(r: Redactor, doc: str, known) -> tuple[str, bool]:
    """What ``scrub_json`` gives once its pre-check says 'look': every string parsed and masked."""
    new, hit = r._walk(json.loads(doc), known)
    return (dumps(new) if hit else doc), hit


def test_printf_heavy_code_stays_on_the_fast_path_with_the_slow_paths_output():
    r = Redactor(["proxy-token-0123456789abcdef"])
    known = r.known({SECRET}, {"sk-real-Q7fGh2KpX9vLm4Ns8TbW1cYd"})
    doc = _request(printf_source())
    assert len(doc) > 170_000
    assert r._suspect(doc, known) is False  # was True: any %4d sent it down the slow path
    assert r.scrub_json(doc, known) == _slow_path(r, doc, known) == (doc, False)


# ... and two that only a second decode joins: a bare '%' before escaped hex digits ('%%36%31' and
# '%6%31' both decode to '%61', then 'a': found by review)
_STYLES = ["%{x}", "%{xl}", "%25{x}", "%2525{x}", "%5Cu00{x}", "\\u00{x}", "%%{x0h}%{x1h}", "%{x0}%{x1h}"]


def _spell(rnd: random.Random, text: str) -> str:
    """Part of a secret as some encoder chain may leave it in a JSON string: one escape style, at a
    random rate (one style alone is what a pre-check blind to it misses)."""
    style, rate = rnd.choice(_STYLES), rnd.random()
    return "".join(_styled(style, c) if rnd.random() < rate else c for c in text)


def _styled(style: str, c: str) -> str:
    x = f"{ord(c):02X}"
    return style.format(x=x, xl=x.lower(), x0=x[0], x0h=f"{ord(x[0]):02X}", x1h=f"{ord(x[1]):02X}")


def test_secrets_spelled_with_percent_escapes_are_masked_among_printf_formats():
    r = Redactor()
    known = r.known({SECRET})
    code = printf_source(4000)
    every = "".join(f"%{b:02X}" for b in SECRET.encode())
    spelled = [SECRET.replace("-", "%2D", 1), every, SECRET.replace("-", "%252D", 1),
               SECRET.replace("-", "%25252D", 1), SECRET.replace("-", "%5Cu002D", 1),
               f"OPENAI_API_KEY%3D{KEY}&x=1", KEY.replace("-", "%2d", 1),
               "".join(_styled("%%{x0h}%{x1h}", c) for c in SECRET), "".join(_styled("%{x0}%{x1h}", c) for c in KEY)]
    for around in ("", code):  # alone in prose, and among printf formats
        for s in spelled:
            doc = _request(f"{around}\nGET /cb?state={s}&y=2\n{around}")
            out, hit = r.scrub_json(doc, known)
            assert hit and SECRET not in out and KEY not in out and MASK in out, s
            assert (out, hit) == _slow_path(r, doc, known), s
        for raw in (_request(f"{around} team%2Dgateway-credential-2741").replace("%2D", "\\u00252D"),  # JSON '%'
                    _request(f"{around} KEY=a{KEY}").replace("=a", "=\\u000a"),  # a newline before the key
                    _request(f"{around} KEY=a{KEY}").replace("=a", "=\\u00e9")):
            out, hit = r.scrub_json(raw, known)
            assert hit and SECRET not in json.loads(out)["messages"][0]["content"] and KEY not in out, raw[-60:]


def test_the_pre_check_never_skips_a_text_the_slow_path_masks():
    """Generated texts: printf formats, pieces of the secret and of a key spelled with random escapes,
    separators. Wherever the pre-check says 'nothing here', the slow path masks nothing either."""
    rnd = random.Random(2741)
    r = Redactor()
    known = r.known({SECRET})
    seps = [" ", "=", '"', "\n", "\\", "/", "&", "%", "%%", "%20", "%3D", "%0A", "\\u000a", "\\u00e9", "-", "é"]
    skipped = masked = 0
    for _ in range(3000):
        parts = []
        for _piece in range(rnd.randint(1, 6)):
            roll = rnd.random()
            if roll < 0.3:
                parts.append(rnd.choice(PRINTF))
            elif roll < 0.6:
                whole = rnd.choice([SECRET, KEY])
                a, b = sorted(rnd.sample(range(len(whole) + 1), 2)) if rnd.random() < 0.5 else (0, len(whole))
                parts.append(_spell(rnd, whole[a:b]))
            else:
                parts.append(rnd.choice(seps))
        doc = json.dumps({"c": "".join(parts)})
        if rnd.random() < 0.1:
            doc = doc.replace("%", "\\u0025", 1)
        slow = _slow_path(r, doc, known)
        if not r._suspect(doc, known):
            assert slow == (doc, False), doc
            assert r.scrub_json(doc, known) == slow
            skipped += 1
        masked += slow[1]
    assert skipped > 300 and masked > 300  # (both kinds of text were made)
