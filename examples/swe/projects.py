"""Catalogue of tiny pure-Python projects the bug generator mutates.

Each project is a module (10-60 lines, a few functions), visible tests the agent sees and hidden tests
the reward runs. Tests are plain `assert` functions (no pytest import) so the generator can run them
in-process while `python -m pytest` still collects them in a materialised task folder.
"""

from __future__ import annotations

PROJECTS: dict[str, dict[str, str]] = {}


def project(name: str, module: str, visible: str, hidden: str) -> None:
    """Register a project; keeps the catalogue a flat list of literal sources."""
    PROJECTS[name] = {"module": module, "visible": visible, "hidden": hidden}


project("stats", '''
def mean(xs):
    """Arithmetic mean of a non-empty list."""
    return sum(xs) / len(xs)


def median(xs):
    ordered = sorted(xs)
    n = len(ordered)
    mid = n // 2
    if n % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total += (x - m) ** 2
    return total / len(xs)


def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x
''', '''
from stats import mean, median, variance, clamp


def test_mean_of_two():
    assert mean([2, 4]) == 3


def test_median_odd():
    assert median([5, 1, 3]) == 3


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_variance_simple():
    assert variance([1, 3]) == 1


def test_clamp_inside_and_below():
    assert clamp(5, 0, 10) == 5
    assert clamp(-2, 0, 10) == 0
''', '''
from stats import mean, median, variance, clamp


def test_mean_many():
    assert mean([1, 2, 3, 4, 10]) == 4
    assert mean([7]) == 7
    assert mean([-1, 1]) == 0


def test_median_more():
    assert median([7]) == 7
    assert median([9, 2, 7, 4, 5]) == 5
    assert median([10, 2]) == 6


def test_variance_more():
    assert variance([5, 5, 5]) == 0
    assert variance([0, 4, 8]) == 32 / 3
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == 4


def test_clamp_more():
    assert clamp(11, 0, 10) == 10
    assert clamp(0, 0, 10) == 0
    assert clamp(10, 0, 10) == 10
    assert clamp(-5, -3, 3) == -3
''')

project("strutil", '''
def capitalize_words(text):
    """Upper-case the first letter of every space-separated word."""
    words = text.split(" ")
    return " ".join(w[:1].upper() + w[1:] for w in words)


def is_palindrome(text):
    cleaned = [c.lower() for c in text if c.isalnum()]
    i = 0
    j = len(cleaned) - 1
    while i < j:
        if cleaned[i] != cleaned[j]:
            return False
        i += 1
        j -= 1
    return True


def count_vowels(text):
    count = 0
    for c in text.lower():
        if c in "aeiou":
            count += 1
    return count


def truncate(text, width):
    if len(text) <= width:
        return text
    return text[:width - 3] + "..."
''', '''
from strutil import capitalize_words, is_palindrome, count_vowels, truncate


def test_capitalize_two_words():
    assert capitalize_words("hello world") == "Hello World"


def test_palindrome_phrase():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("abca")


def test_count_vowels_word():
    assert count_vowels("Banana") == 3


def test_truncate_long_text():
    assert truncate("abcdefghij", 8) == "abcde..."
''', '''
from strutil import capitalize_words, is_palindrome, count_vowels, truncate


def test_capitalize_more():
    assert capitalize_words("a b c") == "A B C"
    assert capitalize_words("already Up") == "Already Up"
    assert capitalize_words("x") == "X"


def test_palindrome_more():
    assert is_palindrome("")
    assert is_palindrome("racecar")
    assert is_palindrome("No lemon, no melon")
    assert not is_palindrome("ab")
    assert not is_palindrome("abcdba")


def test_count_vowels_more():
    assert count_vowels("") == 0
    assert count_vowels("rhythm") == 0
    assert count_vowels("AEIOU aeiou") == 10


def test_truncate_more():
    assert truncate("short", 10) == "short"
    assert truncate("exact", 5) == "exact"
    assert truncate("abcdef", 5) == "ab..."
''')

project("rle", '''
def encode(text):
    """Run-length encode: 'aaab' -> [('a', 3), ('b', 1)]."""
    runs = []
    for c in text:
        if runs and runs[-1][0] == c:
            runs[-1] = (c, runs[-1][1] + 1)
        else:
            runs.append((c, 1))
    return runs


def decode(runs):
    return "".join(c * n for c, n in runs)


def to_string(runs):
    return "".join(f"{n}{c}" for c, n in runs)


def longest_run(text):
    best = 0
    for _, n in encode(text):
        if n > best:
            best = n
    return best
''', '''
from rle import encode, decode, to_string, longest_run


def test_encode_simple():
    assert encode("aaab") == [("a", 3), ("b", 1)]


def test_decode_simple():
    assert decode([("x", 2), ("y", 1)]) == "xxy"


def test_to_string_simple():
    assert to_string([("a", 3), ("b", 1)]) == "3a1b"


def test_longest_run_simple():
    assert longest_run("abbbcc") == 3
''', '''
from rle import encode, decode, to_string, longest_run


def test_encode_more():
    assert encode("") == []
    assert encode("abc") == [("a", 1), ("b", 1), ("c", 1)]
    assert encode("zzzzz") == [("z", 5)]
    assert encode("aabba") == [("a", 2), ("b", 2), ("a", 1)]


def test_roundtrip():
    for text in ["", "a", "hello", "mississippi", "aaaaab"]:
        assert decode(encode(text)) == text


def test_to_string_more():
    assert to_string([]) == ""
    assert to_string([("q", 12)]) == "12q"


def test_longest_run_more():
    assert longest_run("") == 0
    assert longest_run("a") == 1
    assert longest_run("aabbbbcdd") == 4
''')

