"""The README's set-up block and its Python example stay true."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_opens_with_exactly_two_setup_commands():
    """The first code block holds the install-and-run command and the test command, nothing else."""
    first = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert first == ['pip install torch==2.13.0 -e . && kvkit simulate',
                     'pip install torch==2.13.0 -e ".[test]" && pytest -n auto']


def test_ci_runs_the_readme_test_command():
    """.ci/run calls the README's test command verbatim."""
    ci = (Path(__file__).resolve().parents[1] / ".ci/run").read_text()
    assert 'pip install torch==2.13.0 -e ".[test]" && pytest -n auto ' in ci


def test_compose_example_runs_and_stores_the_finished_prompt(capsys):
    """The 'Compose a stack' example builds a stack, runs a request and stores its 62 full blocks."""
    code = re.search(r"```python\n(import kvkit\n.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "'blocks_stored': 62" in capsys.readouterr().out
