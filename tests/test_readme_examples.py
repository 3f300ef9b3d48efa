"""The README's examples, run top to bottom after `make demo`, never extend a run by accident (issue 37): every
training command of "Using it" trains in a run directory of its own, none the demo's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from scaletrain.config_loader import load_config

REPO = Path(__file__).resolve().parents[1]
DEMO_RUN_DIR = "runs/gpt_tiny"  # Makefile's demo: scaletrain train configs/gpt_tiny.yaml


def using_it_commands() -> list[list[str]]:
    """The shell commands of the README's "Using it" section (its fenced bash blocks), continuation lines
    joined, comments dropped."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


def training_run_dirs() -> list[tuple[str, str]]:
    """(command, the run directory it trains in) for each `... scaletrain train CONFIG [overrides]`."""
    trained = []
    for command in using_it_commands():
        if "train" not in command or "scaletrain" not in " ".join(command[:command.index("train")]):
            continue
        after = command[command.index("train") + 1:]
        config, overrides = after[0], [item for item in after[1:] if "=" in item and not item.startswith("-")]
        resolved = load_config(REPO / config, overrides)
        trained.append((" ".join(command), resolved.run.dir))
    return trained


def test_the_examples_are_found():
    trained = training_run_dirs()
    assert len(trained) >= 10, trained  # the section's train commands, single- and multi-rank


def test_every_training_example_has_a_run_directory_of_its_own_and_none_is_the_demos():
    trained = training_run_dirs()
    directories = [run_dir for _, run_dir in trained]
    assert DEMO_RUN_DIR not in directories, [command for command, run_dir in trained if run_dir == DEMO_RUN_DIR]
    repeated = {run_dir for run_dir in directories if directories.count(run_dir) > 1}
    assert not repeated, [command for command, run_dir in trained if run_dir in repeated]