project("wordcount", '''
def tokenize(text):
    """Lower-cased words with surrounding punctuation stripped."""
    words = []
    for raw in text.split():
        word = raw.strip(".,!?;:").lower()
        if word:
            words.append(word)
    return words


def count_words(text):
    counts = {}
    for word in tokenize(text):
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, k):
    counts = count_words(text)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked[:k]]


def unique_ratio(text):
    words = tokenize(text)
    if not words:
        return 0.0
    return len(set(words)) / len(words)
''', '''
from wordcount import tokenize, count_words, top_words, unique_ratio


def test_tokenize_sentence():
    assert tokenize("Hello, world!") == ["hello", "world"]


def test_count_words_repeats():
    assert count_words("a b a") == {"a": 2, "b": 1}


def test_top_words_two():
    assert top_words("b a b c a b", 2) == ["b", "a"]


def test_unique_ratio_half():
    assert unique_ratio("x x y y") == 0.5
''', '''
from wordcount import tokenize, count_words, top_words, unique_ratio


def test_tokenize_more():
    assert tokenize("") == []
    assert tokenize("... !!") == []
    assert tokenize("One. Two; THREE") == ["one", "two", "three"]


def test_count_words_more():
    assert count_words("") == {}
    assert count_words("The the THE cat.") == {"the": 3, "cat": 1}


def test_top_words_more():
    assert top_words("z y x", 2) == ["x", "y"]
    assert top_words("a a b", 5) == ["a", "b"]
    assert top_words("c c c b b a", 1) == ["c"]


def test_unique_ratio_more():
    assert unique_ratio("") == 0.0
    assert unique_ratio("a b c d") == 1.0
    assert unique_ratio("a a a b") == 0.5
''')

project("bsearch", '''
def binary_search(items, target):
    """Index of target in the sorted list, or -1."""
    lo = 0
    hi = len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def lower_bound(items, target):
    lo = 0
    hi = len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def count_in_range(items, low, high):
    return lower_bound(items, high + 1) - lower_bound(items, low)
''', '''
from bsearch import binary_search, lower_bound, count_in_range


def test_binary_search_found():
    assert binary_search([1, 3, 5, 7, 9], 7) == 3


def test_binary_search_missing():
    assert binary_search([1, 3, 5], 4) == -1


def test_lower_bound_middle():
    assert lower_bound([1, 2, 4, 4, 8], 4) == 2


def test_count_in_range_simple():
    assert count_in_range([1, 2, 3, 4, 5, 6], 2, 4) == 3
''', '''
from bsearch import binary_search, lower_bound, count_in_range


def test_binary_search_more():
    items = [2, 4, 6, 8, 10, 12]
    for i, x in enumerate(items):
        assert binary_search(items, x) == i
    assert binary_search([], 1) == -1
    assert binary_search(items, 13) == -1
    assert binary_search(items, 1) == -1


def test_lower_bound_more():
    assert lower_bound([], 5) == 0
    assert lower_bound([1, 2, 3], 0) == 0
    assert lower_bound([1, 2, 3], 9) == 3
    assert lower_bound([1, 1, 1, 2], 1) == 0


def test_count_in_range_more():
    assert count_in_range([], 0, 10) == 0
    assert count_in_range([1, 1, 2, 5, 5, 9], 1, 5) == 5
    assert count_in_range([3, 4], 5, 8) == 0
''')

project("stack", '''
class Stack:
    """Last-in first-out stack on a Python list."""

    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        if len(self.items) == 0:
            return None
        return self.items[-1]

    def size(self):
        return len(self.items)


def reverse_with_stack(values):
    stack = Stack()
    for v in values:
        stack.push(v)
    out = []
    while stack.size() > 0:
        out.append(stack.pop())
    return out
''', '''
from stack import Stack, reverse_with_stack


def test_push_pop_order():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2
    assert s.pop() == 1


def test_peek_top():
    s = Stack()
    s.push("a")
    s.push("b")
    assert s.peek() == "b"
    assert s.size() == 2


def test_reverse_list():
    assert reverse_with_stack([1, 2, 3]) == [3, 2, 1]
''', '''
from stack import Stack, reverse_with_stack


def test_pop_empty_raises():
    s = Stack()
    try:
        s.pop()
    except IndexError:
        return
    assert False, "expected IndexError"


def test_peek_empty():
    assert Stack().peek() is None


def test_size_tracks():
    s = Stack()
    assert s.size() == 0
    for i in range(5):
        s.push(i)
    assert s.size() == 5
    s.pop()
    assert s.size() == 4
    assert s.peek() == 3


def test_reverse_more():
    assert reverse_with_stack([]) == []
    assert reverse_with_stack("abc") == ["c", "b", "a"]
    assert reverse_with_stack([7]) == [7]
''')

