"""Train-only projects: the same shape as projects.py's, kept in a catalogue of their own.

The held-out projects are drawn from projects.py's catalogue alone (generate.split_projects), so the
projects here only ever add train tasks: the eval split and the draw stay exactly as they were. None
reuses a held-out project's name or a held-out function name (build_swe_model.held_out_names).
"""

from __future__ import annotations

TRAIN_ONLY_PROJECTS: dict[str, dict[str, str]] = {}


def project(name: str, module: str, visible: str, hidden: str) -> None:
    """Register a train-only project; literal sources, as in projects.py. The reward also runs the
    visible tests' functions after the hidden ones (``reward_extra``), so a module that fails a visible
    test never earns it: a wrong edit the agent sees failing is never scored as a fix."""
    visible_checks = visible.split("\n\n\n", 1)[1]  # the test functions, without the import line
    TRAIN_ONLY_PROJECTS[name] = {"module": module, "visible": visible, "hidden": hidden,
                                 "reward_extra": "\n\n" + visible_checks}


project("scoreboard", '''
def rank_players(scores):
    """Names by score, highest first; ties by name."""
    return sorted(scores, key=lambda name: (-scores[name], name))


def winner_margin(scores):
    if len(scores) < 2:
        return 0
    top = sorted(scores.values(), reverse=True)
    return top[0] - top[1]


def total_points(rounds, player):
    total = 0
    for points in rounds:
        if player in points:
            total += points[player]
    return total
''', '''
from scoreboard import rank_players, winner_margin, total_points


def test_rank_players_order():
    assert rank_players({"ann": 3, "bob": 5, "cy": 1}) == ["bob", "ann", "cy"]


def test_winner_margin_three():
    assert winner_margin({"a": 10, "b": 7, "c": 2}) == 3


def test_total_points_rounds():
    assert total_points([{"a": 2, "b": 1}, {"a": 3}], "a") == 5
''', '''
from scoreboard import rank_players, winner_margin, total_points


def test_rank_players_ties():
    assert rank_players({"zed": 2, "amy": 2, "kim": 4}) == ["kim", "amy", "zed"]
    assert rank_players({}) == []


def test_winner_margin_more():
    assert winner_margin({"solo": 9}) == 0
    assert winner_margin({}) == 0
    assert winner_margin({"a": 4, "b": 4}) == 0
    assert winner_margin({"a": 1, "b": 8}) == 7


def test_total_points_more():
    assert total_points([], "a") == 0
    assert total_points([{"b": 4}, {"b": 1, "a": 0}], "b") == 5
    assert total_points([{"x": -2}, {"x": 5}], "x") == 3
''')

project("daytuples", '''
MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def month_length(year, month):
    """Days in a month of a (non-leap-aware) year, February 29 in years divisible by 4."""
    if month == 2 and year % 4 == 0:
        return 29
    return MONTH_DAYS[month - 1]


def next_day(date):
    year, month, day = date
    if day < month_length(year, month):
        return (year, month, day + 1)
    if month < 12:
        return (year, month + 1, 1)
    return (year + 1, 1, 1)


def compare_dates(a, b):
    if a == b:
        return 0
    if a < b:
        return -1
    return 1


def add_days(date, n):
    for _ in range(n):
        date = next_day(date)
    return date
''', '''
from daytuples import month_length, next_day, compare_dates, add_days


def test_month_length_feb():
    assert month_length(2023, 2) == 28
    assert month_length(2024, 2) == 29


def test_next_day_month_end():
    assert next_day((2023, 1, 31)) == (2023, 2, 1)


def test_compare_dates_order():
    assert compare_dates((2020, 5, 1), (2021, 1, 1)) == -1


def test_add_days_week():
    assert add_days((2023, 3, 28), 7) == (2023, 4, 4)
''', '''
from daytuples import month_length, next_day, compare_dates, add_days


def test_month_length_more():
    assert month_length(2023, 1) == 31
    assert month_length(2023, 4) == 30
    assert month_length(2023, 12) == 31


def test_next_day_more():
    assert next_day((2023, 6, 10)) == (2023, 6, 11)
    assert next_day((2023, 12, 31)) == (2024, 1, 1)
    assert next_day((2024, 2, 28)) == (2024, 2, 29)
    assert next_day((2023, 2, 28)) == (2023, 3, 1)


def test_compare_dates_more():
    assert compare_dates((2020, 1, 1), (2020, 1, 1)) == 0
    assert compare_dates((2020, 2, 1), (2020, 1, 30)) == 1
    assert compare_dates((2020, 1, 2), (2020, 1, 3)) == -1


def test_add_days_more():
    assert add_days((2023, 5, 5), 0) == (2023, 5, 5)
    assert add_days((2023, 12, 30), 3) == (2024, 1, 2)
    assert add_days((2023, 2, 27), 2) == (2023, 3, 1)
''')

project("lifegrid", '''
def count_neighbours(grid, r, c):
    """Live cells among the up to eight cells around (r, c)."""
    total = 0
    for dr in (-1, 0, 1):
        for dc in (-1, 0, 1):
            if dr == 0 and dc == 0:
                continue
            rr = r + dr
            cc = c + dc
            if 0 <= rr < len(grid) and 0 <= cc < len(grid[0]):
                total += grid[rr][cc]
    return total


def cell_survives(alive, neighbours):
    if alive:
        return neighbours == 2 or neighbours == 3
    return neighbours == 3


def next_generation(grid):
    rows = []
    for r in range(len(grid)):
        row = []
        for c in range(len(grid[0])):
            row.append(1 if cell_survives(grid[r][c], count_neighbours(grid, r, c)) else 0)
        rows.append(row)
    return rows


def population(grid):
    return sum(sum(row) for row in grid)
''', '''
from lifegrid import count_neighbours, cell_survives, next_generation, population


def test_count_neighbours_centre():
    grid = [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    assert count_neighbours(grid, 1, 1) == 3


def test_cell_survives_rules():
    assert cell_survives(1, 2)
    assert not cell_survives(0, 2)


def test_next_generation_blinker():
    grid = [[0, 1, 0], [0, 1, 0], [0, 1, 0]]
    assert next_generation(grid) == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_population_counts():
    assert population([[1, 0], [1, 1]]) == 3
''', '''
from lifegrid import count_neighbours, cell_survives, next_generation, population


def test_count_neighbours_edges():
    grid = [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    assert count_neighbours(grid, 0, 0) == 2
    assert count_neighbours(grid, 2, 2) == 1
    assert count_neighbours(grid, 0, 2) == 2
    assert count_neighbours([[1]], 0, 0) == 0


def test_cell_survives_more():
    assert cell_survives(1, 3)
    assert cell_survives(0, 3)
    assert not cell_survives(1, 1)
    assert not cell_survives(1, 4)
    assert not cell_survives(0, 4)


def test_next_generation_more():
    block = [[1, 1], [1, 1]]
    assert next_generation(block) == block
    assert next_generation([[1, 0], [0, 0]]) == [[0, 0], [0, 0]]
    row = [[0, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert next_generation(row) == [[0, 1, 0], [0, 1, 0], [0, 1, 0]]


def test_population_more():
    assert population([[0, 0]]) == 0
    assert population([[1], [1], [1]]) == 3
''')

project("csvline", '''
def split_fields(line, sep=","):
    """Fields of one line, each stripped of surrounding spaces."""
    return [field.strip() for field in line.split(sep)]


def parse_numbers(line):
    values = []
    for field in split_fields(line):
        if field == "":
            values.append(0)
        else:
            values.append(int(field))
    return values


def join_fields(fields, sep=","):
    return sep.join(str(f) for f in fields)


def column(lines, index):
    out = []
    for line in lines:
        fields = split_fields(line)
        if index < len(fields):
            out.append(fields[index])
    return out
''', '''
from csvline import split_fields, parse_numbers, join_fields, column


def test_split_fields_spaces():
    assert split_fields(" a , b,c ") == ["a", "b", "c"]


def test_parse_numbers_blank():
    assert parse_numbers("1, ,3") == [1, 0, 3]


def test_join_fields_numbers():
    assert join_fields([1, 2, 3]) == "1,2,3"


def test_column_second():
    assert column(["a,b", "c,d,e", "f"], 1) == ["b", "d"]
''', '''
from csvline import split_fields, parse_numbers, join_fields, column


def test_split_fields_more():
    assert split_fields("x;y", ";") == ["x", "y"]
    assert split_fields("solo") == ["solo"]
    assert split_fields("a,,b") == ["a", "", "b"]


def test_parse_numbers_more():
    assert parse_numbers("10,-2,7") == [10, -2, 7]
    assert parse_numbers(",") == [0, 0]
    assert parse_numbers("5") == [5]


def test_join_fields_more():
    assert join_fields(["a", "b"], "|") == "a|b"
    assert join_fields([]) == ""
    assert join_fields(["z"]) == "z"


def test_column_more():
    assert column(["a,b", "c,d"], 0) == ["a", "c"]
    assert column(["a,b", "c,d"], 2) == []
    assert column([], 0) == []
''')

project("kvconfig", '''
def parse_pairs(text):
    """'a=1;b=2' -> {'a': '1', 'b': '2'}; empty pieces and pieces without '=' are skipped."""
    result = {}
    for piece in text.split(";"):
        if "=" not in piece:
            continue
        key, value = piece.split("=", 1)
        result[key.strip()] = value.strip()
    return result


def dump_pairs(pairs):
    return ";".join(f"{k}={pairs[k]}" for k in sorted(pairs))


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        if value is not None:
            merged[key] = value
    return merged


def int_setting(pairs, key, default):
    if key not in pairs:
        return default
    return int(pairs[key])
''', '''
from kvconfig import parse_pairs, dump_pairs, merge_configs, int_setting


def test_parse_pairs_two():
    assert parse_pairs("a=1;b=2") == {"a": "1", "b": "2"}


def test_dump_pairs_sorted():
    assert dump_pairs({"b": 2, "a": 1}) == "a=1;b=2"


def test_merge_configs_override():
    assert merge_configs({"x": 1, "y": 2}, {"y": 3}) == {"x": 1, "y": 3}


def test_int_setting_present():
    assert int_setting({"n": "12"}, "n", 0) == 12
''', '''
from kvconfig import parse_pairs, dump_pairs, merge_configs, int_setting


def test_parse_pairs_more():
    assert parse_pairs("") == {}
    assert parse_pairs("junk;k = v ;") == {"k": "v"}
    assert parse_pairs("url=a=b") == {"url": "a=b"}


def test_dump_pairs_more():
    assert dump_pairs({}) == ""
    assert dump_pairs({"z": "last", "m": 0}) == "m=0;z=last"


def test_merge_configs_more():
    assert merge_configs({"a": 1}, {"a": None, "b": 2}) == {"a": 1, "b": 2}
    assert merge_configs({}, {}) == {}
    base = {"k": 1}
    merge_configs(base, {"k": 5})
    assert base == {"k": 1}


def test_int_setting_more():
    assert int_setting({}, "n", 7) == 7
    assert int_setting({"n": "-3"}, "n", 7) == -3
''')

