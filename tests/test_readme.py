"""The README stays true: its Python examples run (the rule-writing one also with only the
package installed), and CI runs exactly its test command."""

import os
import re
import shutil
import subprocess
import sys
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


def section(title: str) -> str:
    """The README's ``## title`` section, up to the next one."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.S | re.M)
    assert match, f"README.md has no section {title!r}"
    return match.group(1)


def test_the_rule_writing_example_runs_with_only_the_package_installed(tmp_path):
    """The "Writing a rule" example imports ``rewriter.testing.strategies``, which ``pip install``
    must ship: build the package from a copy of its sources, install it into a new virtual
    environment (its dependencies come from this one's site-packages, which has no copy of
    ``tests/``), and run the example there from a directory outside the repository, in isolated
    mode (no PYTHONPATH, no user site, no script directory on ``sys.path``)."""
    blocks = re.findall(r"```python\n(.*?)```", section("Writing a rule"), flags=re.S)
    assert blocks and any("rewriter.testing.strategies" in block for block in blocks)
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("rewriter", "rules", "codegen"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-build-isolation"]
    done = subprocess.run([*install, "--no-index", "-q", source], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    guard = (
        "import sys, rewriter\n"
        f"assert rewriter.__file__.startswith({str(venv)!r}), rewriter.__file__\n"
        f"assert not any(p.startswith({str(ROOT)!r}) for p in sys.path), sys.path\n"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "example.py").write_text(guard + "\n".join(blocks))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", REWRITER_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([python, "-I", "example.py"], cwd=run, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "{ L j:6 ; 1 }[k]" in done.stdout