project("matrix", '''
def transpose(m):
    """Rows become columns; m is a list of equal-length lists."""
    if not m:
        return []
    return [[m[i][j] for i in range(len(m))] for j in range(len(m[0]))]


def mat_add(a, b):
    return [[a[i][j] + b[i][j] for j in range(len(a[0]))] for i in range(len(a))]


def mat_mul(a, b):
    rows = len(a)
    cols = len(b[0])
    inner = len(b)
    out = [[0] * cols for _ in range(rows)]
    for i in range(rows):
        for j in range(cols):
            for k in range(inner):
                out[i][j] += a[i][k] * b[k][j]
    return out


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]
''', '''
from matrix import transpose, mat_add, mat_mul, identity


def test_transpose_rect():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


def test_mat_add_small():
    assert mat_add([[1, 2], [3, 4]], [[10, 20], [30, 40]]) == [[11, 22], [33, 44]]


def test_mat_mul_small():
    assert mat_mul([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]


def test_identity_two():
    assert identity(2) == [[1, 0], [0, 1]]
''', '''
from matrix import transpose, mat_add, mat_mul, identity


def test_transpose_more():
    assert transpose([]) == []
    assert transpose([[1]]) == [[1]]
    assert transpose([[1], [2], [3]]) == [[1, 2, 3]]


def test_mat_add_more():
    assert mat_add([[0, 0, 1]], [[1, 2, 3]]) == [[1, 2, 4]]
    assert mat_add([[1], [2]], [[-1], [-2]]) == [[0], [0]]


def test_mat_mul_more():
    assert mat_mul([[1, 2, 3]], [[1], [2], [3]]) == [[14]]
    assert mat_mul([[2]], [[3, 4]]) == [[6, 8]]
    m = [[1, 2], [3, 4]]
    assert mat_mul(m, identity(2)) == m


def test_identity_more():
    assert identity(0) == []
    assert identity(1) == [[1]]
    assert identity(3) == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
''')

project("bank", '''
class Account:
    """A bank account that refuses overdrafts."""

    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        return self.balance

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        return self.balance


def transfer(source, target, amount):
    source.withdraw(amount)
    target.deposit(amount)
    return source.balance, target.balance


def total_balance(accounts):
    return sum(a.balance for a in accounts)
''', '''
from bank import Account, transfer, total_balance


def test_deposit_adds():
    a = Account("ann", 10)
    assert a.deposit(5) == 15


def test_withdraw_subtracts():
    a = Account("bob", 20)
    assert a.withdraw(8) == 12


def test_transfer_moves_money():
    a = Account("a", 50)
    b = Account("b", 5)
    assert transfer(a, b, 20) == (30, 25)


def test_total_balance_two():
    assert total_balance([Account("a", 3), Account("b", 4)]) == 7
''', '''
from bank import Account, transfer, total_balance


def raises_value_error(fn, *args):
    try:
        fn(*args)
    except ValueError:
        return True
    return False


def test_deposit_more():
    a = Account("x")
    assert a.deposit(1) == 1
    assert raises_value_error(a.deposit, 0)
    assert raises_value_error(a.deposit, -3)
    assert a.balance == 1


def test_withdraw_more():
    a = Account("y", 10)
    assert a.withdraw(10) == 0
    assert raises_value_error(a.withdraw, 1)
    assert a.balance == 0


def test_transfer_more():
    a = Account("a", 5)
    b = Account("b", 0)
    assert raises_value_error(transfer, a, b, 6)
    assert (a.balance, b.balance) == (5, 0)
    assert transfer(a, b, 5) == (0, 5)


def test_total_balance_more():
    assert total_balance([]) == 0
    assert total_balance([Account("a", 1), Account("b", 2), Account("c", 30)]) == 33
''')

project("pricing", '''
def subtotal(items):
    """items: list of (unit_price, quantity)."""
    total = 0
    for price, qty in items:
        total += price * qty
    return total


def apply_discount(amount, percent):
    if percent < 0 or percent > 100:
        raise ValueError("bad percent")
    return amount - amount * percent / 100


def bulk_discount(quantity):
    if quantity >= 100:
        return 20
    if quantity >= 10:
        return 10
    return 0


def total_with_tax(items, tax_rate):
    quantity = sum(qty for _, qty in items)
    discounted = apply_discount(subtotal(items), bulk_discount(quantity))
    return round(discounted * (1 + tax_rate), 2)
''', '''
from pricing import subtotal, apply_discount, bulk_discount, total_with_tax


def test_subtotal_two_items():
    assert subtotal([(2, 3), (5, 1)]) == 11


def test_apply_discount_quarter():
    assert apply_discount(200, 25) == 150


def test_bulk_discount_tiers():
    assert bulk_discount(5) == 0
    assert bulk_discount(50) == 10


def test_total_with_tax_small_order():
    assert total_with_tax([(10, 2)], 0.5) == 30.0
''', '''
from pricing import subtotal, apply_discount, bulk_discount, total_with_tax


def test_subtotal_more():
    assert subtotal([]) == 0
    assert subtotal([(1.5, 4)]) == 6.0
    assert subtotal([(3, 0), (7, 2)]) == 14


def test_apply_discount_more():
    assert apply_discount(80, 0) == 80
    assert apply_discount(80, 100) == 0
    for bad in (-1, 101):
        try:
            apply_discount(10, bad)
        except ValueError:
            continue
        assert False, "expected ValueError"


def test_bulk_discount_more():
    assert bulk_discount(9) == 0
    assert bulk_discount(10) == 10
    assert bulk_discount(99) == 10
    assert bulk_discount(100) == 20
    assert bulk_discount(500) == 20


def test_total_with_tax_more():
    assert total_with_tax([(1, 10)], 0) == 9.0
    assert total_with_tax([(2, 100)], 0.1) == 176.0
    assert total_with_tax([], 0.2) == 0
''')