project("histogram", '''
def bucket_counts(values, width):
    """How many values fall in [0, width), [width, 2*width), ... up to the largest value's bucket."""
    if not values:
        return []
    counts = [0] * (max(values) // width + 1)
    for v in values:
        counts[v // width] += 1
    return counts


def bar(n, symbol="#"):
    return symbol * n


def render(counts):
    lines = []
    for i, n in enumerate(counts):
        lines.append(f"{i}: {bar(n)}")
    return "\\n".join(lines)


def fullest_bucket(counts):
    best = 0
    for i in range(1, len(counts)):
        if counts[i] > counts[best]:
            best = i
    return best
''', '''
from histogram import bucket_counts, bar, render, fullest_bucket


def test_bucket_counts_width_ten():
    assert bucket_counts([1, 5, 12, 25, 29], 10) == [2, 1, 2]


def test_bar_three():
    assert bar(3) == "###"


def test_render_two_rows():
    assert render([2, 0, 1]) == "0: ##\\n1: \\n2: #"


def test_fullest_bucket_middle():
    assert fullest_bucket([1, 4, 2]) == 1
''', '''
from histogram import bucket_counts, bar, render, fullest_bucket


def test_bucket_counts_more():
    assert bucket_counts([], 5) == []
    assert bucket_counts([0], 5) == [1]
    assert bucket_counts([5, 9, 10], 5) == [0, 2, 1]
    assert bucket_counts([3, 3, 3], 1) == [0, 0, 0, 3]


def test_bar_more():
    assert bar(0) == ""
    assert bar(2, "*") == "**"


def test_render_more():
    assert render([]) == ""
    assert render([1]) == "0: #"


def test_fullest_bucket_more():
    assert fullest_bucket([5]) == 0
    assert fullest_bucket([3, 3, 1]) == 0
    assert fullest_bucket([0, 1, 2, 9]) == 3
    assert fullest_bucket([2, 0, 2, 3]) == 3
''')

project("polynomial", '''
def poly_eval(coeffs, x):
    """Value at x of the polynomial with coefficients lowest degree first (Horner's rule)."""
    result = 0
    for c in reversed(coeffs):
        result = result * x + c
    return result


def poly_sum(p, q):
    n = max(len(p), len(q))
    out = []
    for i in range(n):
        a = p[i] if i < len(p) else 0
        b = q[i] if i < len(q) else 0
        out.append(a + b)
    return out


def derivative(coeffs):
    return [i * coeffs[i] for i in range(1, len(coeffs))]


def degree(coeffs):
    d = len(coeffs) - 1
    while d > 0 and coeffs[d] == 0:
        d -= 1
    return d
''', '''
from polynomial import poly_eval, poly_sum, derivative, degree


def test_poly_eval_quadratic():
    assert poly_eval([1, 2, 3], 2) == 17


def test_poly_sum_lengths():
    assert poly_sum([1, 2], [3, 4, 5]) == [4, 6, 5]


def test_derivative_cubic():
    assert derivative([5, 0, 3, 2]) == [0, 6, 6]


def test_degree_trailing_zero():
    assert degree([1, 2, 0]) == 1
''', '''
from polynomial import poly_eval, poly_sum, derivative, degree


def test_poly_eval_more():
    assert poly_eval([], 3) == 0
    assert poly_eval([4], 10) == 4
    assert poly_eval([0, 1], -5) == -5
    assert poly_eval([1, -1, 1], 3) == 7


def test_poly_sum_more():
    assert poly_sum([], []) == []
    assert poly_sum([1, 1, 1], [2]) == [3, 1, 1]
    assert poly_sum([2, -3], [-2, 3]) == [0, 0]


def test_derivative_more():
    assert derivative([7]) == []
    assert derivative([0, 4]) == [4]
    assert derivative([1, 1, 1, 1, 1]) == [1, 2, 3, 4]


def test_degree_more():
    assert degree([3]) == 0
    assert degree([0, 0, 0]) == 0
    assert degree([1, 0, 4]) == 2
    assert degree([0, 5, 0, 0]) == 1
''')

project("sequences", '''
def fizz_word(n):
    """'Fizz' for multiples of 3, 'Buzz' of 5, both for 15, else the number."""
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)


def collatz_steps(n):
    steps = 0
    while n != 1:
        if n % 2 == 0:
            n = n // 2
        else:
            n = 3 * n + 1
        steps += 1
    return steps


def triangular(n):
    return n * (n + 1) // 2


def nth_odd(n):
    return 2 * n - 1
''', '''
from sequences import fizz_word, collatz_steps, triangular, nth_odd


def test_fizz_word_three_five():
    assert fizz_word(9) == "Fizz"
    assert fizz_word(10) == "Buzz"


def test_collatz_six():
    assert collatz_steps(6) == 8


def test_triangular_four():
    assert triangular(4) == 10


def test_nth_odd_third():
    assert nth_odd(3) == 5
''', '''
from sequences import fizz_word, collatz_steps, triangular, nth_odd


def test_fizz_word_more():
    assert fizz_word(30) == "FizzBuzz"
    assert fizz_word(7) == "7"
    assert fizz_word(1) == "1"
    assert fizz_word(3) == "Fizz"


def test_collatz_more():
    assert collatz_steps(1) == 0
    assert collatz_steps(2) == 1
    assert collatz_steps(3) == 7
    assert collatz_steps(7) == 16


def test_triangular_more():
    assert triangular(0) == 0
    assert triangular(1) == 1
    assert triangular(10) == 55


def test_nth_odd_more():
    assert nth_odd(1) == 1
    assert nth_odd(10) == 19
''')

project("bitwise", '''
def count_bits(n):
    """Set bits of a non-negative integer."""
    count = 0
    while n > 0:
        count += n % 2
        n = n // 2
    return count


def to_binary(n):
    if n == 0:
        return "0"
    digits = ""
    while n > 0:
        digits = str(n % 2) + digits
        n = n // 2
    return digits


def from_binary(text):
    value = 0
    for ch in text:
        value = value * 2 + int(ch)
    return value


def is_power_of_two(n):
    return n > 0 and count_bits(n) == 1
''', '''
from bitwise import count_bits, to_binary, from_binary, is_power_of_two


def test_count_bits_seven():
    assert count_bits(7) == 3


def test_to_binary_ten():
    assert to_binary(10) == "1010"


def test_from_binary_five():
    assert from_binary("101") == 5


def test_power_of_two_eight():
    assert is_power_of_two(8)
    assert not is_power_of_two(6)
''', '''
from bitwise import count_bits, to_binary, from_binary, is_power_of_two


def test_count_bits_more():
    assert count_bits(0) == 0
    assert count_bits(1) == 1
    assert count_bits(255) == 8
    assert count_bits(16) == 1


def test_to_binary_more():
    assert to_binary(0) == "0"
    assert to_binary(1) == "1"
    assert to_binary(6) == "110"


def test_from_binary_more():
    assert from_binary("0") == 0
    assert from_binary("1111") == 15
    assert from_binary("1000") == 8


def test_power_of_two_more():
    assert is_power_of_two(1)
    assert not is_power_of_two(0)
    assert not is_power_of_two(12)
    assert is_power_of_two(1024)
''')

project("anagrams", '''
def letter_counts(word):
    """Counts of each letter, case-insensitive, ignoring anything that is not a letter."""
    counts = {}
    for ch in word.lower():
        if ch.isalpha():
            counts[ch] = counts.get(ch, 0) + 1
    return counts


def is_anagram(a, b):
    return letter_counts(a) == letter_counts(b)


def group_anagrams(words):
    groups = {}
    for w in words:
        key = "".join(sorted(w.lower()))
        groups.setdefault(key, []).append(w)
    return sorted(groups.values(), key=lambda g: (-len(g), g[0]))


def missing_letters(word, target):
    have = letter_counts(word)
    need = letter_counts(target)
    return sum(max(0, n - have.get(ch, 0)) for ch, n in need.items())
''', '''
from anagrams import letter_counts, is_anagram, group_anagrams, missing_letters


def test_letter_counts_word():
    assert letter_counts("Abba!") == {"a": 2, "b": 2}


def test_is_anagram_listen():
    assert is_anagram("Listen", "Silent")
    assert not is_anagram("abc", "abd")


def test_group_anagrams_sizes():
    assert group_anagrams(["tea", "bat", "eat", "ate"]) == [["tea", "eat", "ate"], ["bat"]]


def test_missing_letters_two():
    assert missing_letters("cat", "coat") == 1
''', '''
from anagrams import letter_counts, is_anagram, group_anagrams, missing_letters


def test_letter_counts_more():
    assert letter_counts("") == {}
    assert letter_counts("1 2 3") == {}
    assert letter_counts("aAa") == {"a": 3}


def test_is_anagram_more():
    assert is_anagram("", "")
    assert is_anagram("Dormitory", "dirty room")
    assert not is_anagram("aab", "abb")


def test_group_anagrams_more():
    assert group_anagrams([]) == []
    assert group_anagrams(["b", "a"]) == [["a"], ["b"]]
    assert group_anagrams(["ab", "ba", "cd", "dc", "ee"]) == [["ab", "ba"], ["cd", "dc"], ["ee"]]


def test_missing_letters_more():
    assert missing_letters("abc", "abc") == 0
    assert missing_letters("", "aab") == 3
    assert missing_letters("ab", "aab") == 1
    assert missing_letters("zzz", "z") == 0
''')

