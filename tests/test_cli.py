"""The command line as users type it: --version, --help for every subcommand, overrides anywhere."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from scaletrain import __version__
from scaletrain.cli import _build_parser, _parse_arguments, main
from scaletrain.config import Config
from scaletrain.config_loader import load_config
from scaletrain.families import FAMILIES, get_family
from tests.train.runs import REPO, launcher, scaletrain_environment, scaletrain_torchrun


def _subcommand_parsers(parser: argparse.ArgumentParser, prefix: str = "scaletrain"):
    """(name, parser) of every command and nested subcommand."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _subcommand_parsers(subparser, f"{prefix} {name}")


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"scaletrain {__version__}"


HEAVY_LIBRARIES = ("torch", "deepspeed", "megatron", "scipy", "matplotlib", "sentencepiece", "webdataset")


def test_help_and_the_parser_import_no_heavy_library():
    """`scaletrain --help` and `--version` answer without loading torch & co. (25 s on a busy box)."""
    probe = ("import sys, contextlib, io\n"
             "from scaletrain.cli import _build_parser, main\n"
             "_build_parser()\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['--help'])\n"
             "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=scaletrain_environment(),
                            capture_output=True, text=True, timeout=120, check=True)
    loaded = set(result.stdout.split())
    assert not loaded & set(HEAVY_LIBRARIES), f"imported by the parser: {sorted(loaded & set(HEAVY_LIBRARIES))}"


def test_every_argument_of_every_subcommand_says_what_it_is():
    undocumented = [
        f"{command}: {action.dest}"
        for command, parser in _subcommand_parsers(_build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and not action.help
    ]
    assert not undocumented, f"arguments without --help text: {undocumented}"


def test_overrides_may_come_before_and_after_options_in_order():
    args = _parse_arguments(_build_parser(), ["prepare", "c.yaml", "data.vocab_size=8", "--force", "data.seed=1",
                                              "data.vocab_size=16"])
    assert args.force
    assert args.overrides == ["data.vocab_size=8", "data.seed=1", "data.vocab_size=16"]


def test_an_override_after_options_takes_effect(capsys):
    plan = ["plan", "configs/gpt3_350m.yaml", "--gpus", "8", "--gpu-memory", "80GiB", "--top", "1"]
    assert main([*plan, "train.global_batch_size=64"]) == 0
    assert "global batch: 64 sequences" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["prepare", "c.yaml", "--forse"], ["prepare", "c.yaml", "--force", "stray"],
                                  ["generate", "runs/x", "a.b=1"]])