project("intervals", '''
def overlaps(a, b):
    """Closed intervals (start, end) overlap if they share a point."""
    return a[0] <= b[1] and b[0] <= a[1]


def merge_intervals(intervals):
    ordered = sorted(intervals)
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))


def contains(intervals, point):
    for start, end in intervals:
        if start <= point <= end:
            return True
    return False
''', '''
from intervals import overlaps, merge_intervals, total_length, contains


def test_overlaps_partial():
    assert overlaps((1, 5), (4, 8))
    assert not overlaps((1, 2), (3, 4))


def test_merge_two_overlapping():
    assert merge_intervals([(5, 8), (1, 6)]) == [(1, 8)]


def test_total_length_disjoint():
    assert total_length([(0, 2), (5, 6)]) == 3


def test_contains_point():
    assert contains([(0, 1), (4, 9)], 5)
''', '''
from intervals import overlaps, merge_intervals, total_length, contains


def test_overlaps_more():
    assert overlaps((1, 3), (3, 5))
    assert overlaps((0, 10), (2, 3))
    assert overlaps((2, 3), (0, 10))
    assert not overlaps((5, 6), (1, 4))


def test_merge_more():
    assert merge_intervals([]) == []
    assert merge_intervals([(1, 2), (3, 4)]) == [(1, 2), (3, 4)]
    assert merge_intervals([(1, 3), (3, 5), (4, 10), (20, 21)]) == [(1, 10), (20, 21)]
    assert merge_intervals([(1, 10), (2, 3)]) == [(1, 10)]


def test_total_length_more():
    assert total_length([]) == 0
    assert total_length([(0, 4), (2, 6)]) == 6
    assert total_length([(1, 1)]) == 0


def test_contains_more():
    assert not contains([], 0)
    assert contains([(2, 4)], 2)
    assert contains([(2, 4)], 4)
    assert not contains([(2, 4), (6, 8)], 5)
''')

project("dates", '''
DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap_year(year):
    """Gregorian rule: every 4th year, except centuries not divisible by 400."""
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0


def days_in_month(year, month):
    if month == 2 and is_leap_year(year):
        return 29
    return DAYS[month - 1]


def day_of_year(year, month, day):
    total = 0
    for m in range(1, month):
        total += days_in_month(year, m)
    return total + day


def days_in_year(year):
    return 366 if is_leap_year(year) else 365
''', '''
from dates import is_leap_year, days_in_month, day_of_year, days_in_year


def test_leap_years():
    assert is_leap_year(2024)
    assert not is_leap_year(1900)


def test_days_in_february():
    assert days_in_month(2023, 2) == 28
    assert days_in_month(2024, 2) == 29


def test_day_of_year_march():
    assert day_of_year(2023, 3, 1) == 60


def test_days_in_year_leap():
    assert days_in_year(2000) == 366
''', '''
from dates import is_leap_year, days_in_month, day_of_year, days_in_year


def test_leap_more():
    assert is_leap_year(2000)
    assert not is_leap_year(2023)
    assert not is_leap_year(2100)
    assert is_leap_year(1996)


def test_days_in_month_more():
    assert days_in_month(2023, 1) == 31
    assert days_in_month(2023, 4) == 30
    assert days_in_month(2023, 12) == 31
    assert days_in_month(1900, 2) == 28


def test_day_of_year_more():
    assert day_of_year(2023, 1, 1) == 1
    assert day_of_year(2024, 3, 1) == 61
    assert day_of_year(2023, 12, 31) == 365
    assert day_of_year(2024, 12, 31) == 366


def test_days_in_year_more():
    assert days_in_year(2023) == 365
    assert days_in_year(1900) == 365
    assert days_in_year(2024) == 366
''')

project("listutil", '''
def chunk(items, size):
    """Split items into consecutive lists of at most size elements."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def flatten(nested):
    out = []
    for part in nested:
        for x in part:
            out.append(x)
    return out


def rotate(items, k):
    if not items:
        return []
    k = k % len(items)
    return items[k:] + items[:k]


def dedupe(items):
    seen = set()
    out = []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
''', '''
from listutil import chunk, flatten, rotate, dedupe


def test_chunk_uneven():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_flatten_two_levels():
    assert flatten([[1, 2], [3]]) == [1, 2, 3]


def test_rotate_left():
    assert rotate([1, 2, 3, 4], 1) == [2, 3, 4, 1]


def test_dedupe_keeps_order():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]
''', '''
from listutil import chunk, flatten, rotate, dedupe


def test_chunk_more():
    assert chunk([], 3) == []
    assert chunk([1, 2, 3], 3) == [[1, 2, 3]]
    assert chunk([1, 2, 3], 1) == [[1], [2], [3]]
    assert chunk([1, 2], 5) == [[1, 2]]


def test_flatten_more():
    assert flatten([]) == []
    assert flatten([[], [1], []]) == [1]
    assert flatten(["ab", "c"]) == ["a", "b", "c"]


def test_rotate_more():
    assert rotate([], 3) == []
    assert rotate([1, 2, 3], 0) == [1, 2, 3]
    assert rotate([1, 2, 3], 3) == [1, 2, 3]
    assert rotate([1, 2, 3], 5) == [3, 1, 2]
    assert rotate([1, 2, 3], -1) == [3, 1, 2]


def test_dedupe_more():
    assert dedupe([]) == []
    assert dedupe([1, 1, 1]) == [1]
    assert dedupe("abca") == ["a", "b", "c"]
''')

