"""The README stays true: its Python examples run, and CI runs exactly its test command."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_example_runs(index):
    exec(compile(python_blocks()[index], f"README.md python block {index}", "exec"), {})


def test_ci_runs_exactly_the_readme_test_command():
    marked = re.search(r"<!-- ci:test -->\n```sh\n(.*?)\n```\n<!-- /ci:test -->", README, flags=re.S)
    assert marked, "README.md must mark its test command with <!-- ci:test --> ... <!-- /ci:test -->"
    script = (ROOT / ".ci" / "run").read_text()
    extract = re.search(r"^cmd=\$\((.*)\)$", script, flags=re.M).group(1)
    extracted = subprocess.run(
        ["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert extracted == marked.group(1).strip()
    assert 'eval "$cmd"' in script