project("whitespace", '''
def strip_trailing(lines):
    """Each line without trailing spaces or tabs."""
    return [line.rstrip(" \\t") for line in lines]


def collapse_spaces(text):
    out = []
    previous_space = False
    for ch in text:
        if ch == " ":
            if not previous_space:
                out.append(ch)
            previous_space = True
        else:
            out.append(ch)
            previous_space = False
    return "".join(out)


def indent_level(line, tab=4):
    level = 0
    for ch in line:
        if ch == " ":
            level += 1
        elif ch == "\\t":
            level += tab
        else:
            break
    return level


def reindent(lines, spaces):
    return [" " * spaces + line.lstrip() for line in lines]
''', '''
from whitespace import strip_trailing, collapse_spaces, indent_level, reindent


def test_strip_trailing_lines():
    assert strip_trailing(["a  ", "b\\t"]) == ["a", "b"]


def test_collapse_spaces_runs():
    assert collapse_spaces("a   b  c") == "a b c"


def test_indent_level_mixed():
    assert indent_level("\\t  x") == 6


def test_reindent_two():
    assert reindent(["  a", "b"], 2) == ["  a", "  b"]
''', '''
from whitespace import strip_trailing, collapse_spaces, indent_level, reindent


def test_strip_trailing_more():
    assert strip_trailing([]) == []
    assert strip_trailing(["  lead"]) == ["  lead"]
    assert strip_trailing([" \\t "]) == [""]


def test_collapse_spaces_more():
    assert collapse_spaces("") == ""
    assert collapse_spaces("  x  ") == " x "
    assert collapse_spaces("abc") == "abc"


def test_indent_level_more():
    assert indent_level("x") == 0
    assert indent_level("    y") == 4
    assert indent_level("\\tz", tab=8) == 8
    assert indent_level("   ") == 3


def test_reindent_more():
    assert reindent([], 4) == []
    assert reindent(["\\tq"], 0) == ["q"]
    assert reindent(["a", "  b"], 1) == [" a", " b"]
''')

project("ledger", '''
def balance(entries):
    """Net of ('in', amount) and ('out', amount) entries."""
    total = 0
    for kind, amount in entries:
        if kind == "in":
            total += amount
        elif kind == "out":
            total -= amount
    return total


def largest_expense(entries):
    best = None
    for kind, amount in entries:
        if kind == "out" and (best is None or amount > best):
            best = amount
    return best


def running_totals(entries):
    totals = []
    current = 0
    for kind, amount in entries:
        current += amount if kind == "in" else -amount
        totals.append(current)
    return totals


def overdrawn_at(entries):
    for i, total in enumerate(running_totals(entries)):
        if total < 0:
            return i
    return -1
''', '''
from ledger import balance, largest_expense, running_totals, overdrawn_at


def test_balance_mixed():
    assert balance([("in", 10), ("out", 3), ("in", 2)]) == 9


def test_largest_expense_two():
    assert largest_expense([("out", 4), ("in", 50), ("out", 7)]) == 7


def test_running_totals_three():
    assert running_totals([("in", 5), ("out", 2), ("out", 1)]) == [5, 3, 2]


def test_overdrawn_at_second():
    assert overdrawn_at([("in", 1), ("out", 3), ("in", 5)]) == 1
''', '''
from ledger import balance, largest_expense, running_totals, overdrawn_at


def test_balance_more():
    assert balance([]) == 0
    assert balance([("out", 4)]) == -4
    assert balance([("fee", 9), ("in", 1)]) == 1


def test_largest_expense_more():
    assert largest_expense([]) is None
    assert largest_expense([("in", 3)]) is None
    assert largest_expense([("out", 0)]) == 0
    assert largest_expense([("out", 9), ("out", 2)]) == 9


def test_running_totals_more():
    assert running_totals([]) == []
    assert running_totals([("out", 2), ("in", 2)]) == [-2, 0]


def test_overdrawn_at_more():
    assert overdrawn_at([]) == -1
    assert overdrawn_at([("in", 3), ("out", 3)]) == -1
    assert overdrawn_at([("out", 1)]) == 0
    assert overdrawn_at([("in", 2), ("out", 1), ("out", 2)]) == 2
''')

project("ballots", '''
def tally_votes(ballots):
    """Votes per candidate; blank ballots (empty strings) are not counted."""
    counts = {}
    for name in ballots:
        if name:
            counts[name] = counts.get(name, 0) + 1
    return counts


def leader(ballots):
    counts = tally_votes(ballots)
    if not counts:
        return None
    return min(counts, key=lambda name: (-counts[name], name))


def has_majority(ballots, name):
    counted = [b for b in ballots if b]
    return 2 * tally_votes(ballots).get(name, 0) > len(counted)


def turnout(ballots, voters):
    if voters == 0:
        return 0.0
    return round(100 * len(ballots) / voters, 1)
''', '''
from ballots import tally_votes, leader, has_majority, turnout


def test_tally_votes_blank():
    assert tally_votes(["a", "b", "", "a"]) == {"a": 2, "b": 1}


def test_leader_clear():
    assert leader(["x", "y", "y"]) == "y"


def test_has_majority_yes():
    assert has_majority(["a", "a", "b"], "a")


def test_turnout_half():
    assert turnout(["a", "b"], 4) == 50.0
''', '''
from ballots import tally_votes, leader, has_majority, turnout


def test_tally_votes_more():
    assert tally_votes([]) == {}
    assert tally_votes(["", ""]) == {}
    assert tally_votes(["q"]) == {"q": 1}


def test_leader_more():
    assert leader([]) is None
    assert leader(["", ""]) is None
    assert leader(["b", "a"]) == "a"
    assert leader(["c", "b", "c", "b", "a"]) == "b"


def test_has_majority_more():
    assert not has_majority(["a", "b"], "a")
    assert not has_majority([], "a")
    assert has_majority(["a", "", ""], "a")
    assert not has_majority(["a", "b", "b"], "a")


def test_turnout_more():
    assert turnout([], 0) == 0.0
    assert turnout(["a"], 3) == 33.3
    assert turnout(["a", "b", "c"], 3) == 100.0
''')

project("rectangles", '''
def rect_area(rect):
    """Area of (x1, y1, x2, y2) with x1 <= x2 and y1 <= y2."""
    x1, y1, x2, y2 = rect
    return (x2 - x1) * (y2 - y1)


def overlap_area(a, b):
    left = max(a[0], b[0])
    right = min(a[2], b[2])
    bottom = max(a[1], b[1])
    top = min(a[3], b[3])
    if right <= left or top <= bottom:
        return 0
    return (right - left) * (top - bottom)


def contains_point(rect, point):
    x, y = point
    return rect[0] <= x <= rect[2] and rect[1] <= y <= rect[3]


def bounding_rect(points):
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return (min(xs), min(ys), max(xs), max(ys))
''', '''
from rectangles import rect_area, overlap_area, contains_point, bounding_rect


def test_rect_area_simple():
    assert rect_area((1, 1, 4, 3)) == 6


def test_overlap_area_partial():
    assert overlap_area((0, 0, 4, 4), (2, 1, 6, 3)) == 4


def test_contains_point_inside():
    assert contains_point((0, 0, 5, 5), (2, 3))
    assert not contains_point((0, 0, 5, 5), (6, 1))


def test_bounding_rect_three():
    assert bounding_rect([(1, 5), (3, -2), (0, 4)]) == (0, -2, 3, 5)
''', '''
from rectangles import rect_area, overlap_area, contains_point, bounding_rect


def test_rect_area_more():
    assert rect_area((0, 0, 0, 9)) == 0
    assert rect_area((-2, -2, 2, 3)) == 20


def test_overlap_area_more():
    assert overlap_area((0, 0, 2, 2), (2, 0, 4, 2)) == 0
    assert overlap_area((0, 0, 2, 2), (5, 5, 6, 6)) == 0
    assert overlap_area((0, 0, 10, 10), (1, 2, 3, 7)) == 10
    assert overlap_area((1, 2, 3, 7), (0, 0, 10, 10)) == 10


def test_contains_point_more():
    assert contains_point((0, 0, 5, 5), (5, 5))
    assert contains_point((0, 0, 5, 5), (0, 0))
    assert not contains_point((0, 0, 5, 5), (2, -1))
    assert not contains_point((0, 0, 5, 5), (1, 6))


def test_bounding_rect_more():
    assert bounding_rect([(2, 3)]) == (2, 3, 2, 3)
    assert bounding_rect([(0, 0), (4, 1)]) == (0, 0, 4, 1)
''')

project("hms", '''
def to_seconds(hours, minutes, seconds):
    """Total seconds of an h:m:s duration."""
    return hours * 3600 + minutes * 60 + seconds


def from_seconds(total):
    hours = total // 3600
    minutes = total % 3600 // 60
    return (hours, minutes, total % 60)


def is_earlier(a, b):
    return to_seconds(*a) < to_seconds(*b)


def format_hms(total):
    hours, minutes, seconds = from_seconds(total)
    if hours > 0:
        return f"{hours}:{minutes:02d}:{seconds:02d}"
    return f"{minutes}:{seconds:02d}"
''', '''
from hms import to_seconds, from_seconds, is_earlier, format_hms


def test_to_seconds_mixed():
    assert to_seconds(1, 2, 3) == 3723


def test_from_seconds_mixed():
    assert from_seconds(3723) == (1, 2, 3)


def test_is_earlier_minutes():
    assert is_earlier((0, 5, 0), (0, 6, 0))


def test_format_hms_hours():
    assert format_hms(3725) == "1:02:05"
''', '''
from hms import to_seconds, from_seconds, is_earlier, format_hms


def test_to_seconds_more():
    assert to_seconds(0, 0, 0) == 0
    assert to_seconds(0, 1, 0) == 60
    assert to_seconds(2, 0, 59) == 7259


def test_from_seconds_more():
    assert from_seconds(0) == (0, 0, 0)
    assert from_seconds(59) == (0, 0, 59)
    assert from_seconds(7200) == (2, 0, 0)


def test_is_earlier_more():
    assert not is_earlier((1, 0, 0), (1, 0, 0))
    assert not is_earlier((2, 0, 0), (1, 59, 59))
    assert is_earlier((0, 0, 1), (0, 0, 2))


def test_format_hms_more():
    assert format_hms(65) == "1:05"
    assert format_hms(0) == "0:00"
    assert format_hms(3600) == "1:00:00"
''')