project("grades", '''
def letter_grade(score):
    """A >= 90, B >= 80, C >= 70, D >= 60, else F."""
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    if score >= 70:
        return "C"
    if score >= 60:
        return "D"
    return "F"


def average_score(scores):
    if not scores:
        return 0
    return sum(scores) / len(scores)


def pass_rate(scores, threshold=60):
    if not scores:
        return 0.0
    passed = len([s for s in scores if s >= threshold])
    return passed / len(scores)


def best_student(results):
    best_name = None
    best = -1
    for name, score in results:
        if score > best:
            best_name = name
            best = score
    return best_name
''', '''
from grades import letter_grade, average_score, pass_rate, best_student


def test_letter_grade_bands():
    assert letter_grade(95) == "A"
    assert letter_grade(72) == "C"


def test_average_three():
    assert average_score([70, 80, 90]) == 80


def test_pass_rate_half():
    assert pass_rate([50, 70, 40, 90]) == 0.5


def test_best_student_simple():
    assert best_student([("ann", 70), ("bob", 90), ("cy", 80)]) == "bob"
''', '''
from grades import letter_grade, average_score, pass_rate, best_student


def test_letter_grade_edges():
    assert letter_grade(90) == "A"
    assert letter_grade(89) == "B"
    assert letter_grade(80) == "B"
    assert letter_grade(60) == "D"
    assert letter_grade(59) == "F"
    assert letter_grade(0) == "F"


def test_average_more():
    assert average_score([]) == 0
    assert average_score([100]) == 100
    assert average_score([0, 50]) == 25


def test_pass_rate_more():
    assert pass_rate([]) == 0.0
    assert pass_rate([60, 59]) == 0.5
    assert pass_rate([10, 20], threshold=15) == 0.5
    assert pass_rate([100, 100]) == 1.0


def test_best_student_more():
    assert best_student([]) is None
    assert best_student([("a", 0)]) == "a"
    assert best_student([("a", 80), ("b", 80)]) == "a"
''')

project("roman", '''
VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
          (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(n):
    """Roman numeral for 1 <= n <= 3999."""
    out = []
    for value, symbol in VALUES:
        while n >= value:
            out.append(symbol)
            n -= value
    return "".join(out)


def from_roman(text):
    singles = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i in range(len(text)):
        value = singles[text[i]]
        if i + 1 < len(text) and singles[text[i + 1]] > value:
            total -= value
        else:
            total += value
    return total


def is_valid_roman(text):
    if not text:
        return False
    return all(c in "IVXLCDM" for c in text) and to_roman(from_roman(text)) == text
''', '''
from roman import to_roman, from_roman, is_valid_roman


def test_to_roman_basic():
    assert to_roman(14) == "XIV"
    assert to_roman(2024) == "MMXXIV"


def test_from_roman_basic():
    assert from_roman("XIV") == 14
    assert from_roman("MCMXC") == 1990


def test_is_valid_roman_basic():
    assert is_valid_roman("XLII")
    assert not is_valid_roman("IIII")
''', '''
from roman import to_roman, from_roman, is_valid_roman


def test_to_roman_more():
    assert to_roman(1) == "I"
    assert to_roman(4) == "IV"
    assert to_roman(9) == "IX"
    assert to_roman(3999) == "MMMCMXCIX"
    assert to_roman(40) == "XL"


def test_from_roman_more():
    assert from_roman("I") == 1
    assert from_roman("IX") == 9
    assert from_roman("MMMCMXCIX") == 3999
    assert from_roman("CD") == 400


def test_roundtrip():
    for n in [1, 3, 8, 44, 99, 444, 1666, 2888]:
        assert from_roman(to_roman(n)) == n


def test_is_valid_more():
    assert not is_valid_roman("")
    assert not is_valid_roman("ABC")
    assert not is_valid_roman("VX")
    assert is_valid_roman("MMXXIV")
''')

project("caesar", '''
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def shift_char(c, k):
    """Shift a letter by k places, keeping case; other characters pass through."""
    lower = c.lower()
    if lower not in ALPHABET:
        return c
    shifted = ALPHABET[(ALPHABET.index(lower) + k) % 26]
    return shifted.upper() if c.isupper() else shifted


def encrypt(text, k):
    return "".join(shift_char(c, k) for c in text)


def decrypt(text, k):
    return encrypt(text, -k)


def guess_key(cipher, known_word):
    for k in range(26):
        if known_word in decrypt(cipher, k):
            return k
    return -1
''', '''
from caesar import shift_char, encrypt, decrypt, guess_key


def test_shift_char_wraps():
    assert shift_char("z", 1) == "a"


def test_encrypt_word():
    assert encrypt("Hello", 3) == "Khoor"


def test_decrypt_word():
    assert decrypt("Khoor", 3) == "Hello"


def test_guess_key_simple():
    assert guess_key(encrypt("attack at dawn", 7), "dawn") == 7
''', '''
from caesar import shift_char, encrypt, decrypt, guess_key


def test_shift_char_more():
    assert shift_char("a", 0) == "a"
    assert shift_char("A", 2) == "C"
    assert shift_char("!", 5) == "!"
    assert shift_char("b", -3) == "y"
    assert shift_char("Y", 3) == "B"


def test_encrypt_more():
    assert encrypt("", 4) == ""
    assert encrypt("abc xyz", 1) == "bcd yza"
    assert encrypt("Same", 26) == "Same"


def test_decrypt_more():
    for k in range(0, 30, 4):
        assert decrypt(encrypt("Round Trip!", k), k) == "Round Trip!"


def test_guess_key_more():
    assert guess_key("hello", "hello") == 0
    assert guess_key(encrypt("secret plan", 25), "plan") == 25
    assert guess_key("abc", "zzz") == -1
''')

