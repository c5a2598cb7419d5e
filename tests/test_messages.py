"""Messages count in plain English: ``1 block``, ``2 blocks``, never ``1 blocks``.

Counts go through ``kvkit.validate.plural``.
"""

import ast
import os
import re
from pathlib import Path

from kvkit.validate import plural

ROOT = Path(__file__).resolve().parents[1]
_ROOMS = ("kvkit", "backends", "interfaces")
_NOUNS = ("blocks|tokens|requests|layers|ids|keys|copies|instances|workers|values|references|refs|hashes|events|"
          "stages|tensors|transfers|groups|entries|steps|replays|regions|plans|devices|problems|pieces|files|"
          "nodes|heads|ranks|errors|elements|rows|slots|chunks|threads|lines|fields|names|results|tickets|puts|"
          "fetches|evictions|calls|buffers|buffer lists|policies|capacities|directions|turns|conversations|parents|"
          "mirrors|tiers")
# A number, then up to two words, then a plural noun (a rate such as "tokens/s" is not a count of tokens).
_COUNTED = re.compile(rf"^ (?:[\w-]+ ){{0,2}}?(?:{_NOUNS})\b(?!/)")
# Interpolations before such words that are not counts, or never 1 by construction.
_NOT_A_COUNT = {
    "g", "op", "plan", "tier", "('GPU', 'CPU')[tier]",  # names: "group 2 needs GPU blocks", "put failed keys"
    "report['ids']",  # "random" or "consecutive" ids
    "capacities",  # a list of block counts: "at 1,000, 4,000 blocks"
    "v.num_confirmed_blocks",  # "3 confirmed of hashes [...]"
    "len(self.problems)", "len(exc.problems)",  # a ConfigError of one problem is that problem alone
}


def _bare_counts(source: str) -> list[str]:
    """``{n} blocks`` in the f-strings of ``source``, where ``n`` is neither a constant nor a :func:`plural`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.JoinedStr):
            continue
        for value, text in zip(node.values, node.values[1:]):
            if not (isinstance(value, ast.FormattedValue) and isinstance(text, ast.Constant)
                    and _COUNTED.match(text.value)):
                continue
            expr = ast.unparse(value.value)
            constant = re.match(r"[A-Z][A-Z0-9_]*\b", expr) is not None  # MAX_LAYERS, DEFAULTS.block_size
            if not constant and not expr.startswith("plural(") and expr not in _NOT_A_COUNT:
                found.append(f"line {node.lineno}: {{{expr}}}{text.value[:30]}")
    return found


def test_plural_says_one_block_and_two_blocks():
    assert plural(1, "block") == "1 block"
    assert plural(0, "block") == "0 blocks" and plural(2, "GPU block") == "2 GPU blocks"
    assert plural(1, "copy", "copies") == "1 copy" and plural(3, "copy", "copies") == "3 copies"
    assert plural(262144, "block", grouped=True) == "262,144 blocks"


def test_no_message_puts_a_plural_noun_after_a_bare_number():
    """Every count in a message goes through ``plural``, so a count of 1 reads ``1 block``."""
    bad = {}
    for room in _ROOMS:
        for folder, _, files in os.walk(ROOT / room):  # the kvkit/backends links are not followed
            for name in files:
                if name.endswith(".py"):
                    path = Path(folder) / name
                    if found := _bare_counts(path.read_text(encoding="utf-8")):
                        bad[str(path.relative_to(ROOT))] = found
    assert not bad, bad


def test_the_check_finds_a_planted_bare_count():
    planted = 'def f(n, need):\n    raise ValueError(f"needs {n} blocks of {need} tokens, got {n} GPU blocks")\n'
    assert len(_bare_counts(planted)) == 3
    assert not _bare_counts('x = f"{plural(n, \'block\')} of {MAX_TOKENS} tokens at {rate} tokens/s"\n')