project("units", '''
FACTORS = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0}


def convert_length(value, source, target):
    """value in unit source expressed in unit target."""
    return value * FACTORS[source] / FACTORS[target]


def round_to(x, step):
    return round(x / step) * step


def km_to_miles(km):
    return round(km * 0.621371, 2)


def larger_length(a, b):
    """The larger of two (value, unit) pairs, compared in metres."""
    if convert_length(a[0], a[1], "m") >= convert_length(b[0], b[1], "m"):
        return a
    return b
''', '''
from units import convert_length, round_to, km_to_miles, larger_length


def test_convert_length_km_to_m():
    assert convert_length(2, "km", "m") == 2000


def test_round_to_five():
    assert round_to(13, 5) == 15


def test_km_to_miles_ten():
    assert km_to_miles(10) == 6.21


def test_larger_length_units():
    assert larger_length((1, "km"), (900, "m")) == (1, "km")
''', '''
from units import convert_length, round_to, km_to_miles, larger_length


def test_convert_length_more():
    assert convert_length(250, "cm", "m") == 2.5
    assert convert_length(3, "m", "mm") == 3000
    assert convert_length(7, "m", "m") == 7


def test_round_to_more():
    assert round_to(12, 5) == 10
    assert round_to(0, 3) == 0
    assert round_to(19, 10) == 20


def test_km_to_miles_more():
    assert km_to_miles(0) == 0
    assert km_to_miles(1) == 0.62


def test_larger_length_more():
    assert larger_length((5, "cm"), (40, "mm")) == (5, "cm")
    assert larger_length((1, "m"), (100, "cm")) == (1, "m")
    assert larger_length((2, "mm"), (1, "cm")) == (1, "cm")
''')

project("orders", '''
def order_total(lines):
    """Sum of quantity * unit price over (item, qty, price) lines."""
    return sum(qty * price for _, qty, price in lines)


def most_ordered(lines):
    totals = {}
    for item, qty, _ in lines:
        totals[item] = totals.get(item, 0) + qty
    best = None
    for item in sorted(totals):
        if best is None or totals[item] > totals[best]:
            best = item
    return best


def split_evenly(cents, people):
    share = cents // people
    extra = cents % people
    return [share + 1 if i < extra else share for i in range(people)]


def free_shipping(lines, threshold):
    return order_total(lines) >= threshold
''', '''
from orders import order_total, most_ordered, split_evenly, free_shipping


def test_order_total_two_lines():
    assert order_total([("pen", 3, 2), ("pad", 1, 5)]) == 11


def test_most_ordered_sum():
    assert most_ordered([("a", 2, 1), ("b", 3, 1), ("a", 2, 1)]) == "a"


def test_split_evenly_remainder():
    assert split_evenly(10, 3) == [4, 3, 3]


def test_free_shipping_over():
    assert free_shipping([("x", 2, 30)], 50)
''', '''
from orders import order_total, most_ordered, split_evenly, free_shipping


def test_order_total_more():
    assert order_total([]) == 0
    assert order_total([("a", 0, 9)]) == 0
    assert order_total([("a", 2, 7), ("b", 3, 1)]) == 17


def test_most_ordered_more():
    assert most_ordered([]) is None
    assert most_ordered([("b", 1, 1), ("a", 1, 1)]) == "a"
    assert most_ordered([("z", 5, 1), ("y", 4, 1)]) == "z"


def test_split_evenly_more():
    assert split_evenly(9, 3) == [3, 3, 3]
    assert split_evenly(5, 1) == [5]
    assert split_evenly(2, 4) == [1, 1, 0, 0]


def test_free_shipping_more():
    assert free_shipping([("x", 1, 50)], 50)
    assert not free_shipping([("x", 1, 49)], 50)
    assert not free_shipping([], 1)
''')

project("stockroom", '''
def restock(levels, item, qty):
    """A new levels dict with qty more of item; the argument is left unchanged."""
    updated = dict(levels)
    updated[item] = updated.get(item, 0) + qty
    return updated


def reorder_list(levels, minimum):
    return sorted(item for item, qty in levels.items() if qty <= minimum)


def total_units(levels):
    total = 0
    for qty in levels.values():
        total += qty
    return total


def ship(levels, item, qty):
    """Units actually shipped: no more than are in stock."""
    have = levels.get(item, 0)
    sent = min(have, qty)
    levels[item] = have - sent
    return sent
''', '''
from stockroom import restock, reorder_list, total_units, ship


def test_restock_new_item():
    assert restock({"a": 1}, "b", 4) == {"a": 1, "b": 4}


def test_reorder_list_low():
    assert reorder_list({"a": 1, "b": 9, "c": 3}, 3) == ["a", "c"]


def test_total_units_three():
    assert total_units({"a": 1, "b": 2, "c": 3}) == 6


def test_ship_partial():
    levels = {"a": 3}
    assert ship(levels, "a", 5) == 3
    assert levels["a"] == 0
''', '''
from stockroom import restock, reorder_list, total_units, ship


def test_restock_more():
    base = {"a": 2}
    assert restock(base, "a", 3) == {"a": 5}
    assert base == {"a": 2}
    assert restock({}, "z", 0) == {"z": 0}


def test_reorder_list_more():
    assert reorder_list({}, 5) == []
    assert reorder_list({"x": 5, "y": 6}, 5) == ["x"]
    assert reorder_list({"b": 0, "a": 0}, 0) == ["a", "b"]


def test_total_units_more():
    assert total_units({}) == 0
    assert total_units({"a": 7}) == 7


def test_ship_more():
    levels = {"a": 10}
    assert ship(levels, "a", 4) == 4
    assert levels == {"a": 6}
    assert ship(levels, "b", 2) == 0
    assert levels["b"] == 0
''')

project("gradebook", '''
def weighted_score(parts, weights):
    """Sum of part * weight divided by the total weight."""
    total = 0
    for part, weight in zip(parts, weights):
        total += part * weight
    return total / sum(weights)


def curve(scores, bonus, cap):
    return [min(s + bonus, cap) for s in scores]


def rank_of(score, scores):
    better = 0
    for s in scores:
        if s > score:
            better += 1
    return better + 1


def passed_count(scores, mark):
    return len([s for s in scores if s >= mark])
''', '''
from gradebook import weighted_score, curve, rank_of, passed_count


def test_weighted_score_two():
    assert weighted_score([80, 60], [3, 1]) == 75


def test_curve_cap():
    assert curve([90, 97], 5, 100) == [95, 100]


def test_rank_of_second():
    assert rank_of(80, [70, 90, 80]) == 2


def test_passed_count_half():
    assert passed_count([40, 50, 60, 30], 50) == 2
''', '''
from gradebook import weighted_score, curve, rank_of, passed_count


def test_weighted_score_more():
    assert weighted_score([50], [2]) == 50
    assert weighted_score([100, 0], [1, 1]) == 50
    assert weighted_score([10, 20, 30], [1, 2, 1]) == 20


def test_curve_more():
    assert curve([], 3, 10) == []
    assert curve([1, 2], 0, 10) == [1, 2]
    assert curve([8], 2, 10) == [10]


def test_rank_of_more():
    assert rank_of(100, [100, 50]) == 1
    assert rank_of(10, []) == 1
    assert rank_of(1, [5, 4, 3]) == 4
    assert rank_of(4, [5, 4, 4, 3]) == 2


def test_passed_count_more():
    assert passed_count([], 1) == 0
    assert passed_count([1, 1], 1) == 2
    assert passed_count([0, 0], 1) == 0
''')

project("windows", '''
def window_sums(xs, k):
    """Sum of every run of k consecutive items."""
    if k > len(xs):
        return []
    sums = [sum(xs[:k])]
    for i in range(k, len(xs)):
        sums.append(sums[-1] + xs[i] - xs[i - k])
    return sums


def best_window(xs, k):
    sums = window_sums(xs, k)
    if not sums:
        return -1
    return sums.index(max(sums))


def moving_average(xs, k):
    return [s / k for s in window_sums(xs, k)]


def pairwise_steps(xs):
    return [xs[i + 1] - xs[i] for i in range(len(xs) - 1)]
''', '''
from windows import window_sums, best_window, moving_average, pairwise_steps


def test_window_sums_two():
    assert window_sums([1, 2, 3, 4], 2) == [3, 5, 7]


def test_best_window_middle():
    assert best_window([1, 9, 9, 1, 0], 2) == 1


def test_moving_average_three():
    assert moving_average([3, 6, 9, 12], 3) == [6, 9]


def test_pairwise_steps_up_down():
    assert pairwise_steps([1, 4, 2]) == [3, -2]
''', '''
from windows import window_sums, best_window, moving_average, pairwise_steps


def test_window_sums_more():
    assert window_sums([1, 2], 3) == []
    assert window_sums([5], 1) == [5]
    assert window_sums([1, 2, 3], 3) == [6]
    assert window_sums([2, 0, 2, 0], 1) == [2, 0, 2, 0]


def test_best_window_more():
    assert best_window([], 1) == -1
    assert best_window([4, 1, 1, 4], 2) == 0
    assert best_window([0, 1, 2, 3], 2) == 2


def test_moving_average_more():
    assert moving_average([2, 4], 1) == [2, 4]
    assert moving_average([1], 2) == []


def test_pairwise_steps_more():
    assert pairwise_steps([]) == []
    assert pairwise_steps([7]) == []
    assert pairwise_steps([0, 0, 5, 1]) == [0, 5, -4]
''')

project("prefixsum", '''
def prefix_sums(xs):
    """[0, xs[0], xs[0] + xs[1], ...]: one more entry than xs."""
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def range_total(prefix, i, j):
    """Sum of xs[i:j] from prefix_sums(xs)."""
    return prefix[j] - prefix[i]


def first_over(xs, limit):
    total = 0
    for i, x in enumerate(xs):
        total += x
        if total > limit:
            return i
    return None


def balance_point(xs):
    prefix = prefix_sums(xs)
    for i in range(len(xs)):
        if prefix[i] == prefix[-1] - prefix[i + 1]:
            return i
    return -1
''', '''
from prefixsum import prefix_sums, range_total, first_over, balance_point


def test_prefix_sums_three():
    assert prefix_sums([1, 2, 3]) == [0, 1, 3, 6]


def test_range_total_middle():
    assert range_total(prefix_sums([4, 5, 6, 7]), 1, 3) == 11


def test_first_over_third():
    assert first_over([2, 2, 2, 2], 5) == 2


def test_balance_point_centre():
    assert balance_point([1, 7, 3, 6, 5, 6]) == 3
''', '''
from prefixsum import prefix_sums, range_total, first_over, balance_point


def test_prefix_sums_more():
    assert prefix_sums([]) == [0]
    assert prefix_sums([-1, 1]) == [0, -1, 0]


def test_range_total_more():
    p = prefix_sums([4, 5, 6, 7])
    assert range_total(p, 0, 4) == 22
    assert range_total(p, 2, 2) == 0
    assert range_total(p, 3, 4) == 7


def test_first_over_more():
    assert first_over([], 0) is None
    assert first_over([1, 1], 5) is None
    assert first_over([9], 3) == 0
    assert first_over([3, 2], 5) is None


def test_balance_point_more():
    assert balance_point([1, 2, 3]) == -1
    assert balance_point([5]) == 0
    assert balance_point([2, 0, 2]) == 1
''')