project("temperature", '''
def c_to_f(c):
    """Celsius to Fahrenheit."""
    return c * 9 / 5 + 32


def f_to_c(f):
    return (f - 32) * 5 / 9


def classify(c):
    if c <= 0:
        return "freezing"
    if c < 20:
        return "cold"
    if c < 30:
        return "warm"
    return "hot"


def warmest(readings):
    best = None
    for r in readings:
        if best is None or r > best:
            best = r
    return best
''', '''
from temperature import c_to_f, f_to_c, classify, warmest


def test_c_to_f_boiling():
    assert c_to_f(100) == 212


def test_f_to_c_freezing():
    assert f_to_c(32) == 0


def test_classify_cold_and_hot():
    assert classify(10) == "cold"
    assert classify(35) == "hot"


def test_warmest_simple():
    assert warmest([3, 9, 4]) == 9
''', '''
from temperature import c_to_f, f_to_c, classify, warmest


def test_c_to_f_more():
    assert c_to_f(0) == 32
    assert c_to_f(-40) == -40
    assert c_to_f(37) == 98.60000000000001 or abs(c_to_f(37) - 98.6) < 1e-9


def test_f_to_c_more():
    assert f_to_c(212) == 100
    assert f_to_c(-40) == -40
    assert f_to_c(50) == 10


def test_classify_edges():
    assert classify(0) == "freezing"
    assert classify(-5) == "freezing"
    assert classify(1) == "cold"
    assert classify(20) == "warm"
    assert classify(29) == "warm"
    assert classify(30) == "hot"


def test_warmest_more():
    assert warmest([]) is None
    assert warmest([-5, -2, -9]) == -2
    assert warmest([4]) == 4
''')

project("fifo", '''
class Queue:
    """First-in first-out queue built from two stacks."""

    def __init__(self):
        self.inbox = []
        self.outbox = []

    def enqueue(self, item):
        self.inbox.append(item)

    def dequeue(self):
        if not self.outbox:
            while self.inbox:
                self.outbox.append(self.inbox.pop())
        if not self.outbox:
            raise IndexError("dequeue from empty queue")
        return self.outbox.pop()

    def __len__(self):
        return len(self.inbox) + len(self.outbox)


def round_robin(names, turns):
    q = Queue()
    for name in names:
        q.enqueue(name)
    order = []
    for _ in range(turns):
        name = q.dequeue()
        order.append(name)
        q.enqueue(name)
    return order
''', '''
from fifo import Queue, round_robin


def test_fifo_order():
    q = Queue()
    for x in [1, 2, 3]:
        q.enqueue(x)
    assert [q.dequeue(), q.dequeue(), q.dequeue()] == [1, 2, 3]


def test_len_counts():
    q = Queue()
    q.enqueue("a")
    q.enqueue("b")
    assert len(q) == 2


def test_round_robin_cycles():
    assert round_robin(["a", "b"], 3) == ["a", "b", "a"]
''', '''
from fifo import Queue, round_robin


def test_dequeue_empty_raises():
    try:
        Queue().dequeue()
    except IndexError:
        return
    assert False, "expected IndexError"


def test_interleaved():
    q = Queue()
    q.enqueue(1)
    q.enqueue(2)
    assert q.dequeue() == 1
    q.enqueue(3)
    assert len(q) == 2
    assert q.dequeue() == 2
    assert q.dequeue() == 3
    assert len(q) == 0


def test_round_robin_more():
    assert round_robin(["x"], 2) == ["x", "x"]
    assert round_robin(["a", "b", "c"], 0) == []
    assert round_robin(["a", "b", "c"], 5) == ["a", "b", "c", "a", "b"]
''')

project("mathutil", '''
def gcd(a, b):
    """Greatest common divisor by Euclid's algorithm."""
    while b != 0:
        a, b = b, a % b
    return abs(a)


def is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def digit_sum(n):
    total = 0
    n = abs(n)
    while n > 0:
        total += n % 10
        n //= 10
    return total


def factorial(n):
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
''', '''
from mathutil import gcd, is_prime, digit_sum, factorial


def test_gcd_simple():
    assert gcd(12, 18) == 6


def test_is_prime_small():
    assert is_prime(7)
    assert not is_prime(9)


def test_digit_sum_simple():
    assert digit_sum(1234) == 10


def test_factorial_five():
    assert factorial(5) == 120
''', '''
from mathutil import gcd, is_prime, digit_sum, factorial


def test_gcd_more():
    assert gcd(7, 0) == 7
    assert gcd(0, 5) == 5
    assert gcd(17, 5) == 1
    assert gcd(-4, 6) == 2


def test_is_prime_more():
    assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]
    assert not is_prime(25)
    assert is_prime(97)


def test_digit_sum_more():
    assert digit_sum(0) == 0
    assert digit_sum(9) == 9
    assert digit_sum(-505) == 10


def test_factorial_more():
    assert factorial(0) == 1
    assert factorial(1) == 1
    assert factorial(3) == 6
    assert factorial(10) == 3628800
''')

