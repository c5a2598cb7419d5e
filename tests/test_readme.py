"""The README stays short, opens with the two set-up commands, and its Python runs as pasted.

Every ```python block of README.md is executed as a user would paste it: alone,
in a fresh interpreter, in an empty temporary directory. A ``print(...)`` line
whose comment starts with a value (``print(x)  # 62: ...``) states what the
block prints; the printed lines must match those values in order.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SETUP = ['pip install torch==2.13.0 -e . && kvkit simulate',
         'pip install torch==2.13.0 -e ".[test]" && pytest -n auto']
MAX_LINES = 250

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_STATED = re.compile(r"^print\(.*\)\s+#\s*([^\s:;,]+)", re.M)
BLOCKS = _BLOCK.findall(README)


def test_readme_is_at_most_250_lines():
    """The README is an entry point; the guides under docs/ hold the rest."""
    lines = README.count("\n") + (not README.endswith("\n"))
    assert lines <= MAX_LINES, f"README.md has {lines} lines, more than {MAX_LINES}"


def test_readme_opens_with_exactly_the_two_setup_commands():
    """Right under the title, before any prose: one bash block holding the two commands, nothing else."""
    match = re.match(r"# kvkit\n\s*```bash\n(.*?)```", README, re.S)
    assert match is not None, "README.md must open with '# kvkit' and then a ```bash block"
    assert match.group(1).strip().splitlines() == SETUP


def test_ci_runs_the_readme_test_command():
    """.ci/run calls the README's test command verbatim."""
    ci = (ROOT / ".ci/run").read_text()
    assert SETUP[1] + " " in ci


def test_readme_has_python_to_run():
    """There is at least the compose example (else the test below would check nothing)."""
    assert BLOCKS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_python_block_runs_as_pasted(code, tmp_path):
    """The block runs alone in a fresh interpreter in an empty directory, and prints what it states."""
    script = tmp_path / "block.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=110)
    assert run.returncode == 0, (f"README block failed (exit {run.returncode}):\n{code}\n"
                                 f"--- stdout ---\n{run.stdout}--- stderr ---\n{run.stderr}")
    stated = _STATED.findall(code)
    if stated:
        printed = [line.strip() for line in run.stdout.splitlines() if line.strip()]
        assert printed == stated, f"README block printed {printed}, its comments state {stated}:\n{code}"