project("finder", '''
def index_of(xs, target):
    """First index of target, or -1."""
    for i in range(len(xs)):
        if xs[i] == target:
            return i
    return -1


def last_index_of(xs, target):
    i = len(xs) - 1
    while i >= 0:
        if xs[i] == target:
            return i
        i -= 1
    return -1


def positions(xs, target):
    return [i for i, x in enumerate(xs) if x == target]


def nearest_value(xs, target):
    best = xs[0]
    for x in xs[1:]:
        if abs(x - target) < abs(best - target):
            best = x
    return best
''', '''
from finder import index_of, last_index_of, positions, nearest_value


def test_index_of_repeat():
    assert index_of([4, 2, 4], 4) == 0


def test_last_index_of_repeat():
    assert last_index_of([4, 2, 4, 1], 4) == 2


def test_positions_all():
    assert positions([1, 0, 1, 1], 1) == [0, 2, 3]


def test_nearest_value_close():
    assert nearest_value([10, 3, 7], 6) == 7
''', '''
from finder import index_of, last_index_of, positions, nearest_value


def test_index_of_more():
    assert index_of([], 1) == -1
    assert index_of([1, 2, 3], 3) == 2
    assert index_of([1, 2, 3], 9) == -1


def test_last_index_of_more():
    assert last_index_of([], 0) == -1
    assert last_index_of([5], 5) == 0
    assert last_index_of([5, 6], 7) == -1
    assert last_index_of([8, 8, 9], 8) == 1


def test_positions_more():
    assert positions([], 1) == []
    assert positions([2, 2], 3) == []


def test_nearest_value_more():
    assert nearest_value([5], 100) == 5
    assert nearest_value([1, 9], 5) == 1
    assert nearest_value([-4, 2, 8], 0) == 2
    assert nearest_value([20, 11, 12], 12) == 12
''')

project("sorters", '''
def insertion_sort(xs):
    """A sorted copy, by insertion."""
    out = list(xs)
    for i in range(1, len(out)):
        value = out[i]
        j = i - 1
        while j >= 0 and out[j] > value:
            out[j + 1] = out[j]
            j -= 1
        out[j + 1] = value
    return out


def is_sorted(xs):
    for i in range(len(xs) - 1):
        if xs[i] > xs[i + 1]:
            return False
    return True


def bubble_pass(xs):
    """One bubble-sort pass in place; returns the number of swaps."""
    swaps = 0
    for i in range(len(xs) - 1):
        if xs[i] > xs[i + 1]:
            xs[i], xs[i + 1] = xs[i + 1], xs[i]
            swaps += 1
    return swaps


def kth_smallest(xs, k):
    return insertion_sort(xs)[k - 1]
''', '''
from sorters import insertion_sort, is_sorted, bubble_pass, kth_smallest


def test_insertion_sort_mixed():
    assert insertion_sort([3, 1, 2]) == [1, 2, 3]


def test_is_sorted_yes_no():
    assert is_sorted([1, 2, 2, 5])
    assert not is_sorted([2, 1])


def test_bubble_pass_moves():
    xs = [3, 1, 2]
    assert bubble_pass(xs) == 2
    assert xs == [1, 2, 3]


def test_kth_smallest_second():
    assert kth_smallest([9, 4, 7], 2) == 7
''', '''
from sorters import insertion_sort, is_sorted, bubble_pass, kth_smallest


def test_insertion_sort_more():
    assert insertion_sort([]) == []
    assert insertion_sort([5, 4, 3, 2, 1]) == [1, 2, 3, 4, 5]
    assert insertion_sort([2, 2, 1]) == [1, 2, 2]
    data = [2, 1]
    insertion_sort(data)
    assert data == [2, 1]


def test_is_sorted_more():
    assert is_sorted([])
    assert is_sorted([7])
    assert not is_sorted([1, 3, 2])


def test_bubble_pass_more():
    xs = [1, 2, 3]
    assert bubble_pass(xs) == 0
    ys = [4, 3, 2, 1]
    assert bubble_pass(ys) == 3
    assert ys == [3, 2, 1, 4]


def test_kth_smallest_more():
    assert kth_smallest([5], 1) == 5
    assert kth_smallest([8, 6, 7], 1) == 6
    assert kth_smallest([8, 6, 7], 3) == 8
''')

project("brackets", '''
PAIRS = {")": "(", "]": "[", "}": "{"}


def is_balanced(text):
    """Brackets (), [] and {} close in the right order; other characters are ignored."""
    stack = []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in PAIRS:
            if not stack or stack[-1] != PAIRS[ch]:
                return False
            stack.pop()
    return not stack


def max_depth(text):
    depth = 0
    deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in PAIRS:
            depth -= 1
    return deepest


def first_unmatched(text):
    """Index of the first closing bracket with nothing open, or -1."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in PAIRS:
            if depth == 0:
                return i
            depth -= 1
    return -1
''', '''
from brackets import is_balanced, max_depth, first_unmatched


def test_is_balanced_nested():
    assert is_balanced("a(b[c]{d})")
    assert not is_balanced("(]")


def test_max_depth_three():
    assert max_depth("(a[b{c}])") == 3


def test_first_unmatched_close():
    assert first_unmatched("()())") == 4
''', '''
from brackets import is_balanced, max_depth, first_unmatched


def test_is_balanced_more():
    assert is_balanced("")
    assert is_balanced("plain")
    assert not is_balanced("((")
    assert not is_balanced(")(")
    assert not is_balanced("([)]")
    assert is_balanced("{}[]()")


def test_max_depth_more():
    assert max_depth("") == 0
    assert max_depth("()()") == 1
    assert max_depth("(())()") == 2


def test_first_unmatched_more():
    assert first_unmatched("") == -1
    assert first_unmatched("(())") == -1
    assert first_unmatched(")") == 0
    assert first_unmatched("[]]") == 2
''')

project("rpn", '''
def apply_op(a, op, b):
    """a op b for the four operators; '/' is integer division."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b


def eval_rpn(tokens):
    values = []
    for tok in tokens:
        if tok in ("+", "-", "*", "/"):
            b = values.pop()
            a = values.pop()
            values.append(apply_op(a, tok, b))
        else:
            values.append(int(tok))
    return values[-1]


def split_tokens(text):
    return [t for t in text.split(" ") if t]


def ops_used(tokens):
    return sum(1 for t in tokens if t in ("+", "-", "*", "/"))
''', '''
from rpn import apply_op, eval_rpn, split_tokens, ops_used


def test_apply_op_minus():
    assert apply_op(7, "-", 2) == 5


def test_eval_rpn_expression():
    assert eval_rpn(["3", "4", "+", "2", "*"]) == 14


def test_split_tokens_spaces():
    assert split_tokens("1  2 +") == ["1", "2", "+"]


def test_ops_used_two():
    assert ops_used(["1", "2", "+", "3", "*"]) == 2
''', '''
from rpn import apply_op, eval_rpn, split_tokens, ops_used


def test_apply_op_more():
    assert apply_op(2, "+", 3) == 5
    assert apply_op(4, "*", 5) == 20
    assert apply_op(9, "/", 2) == 4
    assert apply_op(2, "-", 9) == -7


def test_eval_rpn_more():
    assert eval_rpn(["5"]) == 5
    assert eval_rpn(["10", "3", "-"]) == 7
    assert eval_rpn(["8", "2", "/", "3", "-"]) == 1


def test_split_tokens_more():
    assert split_tokens("") == []
    assert split_tokens("42") == ["42"]


def test_ops_used_more():
    assert ops_used([]) == 0
    assert ops_used(["-", "/"]) == 2
''')

project("paths", '''
def join_path(parts):
    """Parts joined by '/', with no doubled slashes between them."""
    cleaned = [p.strip("/") for p in parts if p.strip("/")]
    path = "/".join(cleaned)
    if parts and parts[0].startswith("/"):
        return "/" + path
    return path


def file_extension(name):
    dot = name.rfind(".")
    if dot <= 0:
        return ""
    return name[dot + 1:]


def parent_dir(path):
    cut = path.rstrip("/").rfind("/")
    if cut < 0:
        return ""
    if cut == 0:
        return "/"
    return path[:cut]


def path_depth(path):
    return len([p for p in path.split("/") if p])
''', '''
from paths import join_path, file_extension, parent_dir, path_depth


def test_join_path_slashes():
    assert join_path(["a/", "/b", "c"]) == "a/b/c"


def test_file_extension_py():
    assert file_extension("main.py") == "py"


def test_parent_dir_two_levels():
    assert parent_dir("src/pkg/mod.py") == "src/pkg"


def test_path_depth_three():
    assert path_depth("/a/b/c") == 3
''', '''
from paths import join_path, file_extension, parent_dir, path_depth


def test_join_path_more():
    assert join_path([]) == ""
    assert join_path(["/root", "x"]) == "/root/x"
    assert join_path(["", "y", "/"]) == "y"


def test_file_extension_more():
    assert file_extension("archive.tar.gz") == "gz"
    assert file_extension(".bashrc") == ""
    assert file_extension("README") == ""


def test_parent_dir_more():
    assert parent_dir("file") == ""
    assert parent_dir("/top") == "/"
    assert parent_dir("a/b/") == "a"


def test_path_depth_more():
    assert path_depth("") == 0
    assert path_depth("/") == 0
    assert path_depth("x//y") == 2
''')

project("accounts", '''
def valid_username(name):
    """3-12 characters, letters, digits or underscores, not starting with a digit."""
    if len(name) < 3 or len(name) > 12:
        return False
    if name[0].isdigit():
        return False
    return all(ch.isalnum() or ch == "_" for ch in name)


def password_strength(password):
    score = 0
    if len(password) >= 8:
        score += 1
    if any(ch.isdigit() for ch in password):
        score += 1
    if any(ch.isupper() for ch in password):
        score += 1
    if any(not ch.isalnum() for ch in password):
        score += 1
    return score


def is_hex_colour(text):
    if len(text) != 7 or text[0] != "#":
        return False
    return all(ch in "0123456789abcdefABCDEF" for ch in text[1:])
''', '''
from accounts import valid_username, password_strength, is_hex_colour


def test_valid_username_ok():
    assert valid_username("user_1")
    assert not valid_username("1user")


def test_password_strength_full():
    assert password_strength("Secret#99") == 4


def test_is_hex_colour_ok():
    assert is_hex_colour("#a0B1c2")
    assert not is_hex_colour("a0b1c2")
''', '''
from accounts import valid_username, password_strength, is_hex_colour


def test_valid_username_more():
    assert not valid_username("ab")
    assert valid_username("abc")
    assert valid_username("a" * 12)
    assert not valid_username("a" * 13)
    assert not valid_username("bad-name")


def test_password_strength_more():
    assert password_strength("") == 0
    assert password_strength("abcdefgh") == 1
    assert password_strength("abc1") == 1
    assert password_strength("A!") == 2


def test_is_hex_colour_more():
    assert not is_hex_colour("#12345")
    assert not is_hex_colour("#12345g")
    assert is_hex_colour("#000000")
''')