project("vectors", '''
def add(u, v):
    """Component-wise sum of two equal-length vectors."""
    return [a + b for a, b in zip(u, v)]


def scale(v, k):
    return [k * a for a in v]


def dot(u, v):
    total = 0
    for i in range(len(u)):
        total += u[i] * v[i]
    return total


def norm_squared(v):
    return dot(v, v)


def project_onto(u, v):
    return scale(v, dot(u, v) / norm_squared(v))
''', '''
from vectors import add, scale, dot, norm_squared, project_onto


def test_add_pairs():
    assert add([1, 2], [3, 4]) == [4, 6]


def test_scale_by_three():
    assert scale([1, -2], 3) == [3, -6]


def test_dot_simple():
    assert dot([1, 2, 3], [4, 5, 6]) == 32


def test_project_onto_axis():
    assert project_onto([3, 4], [1, 0]) == [3.0, 0.0]
''', '''
from vectors import add, scale, dot, norm_squared, project_onto


def test_add_more():
    assert add([], []) == []
    assert add([0.5], [0.25]) == [0.75]
    assert add([1, 1, 1], [-1, 0, 1]) == [0, 1, 2]


def test_scale_more():
    assert scale([], 5) == []
    assert scale([2, 4], 0) == [0, 0]
    assert scale([2, 4], 0.5) == [1.0, 2.0]


def test_dot_more():
    assert dot([], []) == 0
    assert dot([1, 0], [0, 1]) == 0
    assert dot([2], [5]) == 10


def test_norm_squared_more():
    assert norm_squared([3, 4]) == 25
    assert norm_squared([0, 0]) == 0


def test_project_more():
    assert project_onto([2, 2], [0, 2]) == [0.0, 2.0]
    assert project_onto([1, 2], [2, 0]) == [1.0, 0.0]
''')

project("inventory", '''
class Inventory:
    """Stock levels per item name."""

    def __init__(self):
        self.stock = {}

    def add(self, item, qty):
        self.stock[item] = self.stock.get(item, 0) + qty

    def remove(self, item, qty):
        have = self.stock.get(item, 0)
        if qty > have:
            raise ValueError("not enough stock")
        if have == qty:
            del self.stock[item]
        else:
            self.stock[item] = have - qty

    def count(self, item):
        return self.stock.get(item, 0)

    def low_stock(self, threshold):
        return sorted(item for item, qty in self.stock.items() if qty < threshold)
''', '''
from inventory import Inventory


def test_add_and_count():
    inv = Inventory()
    inv.add("apple", 3)
    inv.add("apple", 2)
    assert inv.count("apple") == 5


def test_remove_some():
    inv = Inventory()
    inv.add("pear", 5)
    inv.remove("pear", 2)
    assert inv.count("pear") == 3


def test_low_stock_list():
    inv = Inventory()
    inv.add("a", 1)
    inv.add("b", 10)
    inv.add("c", 4)
    assert inv.low_stock(5) == ["a", "c"]
''', '''
from inventory import Inventory


def test_count_missing():
    assert Inventory().count("nothing") == 0


def test_remove_all_deletes():
    inv = Inventory()
    inv.add("x", 2)
    inv.remove("x", 2)
    assert inv.count("x") == 0
    assert "x" not in inv.stock


def test_remove_too_many():
    inv = Inventory()
    inv.add("y", 1)
    try:
        inv.remove("y", 2)
    except ValueError:
        assert inv.count("y") == 1
        return
    assert False, "expected ValueError"


def test_low_stock_more():
    inv = Inventory()
    assert inv.low_stock(3) == []
    inv.add("z", 3)
    inv.add("b", 2)
    assert inv.low_stock(3) == ["b"]
    assert inv.low_stock(4) == ["b", "z"]
''')

project("wrapping", '''
def wrap(text, width):
    """Greedy word wrap: lines no longer than width unless a single word is."""
    lines = []
    current = ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current = current + " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def pad_right(line, width):
    return line + " " * (width - len(line))


def center(line, width):
    left = (width - len(line)) // 2
    return " " * left + line


def box(text, width):
    lines = wrap(text, width)
    border = "+" + "-" * width + "+"
    return [border] + ["|" + pad_right(line, width) + "|" for line in lines] + [border]
''', '''
from wrapping import wrap, pad_right, center, box


def test_wrap_two_lines():
    assert wrap("the quick brown fox", 10) == ["the quick", "brown fox"]


def test_pad_right_fills():
    assert pad_right("ab", 4) == "ab  "


def test_center_odd():
    assert center("ab", 6) == "  ab"


def test_box_small():
    assert box("hi there", 5) == ["+-----+", "|hi   |", "|there|", "+-----+"]
''', '''
from wrapping import wrap, pad_right, center, box


def test_wrap_more():
    assert wrap("", 5) == []
    assert wrap("a b c", 5) == ["a b c"]
    assert wrap("a b c", 3) == ["a b", "c"]
    assert wrap("enormous word", 4) == ["enormous", "word"]


def test_pad_right_more():
    assert pad_right("", 2) == "  "
    assert pad_right("abc", 3) == "abc"


def test_center_more():
    assert center("abc", 3) == "abc"
    assert center("a", 4) == " a"
    assert center("", 2) == " "


def test_box_more():
    assert box("", 2) == ["+--+", "+--+"]
    assert box("one two", 7) == ["+-------+", "|one two|", "+-------+"]
''')