def test_unknown_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse_arguments(_build_parser(), argv)
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_config_prints_the_resolved_config_that_loads_back_the_same(capsys, tmp_path):
    overrides = ["train.warmup_fraction=0.05", "model.family=llama", "model.num_kv_heads=2",
                 "data.blend=[{dir: data/a, weight: 0.7}, {dir: data/b, weight: 0.3, name: b}]"]
    assert main(["config", "configs/gpt_tiny.yaml", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "# derived: warmup 15 steps, WSD cooldown 0 steps, padded vocabulary 8192" in printed
    (tmp_path / "resolved.yaml").write_text(printed)
    assert load_config(tmp_path / "resolved.yaml") == load_config(REPO / "configs" / "gpt_tiny.yaml", overrides)
    assert main(["config"]) == 2
    assert "give a YAML config (e.g. scaletrain config configs/gpt_tiny.yaml), or --keys" in capsys.readouterr().err


def _leaf_keys() -> dict[str, object]:
    """Every key of the schema with its default, from the dataclasses: the default (GPT) config's,
    each family's model and objective keys, and a blend entry's."""
    keys = dict(_flatten(Config().to_dict()))
    for family in FAMILIES:
        section = get_family(family).config_class
        keys.update(_flatten(dataclasses.asdict(section()), "model."))
        keys.update(_flatten(dataclasses.asdict(section.objective_section()), "objective."))
    keys.update({"data.blend[].dir": None, "data.blend[].weight": None, "data.blend[].name": None})
    return keys


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_config_keys_lists_every_key_with_its_type_default_and_meaning(capsys):
    assert main(["config", "--keys"]) == 0
    lines = {line.split(":", 1)[0]: line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    keys = _leaf_keys()
    assert set(lines) == set(keys)
    for key, default in keys.items():
        if key.startswith("data.blend[]") and key != "data.blend[].name":
            assert " = " not in lines[key].split("  #")[0], f"{key} has no default: {lines[key]}"
        else:
            assert f" = {json.dumps(default)}" in lines[key], lines[key]
    assert lines["train.warmup_fraction"].startswith("train.warmup_fraction: float | None in [0, 1) = null  # the "
                                                     "warmup as a fraction of train.steps")
    assert lines["model.num_kv_heads"].startswith("model.num_kv_heads: int | None = null  # (llama) ")
    assert lines["model.layernorm_eps"] == "model.layernorm_eps: float > 0 = 1e-05"
    assert lines["objective.noise_density"].startswith("objective.noise_density: float in (0, 1) = 0.15  # (t5) ")
    assert lines["data.blend[].weight"].startswith("data.blend[].weight: float > 0  # relative")


def test_a_warmup_cut_for_a_shortened_run_is_one_warning_line():
    result = subprocess.run([*launcher(1), "config", "configs/gpt_tiny.yaml", "train.steps=20"], cwd=REPO,
                            env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "warning: train.warmup_steps=30 does not fit train.steps=20: warming up over 19 steps instead; set "
        "train.warmup_steps or train.warmup_fraction (e.g. 0.1) to choose"]
    assert "  warmup_steps: 30\n" in result.stdout and "# derived: warmup 19 steps" in result.stdout


def test_an_error_under_torchrun_is_printed_once():
    result = subprocess.run(
        [*launcher(2), "train", "configs/gpt_tiny.yaml", "parallel.tensor=3"], cwd=REPO,
        env=scaletrain_environment(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "parallel.tensor=3" in errors[0]


def test_scaletrain_torchrun_says_a_user_error_in_one_line_and_exits_2():
    """Plain torchrun adds its agent's lines and a failure report with its own traceback; the launcher does not."""
    result = subprocess.run(
        [*scaletrain_torchrun(2), "train", "configs/gpt_tiny.yaml", "train.lrr=20"], cwd=REPO,
        env=scaletrain_environment(), capture_output=True, text=True, timeout=300,
    )
    output = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    line = "scaletrain train: error: override train.lrr=20: unknown key train.lrr (did you mean train.lr?)"
    assert output == [line], output


@pytest.mark.parametrize("rank_0_failure", ["left the line", "stopped before it"])
def test_scaletrain_torchrun_prints_the_line_when_rank_0_could_not(rank_0_failure, tmp_path, monkeypatch):
    """The agent stops the other ranks as soon as one exits: rank 0 may go before it has printed."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from scaletrain.cli import _leave_for_launcher
    from scaletrain.torchrun import _user_error_line

    line = "scaletrain train: error: override train.lrr=20: unknown key train.lrr (did you mean train.lr?)"
    for rank in ([0, 1] if rank_0_failure == "left the line" else [1]):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"{rank}.json"))
        _leave_for_launcher(line)
    failures = {0: ProcessFailure(0, 100, -15, str(tmp_path / "0.json")),
                1: ProcessFailure(1, 101, 2, str(tmp_path / "1.json"))}
    assert _user_error_line(failures) == ("" if rank_0_failure == "left the line" else line)
    failures[0] = ProcessFailure(0, 100, 1, str(tmp_path / "none.json"))  # a crash is not a user error
    assert _user_error_line(failures) is None


def test_prepare_reports_its_stages_and_progress_as_plain_lines_in_a_log(small_dataset_raw, tmp_path):
    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    for path in small_dataset_raw:
        (raw_dir / path.name).write_bytes(path.read_bytes())
    result = subprocess.run(
        [*launcher(1), "prepare", "configs/gpt_tiny.yaml", f"data.raw=[{raw_dir}]", f"data.dir={tmp_path / 'data'}",
         "data.vocab_size=1024", "data.num_sentinels=16", "data.val_fraction=0.3"],
        cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert "prepare: training a 1,024-token sentencepiece model on 6 files" in lines
    progress = [line for line in lines if line.startswith("prepare: tokenized ")]
    assert "\r" not in result.stderr and 1 <= len(progress) <= 10, lines
    assert progress[-1].startswith(f"prepare: tokenized {len(small_dataset_raw)}/{len(small_dataset_raw)} documents")
    assert result.stdout.startswith(f"prepared {tmp_path / 'data'}")


def test_prepare_into_a_url_uploads_a_dataset_that_reads_like_a_local_one(small_dataset_raw, tmp_path):
    from scaletrain.data.dataset import PackedSequenceDataset
    from scaletrain.data.storage import ShardCacheSettings

    works = [path for path in small_dataset_raw if path.name.startswith(("phoenix", "sonnets", "tempest"))]
    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    for path in works:
        (raw_dir / path.name).write_bytes(path.read_bytes())
    common = ["configs/gpt_tiny.yaml", f"data.raw=[{raw_dir}]", "data.vocab_size=1024", "data.num_sentinels=16",
              "data.val_fraction=0.3", f"data.cache_dir={tmp_path / 'cache'}"]
    remote_url = f"file://{tmp_path / 'bucket' / 'ds'}"
    for target in (str(tmp_path / "local"), remote_url):
        result = subprocess.run([*launcher(1), "prepare", *common, f"data.dir={target}"], cwd=REPO,
                                env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith(f"prepared {target}")
    assert not any((tmp_path / "cache" / "prepare").iterdir()), "the staging copy was left behind"
    cache = ShardCacheSettings(tmp_path / "reader_cache")
    local = PackedSequenceDataset(tmp_path / "local", "train", 64)
    remote = PackedSequenceDataset(remote_url, "train", 64, cache=cache)
    assert remote.num_samples == local.num_samples
    for index in range(0, local.num_samples, 7):
        np.testing.assert_array_equal(remote.sample(index), local.sample(index))

    refused = subprocess.run([*launcher(1), "prepare", *common, "data.dir=https://example.com/ds"], cwd=REPO,
                             env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert "cannot write a dataset to https://example.com/ds" in refused.stderr
    assert "prepare: training" not in refused.stderr  # refused before any work