project("coins", '''
def make_change(amount, coins):
    """Greedy change for amount from coin values, largest first."""
    result = []
    for coin in sorted(coins, reverse=True):
        while amount >= coin:
            amount -= coin
            result.append(coin)
    return result


def coin_total(counts):
    return sum(value * n for value, n in counts.items())


def cents_to_text(cents):
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}${cents // 100}.{cents % 100:02d}"


def fewest_coins(amount, coins):
    return len(make_change(amount, coins))
''', '''
from coins import make_change, coin_total, cents_to_text, fewest_coins


def test_make_change_us():
    assert make_change(41, [1, 5, 10, 25]) == [25, 10, 5, 1]


def test_coin_total_mixed():
    assert coin_total({25: 2, 1: 3}) == 53


def test_cents_to_text_dollars():
    assert cents_to_text(1205) == "$12.05"


def test_fewest_coins_six():
    assert fewest_coins(30, [1, 5, 10, 25]) == 2
''', '''
from coins import make_change, coin_total, cents_to_text, fewest_coins


def test_make_change_more():
    assert make_change(0, [1, 5]) == []
    assert make_change(10, [5, 1]) == [5, 5]
    assert make_change(3, [2]) == [2]


def test_coin_total_more():
    assert coin_total({}) == 0
    assert coin_total({10: 0, 5: 1}) == 5


def test_cents_to_text_more():
    assert cents_to_text(0) == "$0.00"
    assert cents_to_text(7) == "$0.07"
    assert cents_to_text(-250) == "-$2.50"


def test_fewest_coins_more():
    assert fewest_coins(4, [1, 2]) == 2
    assert fewest_coins(1, [1]) == 1
''')

project("divisors", '''
def divisors_of(n):
    """Positive divisors of n in increasing order."""
    small = []
    large = []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def is_perfect(n):
    return n > 1 and sum(divisors_of(n)) - n == n


def sum_of_squares(n):
    total = 0
    for k in range(1, n + 1):
        total += k * k
    return total


def coprime(a, b):
    while b:
        a, b = b, a % b
    return a == 1
''', '''
from divisors import divisors_of, is_perfect, sum_of_squares, coprime


def test_divisors_of_twelve():
    assert divisors_of(12) == [1, 2, 3, 4, 6, 12]


def test_is_perfect_six():
    assert is_perfect(6)
    assert not is_perfect(8)


def test_sum_of_squares_three():
    assert sum_of_squares(3) == 14


def test_coprime_pairs():
    assert coprime(8, 15)
    assert not coprime(6, 9)
''', '''
from divisors import divisors_of, is_perfect, sum_of_squares, coprime


def test_divisors_of_more():
    assert divisors_of(1) == [1]
    assert divisors_of(16) == [1, 2, 4, 8, 16]
    assert divisors_of(7) == [1, 7]


def test_is_perfect_more():
    assert is_perfect(28)
    assert not is_perfect(1)
    assert not is_perfect(12)


def test_sum_of_squares_more():
    assert sum_of_squares(0) == 0
    assert sum_of_squares(1) == 1
    assert sum_of_squares(10) == 385


def test_coprime_more():
    assert coprime(1, 1)
    assert coprime(9, 28)
    assert not coprime(10, 4)
''')

project("series", '''
def fib(n):
    """n-th Fibonacci number, fib(0) = 0 and fib(1) = 1."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def arithmetic_term(first, step, n):
    return first + (n - 1) * step


def geometric_sum(first, ratio, n):
    total = 0
    term = first
    for _ in range(n):
        total += term
        term *= ratio
    return total


def is_arithmetic(xs):
    if len(xs) < 3:
        return True
    step = xs[1] - xs[0]
    return all(xs[i + 1] - xs[i] == step for i in range(1, len(xs) - 1))
''', '''
from series import fib, arithmetic_term, geometric_sum, is_arithmetic


def test_fib_ten():
    assert fib(10) == 55


def test_arithmetic_term_fifth():
    assert arithmetic_term(2, 3, 5) == 14


def test_geometric_sum_doubling():
    assert geometric_sum(1, 2, 4) == 15


def test_is_arithmetic_yes_no():
    assert is_arithmetic([1, 4, 7, 10])
    assert not is_arithmetic([1, 2, 4])
''', '''
from series import fib, arithmetic_term, geometric_sum, is_arithmetic


def test_fib_more():
    assert fib(0) == 0
    assert fib(1) == 1
    assert fib(2) == 1
    assert fib(7) == 13


def test_arithmetic_term_more():
    assert arithmetic_term(5, 10, 1) == 5
    assert arithmetic_term(0, -2, 4) == -6


def test_geometric_sum_more():
    assert geometric_sum(3, 5, 0) == 0
    assert geometric_sum(3, 5, 1) == 3
    assert geometric_sum(2, 3, 3) == 26


def test_is_arithmetic_more():
    assert is_arithmetic([])
    assert is_arithmetic([4, 9])
    assert is_arithmetic([5, 5, 5])
    assert not is_arithmetic([1, 3, 5, 8])
''')

project("dictops", '''
def reverse_lookup(mapping):
    """value -> sorted list of keys that had it."""
    out = {}
    for key, value in mapping.items():
        out.setdefault(value, []).append(key)
    return {v: sorted(ks) for v, ks in out.items()}


def merge_counts(a, b):
    merged = dict(a)
    for key, n in b.items():
        merged[key] = merged.get(key, 0) + n
    return merged


def keep_at_least(counts, minimum):
    return {k: v for k, v in counts.items() if v >= minimum}


def top_key(counts):
    best_key = None
    for key in sorted(counts):
        if best_key is None or counts[key] > counts[best_key]:
            best_key = key
    return best_key
''', '''
from dictops import reverse_lookup, merge_counts, keep_at_least, top_key


def test_reverse_lookup_shared():
    assert reverse_lookup({"a": 1, "b": 2, "c": 1}) == {1: ["a", "c"], 2: ["b"]}


def test_merge_counts_overlap():
    assert merge_counts({"x": 1, "y": 2}, {"y": 3, "z": 1}) == {"x": 1, "y": 5, "z": 1}


def test_keep_at_least_two():
    assert keep_at_least({"a": 1, "b": 2, "c": 3}, 2) == {"b": 2, "c": 3}


def test_top_key_largest():
    assert top_key({"a": 1, "b": 5, "c": 2}) == "b"
''', '''
from dictops import reverse_lookup, merge_counts, keep_at_least, top_key


def test_reverse_lookup_more():
    assert reverse_lookup({}) == {}
    assert reverse_lookup({"z": 0, "y": 0}) == {0: ["y", "z"]}


def test_merge_counts_more():
    base = {"a": 1}
    assert merge_counts(base, {"a": 1}) == {"a": 2}
    assert base == {"a": 1}
    assert merge_counts({}, {}) == {}


def test_keep_at_least_more():
    assert keep_at_least({}, 0) == {}
    assert keep_at_least({"a": 0}, 0) == {"a": 0}
    assert keep_at_least({"a": 4}, 5) == {}


def test_top_key_more():
    assert top_key({}) is None
    assert top_key({"b": 3, "a": 3}) == "a"
    assert top_key({"q": -1}) == "q"
''')

project("partitions", '''
def group_by_length(words):
    """length -> words of that length, in input order."""
    groups = {}
    for w in words:
        groups.setdefault(len(w), []).append(w)
    return groups


def partition_around(xs, pivot):
    below = [x for x in xs if x < pivot]
    rest = [x for x in xs if x >= pivot]
    return below, rest


def split_at(xs, i):
    return xs[:i], xs[i:]


def chunks_of(xs, size):
    out = []
    for start in range(0, len(xs), size):
        out.append(xs[start:start + size])
    return out
''', '''
from partitions import group_by_length, partition_around, split_at, chunks_of


def test_group_by_length_mixed():
    assert group_by_length(["ab", "c", "de"]) == {2: ["ab", "de"], 1: ["c"]}


def test_partition_around_five():
    assert partition_around([7, 1, 5, 3], 5) == ([1, 3], [7, 5])


def test_split_at_two():
    assert split_at([1, 2, 3, 4], 2) == ([1, 2], [3, 4])


def test_chunks_of_uneven():
    assert chunks_of([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
''', '''
from partitions import group_by_length, partition_around, split_at, chunks_of


def test_group_by_length_more():
    assert group_by_length([]) == {}
    assert group_by_length(["", "x"]) == {0: [""], 1: ["x"]}


def test_partition_around_more():
    assert partition_around([], 0) == ([], [])
    assert partition_around([2, 2], 2) == ([], [2, 2])
    assert partition_around([-1, 9], 0) == ([-1], [9])


def test_split_at_more():
    assert split_at([1, 2], 0) == ([], [1, 2])
    assert split_at([1, 2], 2) == ([1, 2], [])
    assert split_at([], 1) == ([], [])


def test_chunks_of_more():
    assert chunks_of([], 3) == []
    assert chunks_of([1, 2, 3], 3) == [[1, 2, 3]]
    assert chunks_of([1, 2, 3], 1) == [[1], [2], [3]]
''')