project("geometry", '''
def distance(p, q):
    """Euclidean distance between two (x, y) points."""
    return ((q[0] - p[0]) ** 2 + (q[1] - p[1]) ** 2) ** 0.5


def midpoint(p, q):
    return ((p[0] + q[0]) / 2, (p[1] + q[1]) / 2)


def perimeter(points):
    total = 0
    for i in range(len(points)):
        total += distance(points[i], points[(i + 1) % len(points)])
    return total


def shoelace_area(points):
    twice = 0
    for i in range(len(points)):
        x1, y1 = points[i]
        x2, y2 = points[(i + 1) % len(points)]
        twice += x1 * y2 - x2 * y1
    return abs(twice) / 2
''', '''
from geometry import distance, midpoint, perimeter, shoelace_area


def test_distance_345():
    assert distance((0, 0), (3, 4)) == 5


def test_midpoint_simple():
    assert midpoint((0, 0), (4, 2)) == (2, 1)


def test_perimeter_square():
    assert perimeter([(0, 0), (2, 0), (2, 2), (0, 2)]) == 8


def test_area_square():
    assert shoelace_area([(0, 0), (2, 0), (2, 2), (0, 2)]) == 4
''', '''
from geometry import distance, midpoint, perimeter, shoelace_area


def test_distance_more():
    assert distance((1, 1), (1, 1)) == 0
    assert distance((-1, -1), (2, 3)) == 5
    assert distance((5, 0), (0, 0)) == 5


def test_midpoint_more():
    assert midpoint((1, 1), (1, 1)) == (1, 1)
    assert midpoint((-2, 6), (4, 0)) == (1, 3)


def test_perimeter_more():
    assert perimeter([(0, 0), (3, 0), (3, 4)]) == 12
    assert perimeter([(0, 0), (0, 1)]) == 2


def test_area_more():
    assert shoelace_area([(0, 0), (4, 0), (0, 3)]) == 6
    assert shoelace_area([(0, 2), (2, 2), (2, 0), (0, 0)]) == 4
    assert shoelace_area([(0, 0), (1, 1), (2, 2)]) == 0
''')

project("timefmt", '''
def format_duration(seconds):
    """'h:mm:ss' for a non-negative number of seconds."""
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def parse_clock(text):
    hours, minutes = text.split(":")
    return int(hours) * 60 + int(minutes)


def add_minutes(text, delta):
    total = (parse_clock(text) + delta) % (24 * 60)
    hours, minutes = divmod(total, 60)
    return f"{hours:02d}:{minutes:02d}"


def minutes_between(start, end):
    gap = parse_clock(end) - parse_clock(start)
    if gap < 0:
        gap += 24 * 60
    return gap
''', '''
from timefmt import format_duration, parse_clock, add_minutes, minutes_between


def test_format_duration_mixed():
    assert format_duration(3725) == "1:02:05"


def test_parse_clock_afternoon():
    assert parse_clock("13:30") == 810


def test_add_minutes_simple():
    assert add_minutes("09:45", 30) == "10:15"


def test_minutes_between_same_day():
    assert minutes_between("08:00", "09:30") == 90
''', '''
from timefmt import format_duration, parse_clock, add_minutes, minutes_between


def test_format_duration_more():
    assert format_duration(0) == "0:00:00"
    assert format_duration(59) == "0:00:59"
    assert format_duration(60) == "0:01:00"
    assert format_duration(36000) == "10:00:00"


def test_parse_clock_more():
    assert parse_clock("00:00") == 0
    assert parse_clock("23:59") == 1439
    assert parse_clock("01:05") == 65


def test_add_minutes_more():
    assert add_minutes("23:30", 45) == "00:15"
    assert add_minutes("00:10", -20) == "23:50"
    assert add_minutes("12:00", 0) == "12:00"


def test_minutes_between_more():
    assert minutes_between("22:00", "01:00") == 180
    assert minutes_between("10:00", "10:00") == 0
    assert minutes_between("00:00", "23:59") == 1439
''')

project("ratio", '''
def common_factor(a, b):
    while b:
        a, b = b, a % b
    return abs(a)


def simplify(num, den):
    """Reduce num/den to lowest terms with a positive denominator."""
    if den == 0:
        raise ZeroDivisionError("zero denominator")
    g = common_factor(num, den)
    if den < 0:
        g = -g
    return num // g, den // g


def add_ratio(a, b, c, d):
    return simplify(a * d + c * b, b * d)


def mul_ratio(a, b, c, d):
    return simplify(a * c, b * d)


def as_mixed(num, den):
    whole, rest = divmod(num, den)
    return whole, rest, den
''', '''
from ratio import simplify, add_ratio, mul_ratio, as_mixed


def test_simplify_half():
    assert simplify(4, 8) == (1, 2)


def test_add_ratio_thirds():
    assert add_ratio(1, 3, 1, 6) == (1, 2)


def test_mul_ratio_simple():
    assert mul_ratio(2, 3, 3, 4) == (1, 2)


def test_as_mixed_improper():
    assert as_mixed(7, 2) == (3, 1, 2)
''', '''
from ratio import simplify, add_ratio, mul_ratio, as_mixed


def test_simplify_more():
    assert simplify(0, 5) == (0, 1)
    assert simplify(3, -6) == (-1, 2)
    assert simplify(-10, -4) == (5, 2)
    assert simplify(7, 1) == (7, 1)
    try:
        simplify(1, 0)
    except ZeroDivisionError:
        pass
    else:
        assert False, "expected ZeroDivisionError"


def test_add_ratio_more():
    assert add_ratio(1, 2, 1, 2) == (1, 1)
    assert add_ratio(1, 4, -1, 4) == (0, 1)
    assert add_ratio(2, 3, 1, 5) == (13, 15)


def test_mul_ratio_more():
    assert mul_ratio(0, 1, 5, 7) == (0, 1)
    assert mul_ratio(-2, 5, 5, 4) == (-1, 2)
    assert mul_ratio(3, 1, 1, 3) == (1, 1)


def test_as_mixed_more():
    assert as_mixed(1, 3) == (0, 1, 3)
    assert as_mixed(9, 3) == (3, 0, 3)
    assert as_mixed(11, 4) == (2, 3, 4)
''')