project("readability", '''
def sentence_count(text):
    """Sentences end with '.', '!' or '?'; a run of them ends one sentence."""
    count = 0
    previous = ""
    for ch in text:
        if ch in ".!?" and previous not in ".!?":
            count += 1
        previous = ch
    return count


def average_word_length(text):
    words = [w.strip(".,!?") for w in text.split()]
    words = [w for w in words if w]
    if not words:
        return 0.0
    return sum(len(w) for w in words) / len(words)


def longest_word(text):
    best = ""
    for w in text.split():
        w = w.strip(".,!?")
        if len(w) > len(best):
            best = w
    return best


def long_words(text, minimum):
    return [w for w in text.split() if len(w) >= minimum]
''', '''
from readability import sentence_count, average_word_length, longest_word, long_words


def test_sentence_count_three():
    assert sentence_count("Hi. Who are you? Wow!") == 3


def test_average_word_length_simple():
    assert average_word_length("ab abcd") == 3


def test_longest_word_first():
    assert longest_word("the quick brown fox") == "quick"


def test_long_words_five():
    assert long_words("tiny enormous small", 5) == ["enormous", "small"]
''', '''
from readability import sentence_count, average_word_length, longest_word, long_words


def test_sentence_count_more():
    assert sentence_count("") == 0
    assert sentence_count("no end") == 0
    assert sentence_count("Wait... what?!") == 2
    assert sentence_count("A. B. C.") == 3


def test_average_word_length_more():
    assert average_word_length("") == 0.0
    assert average_word_length("... !") == 0.0
    assert average_word_length("one, two.") == 3


def test_longest_word_more():
    assert longest_word("") == ""
    assert longest_word("ab, cd!") == "ab"
    assert longest_word("a bb ccc") == "ccc"


def test_long_words_more():
    assert long_words("", 1) == []
    assert long_words("abc de", 3) == ["abc"]
    assert long_words("abc de", 4) == []
''')

project("elevator", '''
def floors_travelled(start, stops):
    """Floors passed going from start through each stop in order."""
    total = 0
    current = start
    for stop in stops:
        total += abs(stop - current)
        current = stop
    return total


def next_stop(requests, current, going_up):
    if going_up:
        ahead = [f for f in requests if f > current]
        return min(ahead) if ahead else None
    below = [f for f in requests if f < current]
    return max(below) if below else None


def within_capacity(loads, limit):
    riders = 0
    for change in loads:
        riders += change
        if riders > limit:
            return False
    return True


def busiest_floor(requests):
    counts = {}
    for f in requests:
        counts[f] = counts.get(f, 0) + 1
    return max(sorted(counts), key=lambda f: counts[f])
''', '''
from elevator import floors_travelled, next_stop, within_capacity, busiest_floor


def test_floors_travelled_up_down():
    assert floors_travelled(0, [5, 2]) == 8


def test_next_stop_up():
    assert next_stop([1, 4, 7], 3, True) == 4


def test_within_capacity_over():
    assert not within_capacity([3, 2, -1, 4], 6)


def test_busiest_floor_repeat():
    assert busiest_floor([2, 3, 3, 1]) == 3
''', '''
from elevator import floors_travelled, next_stop, within_capacity, busiest_floor


def test_floors_travelled_more():
    assert floors_travelled(3, []) == 0
    assert floors_travelled(3, [3]) == 0
    assert floors_travelled(10, [0, 10]) == 20


def test_next_stop_more():
    assert next_stop([1, 4, 7], 3, False) == 1
    assert next_stop([1, 4, 7], 7, True) is None
    assert next_stop([1, 4, 7], 1, False) is None
    assert next_stop([2, 6], 4, True) == 6


def test_within_capacity_more():
    assert within_capacity([], 0)
    assert within_capacity([5, -5, 5], 5)
    assert not within_capacity([1], 0)


def test_busiest_floor_more():
    assert busiest_floor([4]) == 4
    assert busiest_floor([5, 2]) == 2
    assert busiest_floor([9, 9, 1, 1]) == 1
''')

project("travel", '''
def average_speed(distance, hours):
    """km per hour, rounded to one decimal."""
    return round(distance / hours, 1)


def eta_minutes(distance, speed):
    return round(distance / speed * 60)


def fuel_needed(distance, per_100):
    return distance * per_100 / 100


def legs_within(legs, max_leg):
    """True when every leg of the trip is at most max_leg km."""
    for leg in legs:
        if leg > max_leg:
            return False
    return True


def total_trip(legs, stops_minutes, speed):
    driving = eta_minutes(sum(legs), speed)
    return driving + stops_minutes * (len(legs) - 1)
''', '''
from travel import average_speed, eta_minutes, fuel_needed, legs_within, total_trip


def test_average_speed_simple():
    assert average_speed(150, 2) == 75.0


def test_eta_minutes_half_hour():
    assert eta_minutes(40, 80) == 30


def test_fuel_needed_two_hundred():
    assert fuel_needed(200, 6) == 12


def test_legs_within_limit():
    assert legs_within([100, 200], 200)
    assert not legs_within([100, 250], 200)


def test_total_trip_two_stops():
    assert total_trip([60, 60, 60], 15, 60) == 210
''', '''
from travel import average_speed, eta_minutes, fuel_needed, legs_within, total_trip


def test_average_speed_more():
    assert average_speed(100, 3) == 33.3
    assert average_speed(0, 1) == 0


def test_eta_minutes_more():
    assert eta_minutes(0, 50) == 0
    assert eta_minutes(100, 50) == 120
    assert eta_minutes(10, 60) == 10


def test_fuel_needed_more():
    assert fuel_needed(0, 7) == 0
    assert fuel_needed(50, 8) == 4


def test_legs_within_more():
    assert legs_within([], 0)
    assert legs_within([5], 5)
    assert not legs_within([6, 1], 5)


def test_total_trip_more():
    assert total_trip([120], 30, 60) == 120
    assert total_trip([30, 30], 10, 60) == 70
''')

project("tictactoe", '''
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def winner_of(board):
    """'X' or 'O' if it has three in a line on the 9-character board, else None."""
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def is_full(board):
    return " " not in board


def free_cells(board):
    return [i for i in range(9) if board[i] == " "]


def whose_turn(board):
    xs = board.count("X")
    os = board.count("O")
    return "X" if xs <= os else "O"
''', '''
from tictactoe import winner_of, is_full, free_cells, whose_turn


def test_winner_of_row():
    assert winner_of("XXXOO    ") == "X"


def test_is_full_board():
    assert is_full("XOXOXOOXO")
    assert not is_full("XOXOXOOX ")


def test_free_cells_two():
    assert free_cells("XO XOXOX ") == [2, 8]


def test_whose_turn_o():
    assert whose_turn("X        ") == "O"
''', '''
from tictactoe import winner_of, is_full, free_cells, whose_turn


def test_winner_of_more():
    assert winner_of("         ") is None
    assert winner_of("O  O  O  ") == "O"
    assert winner_of("X   X   X") == "X"
    assert winner_of("  O O O  ") == "O"
    assert winner_of("XOXXOOOXX") is None


def test_is_full_more():
    assert not is_full("         ")


def test_free_cells_more():
    assert free_cells("XOXOXOXOX") == []
    assert free_cells("         ") == list(range(9))


def test_whose_turn_more():
    assert whose_turn("         ") == "X"
    assert whose_turn("XO       ") == "X"
    assert whose_turn("XOX      ") == "O"
''')

project("chessboard", '''
FILES = "abcdefgh"


def square_name(col, row):
    """(0, 0) -> 'a1', (7, 7) -> 'h8'."""
    return FILES[col] + str(row + 1)


def parse_square(name):
    return (FILES.index(name[0]), int(name[1]) - 1)


def knight_moves(col, row):
    count = 0
    for dc, dr in ((1, 2), (2, 1), (2, -1), (1, -2), (-1, -2), (-2, -1), (-2, 1), (-1, 2)):
        c = col + dc
        r = row + dr
        if 0 <= c < 8 and 0 <= r < 8:
            count += 1
    return count


def same_diagonal(a, b):
    (c1, r1), (c2, r2) = parse_square(a), parse_square(b)
    return a != b and abs(c1 - c2) == abs(r1 - r2)
''', '''
from chessboard import square_name, parse_square, knight_moves, same_diagonal


def test_square_name_corner():
    assert square_name(0, 0) == "a1"


def test_parse_square_e4():
    assert parse_square("e4") == (4, 3)


def test_knight_moves_centre():
    assert knight_moves(3, 3) == 8


def test_same_diagonal_yes():
    assert same_diagonal("a1", "h8")
''', '''
from chessboard import square_name, parse_square, knight_moves, same_diagonal


def test_square_name_more():
    assert square_name(7, 7) == "h8"
    assert square_name(2, 5) == "c6"


def test_parse_square_more():
    assert parse_square("a1") == (0, 0)
    assert parse_square("h8") == (7, 7)


def test_knight_moves_more():
    assert knight_moves(0, 0) == 2
    assert knight_moves(7, 0) == 2
    assert knight_moves(0, 3) == 4
    assert knight_moves(1, 1) == 4


def test_same_diagonal_more():
    assert not same_diagonal("a1", "a1")
    assert not same_diagonal("a1", "b3")
    assert same_diagonal("c1", "a3")
''')

project("dice", '''
def sum_of_face(roll, face):
    """Points for a face: face times how often it was rolled."""
    return face * roll.count(face)


def is_straight(roll):
    ordered = sorted(roll)
    for i in range(1, len(ordered)):
        if ordered[i] != ordered[i - 1] + 1:
            return False
    return True


def full_house(roll):
    counts = sorted(roll.count(f) for f in set(roll))
    return counts == [2, 3]


def best_face(roll):
    best = 1
    for face in range(2, 7):
        if sum_of_face(roll, face) >= sum_of_face(roll, best):
            best = face
    return best
''', '''
from dice import sum_of_face, is_straight, full_house, best_face


def test_sum_of_face_threes():
    assert sum_of_face([3, 3, 1, 3, 5], 3) == 9


def test_is_straight_run():
    assert is_straight([3, 1, 4, 2, 5])
    assert not is_straight([1, 2, 2, 3, 4])


def test_full_house_yes():
    assert full_house([2, 5, 2, 5, 5])


def test_best_face_fives():
    assert best_face([5, 5, 1, 1, 1]) == 5
''', '''
from dice import sum_of_face, is_straight, full_house, best_face


def test_sum_of_face_more():
    assert sum_of_face([1, 2, 3], 6) == 0
    assert sum_of_face([6, 6, 6, 6, 6], 6) == 30


def test_is_straight_more():
    assert is_straight([2, 3, 4, 5, 6])
    assert not is_straight([1, 2, 3, 4, 6])
    assert is_straight([4])


def test_full_house_more():
    assert not full_house([4, 4, 4, 4, 4])
    assert not full_house([1, 1, 2, 2, 3])
    assert full_house([6, 6, 6, 1, 1])


def test_best_face_more():
    assert best_face([1, 1, 1, 1, 1]) == 1
    assert best_face([2, 3, 3, 2, 6]) == 6
    assert best_face([3, 3, 2, 2, 2]) == 3
''')

project("checksums", '''
def luhn_valid(number):
    """Luhn check of a digit string."""
    total = 0
    for i, ch in enumerate(reversed(number)):
        d = int(ch)
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def isbn10_valid(code):
    if len(code) != 10:
        return False
    total = 0
    for i, ch in enumerate(code):
        value = 10 if ch == "X" else int(ch)
        total += (10 - i) * value
    return total % 11 == 0


def byte_checksum(text):
    return sum(ord(ch) for ch in text) % 256


def parity_bit(bits):
    return bits.count("1") % 2
''', '''
from checksums import luhn_valid, isbn10_valid, byte_checksum, parity_bit


def test_luhn_valid_card():
    assert luhn_valid("79927398713")
    assert not luhn_valid("79927398710")


def test_isbn10_valid_book():
    assert isbn10_valid("0306406152")


def test_byte_checksum_abc():
    assert byte_checksum("abc") == 38


def test_parity_bit_odd():
    assert parity_bit("1011") == 1
''', '''
from checksums import luhn_valid, isbn10_valid, byte_checksum, parity_bit


def test_luhn_valid_more():
    assert luhn_valid("0")
    assert luhn_valid("18")
    assert not luhn_valid("19")
    assert luhn_valid("4539578763621486")


def test_isbn10_valid_more():
    assert not isbn10_valid("0306406153")
    assert not isbn10_valid("123")
    assert isbn10_valid("080442957X")


def test_byte_checksum_more():
    assert byte_checksum("") == 0
    assert byte_checksum("\\xff\\x02") == 1


def test_parity_bit_more():
    assert parity_bit("") == 0
    assert parity_bit("11") == 0
    assert parity_bit("0001") == 1
''')

project("ranges", '''
def expand_ranges(text):
    """'1-3,5' -> [1, 2, 3, 5]."""
    out = []
    for part in text.split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def compress_ranges(numbers):
    """Sorted distinct numbers -> '1-3,5'."""
    parts = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        if j > i:
            parts.append(f"{numbers[i]}-{numbers[j]}")
        else:
            parts.append(str(numbers[i]))
        i = j + 1
    return ",".join(parts)


def in_any_range(x, spans):
    return any(lo <= x <= hi for lo, hi in spans)
''', '''
from ranges import expand_ranges, compress_ranges, in_any_range


def test_expand_ranges_mixed():
    assert expand_ranges("1-3,5") == [1, 2, 3, 5]


def test_compress_ranges_mixed():
    assert compress_ranges([1, 2, 3, 5, 7, 8]) == "1-3,5,7-8"


def test_in_any_range_second():
    assert in_any_range(6, [(1, 2), (5, 9)])
    assert not in_any_range(4, [(1, 2), (5, 9)])
''', '''
from ranges import expand_ranges, compress_ranges, in_any_range


def test_expand_ranges_more():
    assert expand_ranges("") == []
    assert expand_ranges("4") == [4]
    assert expand_ranges("2-2,9-10") == [2, 9, 10]


def test_compress_ranges_more():
    assert compress_ranges([]) == ""
    assert compress_ranges([4]) == "4"
    assert compress_ranges([1, 3, 5]) == "1,3,5"
    assert compress_ranges([0, 1]) == "0-1"


def test_in_any_range_more():
    assert not in_any_range(1, [])
    assert in_any_range(2, [(1, 2)])
    assert in_any_range(5, [(5, 5)])
    assert not in_any_range(10, [(1, 2), (5, 9)])
''')

project("weather", '''
def daily_range(highs, lows):
    """High minus low for each day."""
    return [h - l for h, l in zip(highs, lows)]


def hot_days(highs, threshold):
    count = 0
    for h in highs:
        if h >= threshold:
            count += 1
    return count


def longest_warm_streak(highs, threshold):
    best = 0
    run = 0
    for h in highs:
        if h > threshold:
            run += 1
            best = max(best, run)
        else:
            run = 0
    return best


def coldest_day(lows):
    index = 0
    for i in range(1, len(lows)):
        if lows[i] < lows[index]:
            index = i
    return index
''', '''
from weather import daily_range, hot_days, longest_warm_streak, coldest_day


def test_daily_range_two():
    assert daily_range([20, 25], [10, 12]) == [10, 13]


def test_hot_days_count():
    assert hot_days([28, 31, 30, 25], 30) == 2


def test_longest_warm_streak_two():
    assert longest_warm_streak([21, 23, 24, 19, 22], 20) == 3


def test_coldest_day_index():
    assert coldest_day([5, -2, 3]) == 1
''', '''
from weather import daily_range, hot_days, longest_warm_streak, coldest_day


def test_daily_range_more():
    assert daily_range([], []) == []
    assert daily_range([0], [-5]) == [5]


def test_hot_days_more():
    assert hot_days([], 0) == 0
    assert hot_days([10, 10], 11) == 0
    assert hot_days([-1, 0, 1], 0) == 2


def test_longest_warm_streak_more():
    assert longest_warm_streak([], 0) == 0
    assert longest_warm_streak([20, 20], 20) == 0
    assert longest_warm_streak([25, 10, 25, 25], 20) == 2


def test_coldest_day_more():
    assert coldest_day([7]) == 0
    assert coldest_day([3, 3, 1, 1]) == 2
    assert coldest_day([0, 4, 9]) == 0
''')

project("percentages", '''
def percent_of(part, whole):
    """part as a percentage of whole, rounded to one decimal; 0 when whole is 0."""
    if whole == 0:
        return 0.0
    return round(part * 100 / whole, 1)


def percent_change(old, new):
    return round((new - old) * 100 / old, 1)


def apply_markup(cost, percent):
    return round(cost * (100 + percent) / 100, 2)


def share_split(total, weights):
    whole = sum(weights)
    return [total * w // whole for w in weights]
''', '''
from percentages import percent_of, percent_change, apply_markup, share_split


def test_percent_of_quarter():
    assert percent_of(1, 4) == 25.0


def test_percent_change_rise():
    assert percent_change(50, 60) == 20.0


def test_apply_markup_ten():
    assert apply_markup(20, 10) == 22.0


def test_share_split_weights():
    assert share_split(100, [1, 3]) == [25, 75]
''', '''
from percentages import percent_of, percent_change, apply_markup, share_split


def test_percent_of_more():
    assert percent_of(5, 0) == 0.0
    assert percent_of(0, 9) == 0.0
    assert percent_of(2, 3) == 66.7


def test_percent_change_more():
    assert percent_change(80, 60) == -25.0
    assert percent_change(7, 7) == 0.0


def test_apply_markup_more():
    assert apply_markup(10, 0) == 10
    assert apply_markup(9.99, 50) == 14.98


def test_share_split_more():
    assert share_split(10, [1, 1, 1]) == [3, 3, 3]
    assert share_split(60, [2, 1]) == [40, 20]
''')

project("setops", '''
def jaccard(a, b):
    """|a & b| / |a | b| of two lists taken as sets; 1.0 for two empty lists."""
    sa, sb = set(a), set(b)
    union = sa | sb
    if not union:
        return 1.0
    return len(sa & sb) / len(union)


def only_in_one(a, b):
    return sorted(set(a) ^ set(b))


def is_sublist_of(small, big):
    remaining = list(big)
    for x in small:
        if x not in remaining:
            return False
        remaining.remove(x)
    return True


def common_prefix_len(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
''', '''
from setops import jaccard, only_in_one, is_sublist_of, common_prefix_len


def test_jaccard_half():
    assert jaccard([1, 2], [2, 3, 1, 4]) == 0.5


def test_only_in_one_sorted():
    assert only_in_one([3, 1, 2], [2, 4]) == [1, 3, 4]


def test_is_sublist_of_counts():
    assert is_sublist_of([1, 1], [1, 2, 1])
    assert not is_sublist_of([1, 1], [1, 2])


def test_common_prefix_len_two():
    assert common_prefix_len("abcd", "abxy") == 2
''', '''
from setops import jaccard, only_in_one, is_sublist_of, common_prefix_len


def test_jaccard_more():
    assert jaccard([], []) == 1.0
    assert jaccard([1], []) == 0.0
    assert jaccard([5, 5], [5]) == 1.0


def test_only_in_one_more():
    assert only_in_one([], []) == []
    assert only_in_one([1], [1]) == []


def test_is_sublist_of_more():
    assert is_sublist_of([], [])
    assert not is_sublist_of([3], [])
    assert is_sublist_of([2, 1], [1, 2])


def test_common_prefix_len_more():
    assert common_prefix_len("", "abc") == 0
    assert common_prefix_len("same", "same") == 4
    assert common_prefix_len("ab", "abc") == 2
    assert common_prefix_len("x", "y") == 0
''')

project("agenda", '''
def total_busy(slots):
    """Minutes covered by (start, end) slots that do not overlap."""
    return sum(end - start for start, end in slots)


def free_slots(slots, day_start, day_end):
    free = []
    current = day_start
    for start, end in sorted(slots):
        if start > current:
            free.append((current, start))
        current = max(current, end)
    if current < day_end:
        free.append((current, day_end))
    return free


def first_fit(slots, day_start, day_end, length):
    for start, end in free_slots(slots, day_start, day_end):
        if end - start >= length:
            return start
    return None


def clashes(slots):
    ordered = sorted(slots)
    return any(ordered[i][1] > ordered[i + 1][0] for i in range(len(ordered) - 1))
''', '''
from agenda import total_busy, free_slots, first_fit, clashes


def test_total_busy_two():
    assert total_busy([(60, 90), (120, 150)]) == 60


def test_free_slots_gaps():
    assert free_slots([(10, 20), (30, 40)], 0, 50) == [(0, 10), (20, 30), (40, 50)]


def test_first_fit_second_gap():
    assert first_fit([(5, 10), (12, 30)], 0, 60, 10) == 30


def test_clashes_overlap():
    assert clashes([(0, 10), (5, 15)])
''', '''
from agenda import total_busy, free_slots, first_fit, clashes


def test_total_busy_more():
    assert total_busy([]) == 0
    assert total_busy([(0, 1)]) == 1


def test_free_slots_more():
    assert free_slots([], 0, 8) == [(0, 8)]
    assert free_slots([(0, 8)], 0, 8) == []
    assert free_slots([(3, 5), (1, 2)], 0, 5) == [(0, 1), (2, 3)]


def test_first_fit_more():
    assert first_fit([(0, 10)], 0, 10, 1) is None
    assert first_fit([], 9, 17, 8) == 9
    assert first_fit([(2, 4)], 0, 10, 2) == 0
    assert first_fit([(2, 4)], 0, 10, 3) == 4


def test_clashes_more():
    assert not clashes([])
    assert not clashes([(0, 5), (5, 9)])
    assert clashes([(20, 30), (0, 25)])
''')
