"""Config loading: YAML + base includes + dotted overrides, and one clear error per invalid case."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest

from scaletrain.config import ConfigError, ConfigWarning, TrainConfig, save_config
from scaletrain.config_loader import load_config
from scaletrain.config_schema import schema_keys
from scaletrain.families import MODEL_SECTIONS
from scaletrain.parallel.layout import Layout, resolve_for_world
from scaletrain.train.schedule import learning_rate

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "gpt_tiny.yaml"


def test_demo_config_loads_with_overrides():
    config = load_config(TINY, ["train.lr=3e-4", "parallel.tensor=2", "tracking.wandb=disabled"])
    assert config.train.lr == 3e-4
    assert config.parallel.tensor == 2
    assert config.tracking.wandb == "disabled"
    assert config.padded_vocab_size % 128 == 0 and config.padded_vocab_size >= config.data.vocab_size


@pytest.mark.parametrize("name", ["125m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "175b"])
def test_gpt3_size_configs_load(name):
    config = load_config(REPO / "configs" / f"gpt3_{name}.yaml")
    assert config.model.seq_length == 2048
    assert config.model.hidden_size % config.model.num_heads == 0


def test_gpt3_175b_shape_and_batch():
    config = load_config(REPO / "configs" / "gpt3_175b.yaml")
    assert (config.model.num_layers, config.model.hidden_size, config.model.num_heads) == (96, 12288, 96)
    resolved = resolve_for_world(load_config(REPO / "configs" / "gpt3_175b.yaml", ["parallel.tensor=8"]), 1024)
    assert resolved.parallel.data == 128
    assert Layout.of(resolved).global_batch == 1536


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["parallel.tensor=3"], "parallel.tensor=3 does not divide model.num_heads=4"),
        (["model.num_heads=3"], "model.hidden_size=256 is not divisible by model.num_heads=3"),
        (["parallel.zero_stage=4"], "parallel.zero_stage=4"),
        (["parallel.pipeline=2", "parallel.zero_stage=2"], "DeepSpeed pipelines support ZeRO-0/1 only"),
        (["train.lr=-1"], "train.lr=-1.0"),
        (["train.steps=0"], "train.steps=0 must be >= 1"),
        (["train.warmup_steps=-1"], "train.warmup_steps=-1 must be >= 0"),
        (["train.warmup_fraction=1.0"], "train.warmup_fraction=1.0 must be in [0, 1)"),
        (["train.micro_batch_size=two"], "train.micro_batch_size must be int, got 'two'"),
        (["train.global_batch_size=64", "train.grad_accum=2"], "set one"),
        (["tracking.wandb=cloud"], "tracking.wandb='cloud'"),
        (["train.precision=fp16"], "train.precision='fp16'"),
        (["model.family=rnn"], "model.family='rnn' is not supported"),
        (["train.typo=1"], "unknown key train.typo"),
        (["trainlr=1"], "must look like section.key=value"),
        (["data.vocab_size=100"], "data.vocab_size=100 leaves too few learned pieces"),
        (["train.max_skipped_steps=0"], "train.max_skipped_steps=0 must be >= 1"),
        (["train.inject_nonfinite_loss_at=[3, 0]"], "train.inject_nonfinite_loss_at=[3, 0] must list steps >= 1"),
        (["train.lr=.inf"], "train.lr=inf must be a finite number > 0"),
        (["model.num_kv_heads=2"], "unknown key model.num_kv_heads"),  # a llama key in a gpt section
        (["model.family=llama", "model.num_kv_heads=3"], "model.num_kv_heads=3 must divide model.num_heads=4"),
        (["model.family=llama", "model.num_heads=12", "model.head_dim=16", "model.num_kv_heads=3", "parallel.tensor=4"],
         "parallel.tensor=4 and model.num_kv_heads=3: one must divide the other"),
        (["parallel.sequence_parallel=true"], "set parallel.tensor >= 2"),
        (["parallel.sequence_parallel=true", "parallel.tensor=2", "model.dropout=0.1"], "set model.dropout=0"),
        (["model.family=bert", "objective.kind=mlm", "parallel.sequence_parallel=true", "parallel.tensor=2"],
         "not available for bert yet (it is for gpt, llama)"),
        (["parallel.context=3"], "parallel.context=3 needs model.seq_length=128 to split into 2 x 3 equal chunks"),
        (["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"],
         "parallel.sequence_parallel with parallel.context > 1 is not implemented"),
        (["parallel.context=2", "parallel.pipeline=2"], "not implemented for DeepSpeed's pipeline engine"),
        (["model.family=bert", "objective.kind=mlm", "parallel.context=2"],
         "context parallelism is not available for bert (it is for gpt, llama)"),
        (["parallel.context=2", "model.moe.num_experts=4"], "parallel.context=2 with model.moe"),
        (["train.compile=fast"], "train.compile must be bool, got 'fast'"),
        (["train.compile=true", "parallel.zero_stage=3"],
         "train.compile=true with parallel.zero_stage=3: ZeRO-3 gathers every layer's weights in hooks torch.compile "
         "cannot trace"),
    ],
)
def test_invalid_values_fail_at_load_with_the_key_named(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, overrides)
    assert fragment in str(error.value)


@pytest.mark.parametrize(("override", "message"), [
    ("train.weight_decay=.nan", "train.weight_decay=nan must be a finite number >= 0 (AdamW: 0.1 is usual, 0 for "
                                "none)"),
    ("train.weight_decay=.inf", "train.weight_decay=inf must be a finite number >= 0"),
    ("train.weight_decay=-1", "train.weight_decay=-1.0 must be >= 0"),
    ("train.beta1=.nan", "train.beta1=nan must be a finite number in [0, 1)"),
    ("train.beta2=2", "train.beta2=2.0 must be in [0, 1) (AdamW's second-moment decay; 0.95 or 0.999 are usual)"),
    ("train.beta2=-1", "train.beta2=-1.0 must be in [0, 1)"),
    ("train.grad_clip=.nan", "train.grad_clip=nan must be a finite number >= 0 (0 disables clipping)"),
    ("train.grad_clip=.inf", "train.grad_clip=inf must be a finite number >= 0"),
    ("parallel.timeout_s=.inf", "parallel.timeout_s=inf must be a finite number > 0"),
    ("train.min_lr=.nan", "train.min_lr=nan must be a finite number >= 0"),
    ("train.min_lr=1", "train.min_lr=1.0 must be <= train.lr=0.002"),
    ("train.warmup_fraction=-.inf", "train.warmup_fraction=-inf must be a finite number in [0, 1)"),
    ("model.dropout=1", "model.dropout=1.0 must be in [0, 1)"),
    ("model.layernorm_eps=0", "model.layernorm_eps=0.0 must be > 0"),
    ("model.vocab_divisible_by=0", "model.vocab_divisible_by=0 must be >= 1"),
    (("model.family=bert", "objective.kind=mlm", "objective.mask_prob=0"), "objective.mask_prob=0.0 must be in (0, 1)"),
    ("data.download_backoff_s=601", "data.download_backoff_s=601.0 must be in [0, 600]"),
    ("tracking.peak_tflops=.inf", "tracking.peak_tflops=inf must be a finite number > 0"),
    ("parallel.zero_stage=4", "parallel.zero_stage=4 must be in [0, 3]"),
])
def test_numeric_keys_out_of_their_declared_range_are_refused_with_it(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [override] if isinstance(override, str) else list(override))
    assert str(error.value).startswith(message), str(error.value)


def test_every_float_key_of_every_section_and_family_is_refused_when_not_finite():
    """Declared or not, a float key that is NaN is refused before anything is built, naming it: the
    rule is config.py's walk over the typed sections, not a list of keys."""
    float_keys = [key for key in schema_keys(MODEL_SECTIONS) if "float" in key.type]
    assert len(float_keys) > 30
    for key in float_keys:
        family = key.meaning[1:].split(")")[0].split(", ")[0] if key.meaning.startswith("(") else "gpt"
        if key.key == "data.blend[].weight":
            override, named = "data.blend=[{dir: data/a, weight: .nan}]", "data.blend[0].weight"
        else:
            override, named = f"{key.key}=.nan", key.key
        with pytest.raises(ConfigError) as error:
            load_config(TINY, [f"model.family={family}", override])
        assert str(error.value).startswith(f"{named}=nan must be a finite number"), (key.key, str(error.value))


BILLION_LAUGHS = "".join(  # 396 bytes; 9^9 = 387 million strings once its aliases are expanded
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9) if previous else ', '.join(['lol'] * 9)}]\n"
    for previous, name in zip([None, *"abcdefgh"], "abcdefghi", strict=True))


def test_a_yaml_alias_bomb_is_refused_at_once_naming_the_file(tmp_path):
    """The aliases are counted as expanded without expanding them, so the refusal costs what parsing does."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"base: {TINY}\n{BILLION_LAUGHS}")
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        load_config(bomb)
    assert time.perf_counter() - started < 1.0
    assert str(error.value).startswith(f"config file {bomb}: its YAML aliases (*name) expand to more than 100,000 "
                                       "values"), str(error.value)
    looped = tmp_path / "looped.yaml"
    looped.write_text("train: &train\n  nested: *train\n")
    with pytest.raises(ConfigError, match="a YAML alias \\(\\*name\\) refers to a value that holds it"):
        load_config(looped)
    flow_bomb = BILLION_LAUGHS.replace("\n", ", ").rstrip(", ")
    with pytest.raises(ConfigError, match=r"^override 'train.stop_signals=\{a: "):
        load_config(TINY, [f"train.stop_signals={{{flow_bomb}}}"])


def test_yaml_aliases_of_ordinary_size_still_load(tmp_path):
    shared = tmp_path / "shared.yaml"
    shared.write_text(f"base: {TINY}\ntrain:\n  lr: &peak 0.001\n  min_lr: *peak\n")
    config = load_config(shared)
    assert config.train.lr == config.train.min_lr == 0.001


def test_compile_is_off_by_default_and_loads_with_every_zero_stage_but_3():
    assert load_config(TINY, []).train.compile is False
    for stage in (0, 1, 2):
        assert load_config(TINY, ["train.compile=true", f"parallel.zero_stage={stage}"]).train.compile is True
    with pytest.raises(ConfigError, match="use parallel.zero_stage=1 or 2 with train.compile=true, or "
                                          "train.compile=false with ZeRO-3"):
        load_config(TINY, ["train.compile=true", "parallel.zero_stage=3"])


@pytest.mark.parametrize(
    "overrides, world_size, fragment",
    [
        (["parallel.tensor=2"], 3, "parallel.tensor x parallel.context x parallel.pipeline = 2 x 1 x 1"),
        (["parallel.context=2"], 3, "parallel.tensor x parallel.context x parallel.pipeline = 1 x 2 x 1"),
        (["parallel.tensor=2", "parallel.data=2"], 2, "world size 2 != parallel.tensor x parallel.context x"),
        (["parallel.context=2", "parallel.data=2"], 2, "launch 4 processes or set parallel.data=1"),
        (["train.global_batch_size=10", "train.micro_batch_size=4"], 1, "train.global_batch_size=10 is not divisible"),
    ],
)
def test_world_size_mismatches_fail_with_the_fix(overrides, world_size, fragment):
    with pytest.raises(ConfigError) as error:
        resolve_for_world(load_config(TINY, overrides), world_size)
    assert fragment in str(error.value)


def test_global_batch_size_derives_grad_accum():
    config = load_config(TINY, ["train.global_batch_size=64", "train.micro_batch_size=8"])
    assert resolve_for_world(config, 2).train.grad_accum == 4
    assert resolve_for_world(config, 4).train.grad_accum == 2


def test_base_include_and_missing_file(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {TINY}\ntrain:\n  lr: 0.001\n")
    config = load_config(child)
    assert config.train.lr == 0.001 and config.model.num_layers == 4
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "name, params", [("llama2_7b", 6_738_415_616), ("llama2_13b", 13_015_864_320), ("llama2_70b", 68_976_648_192),
                     ("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496)],
)
def test_llama_configs_load_with_their_published_sizes(name, params):
    """The family's own counts from the config files (Touvron et al. 2023; Meta's Llama 3 model cards)."""
    from scaletrain.families import model_counts

    assert model_counts(load_config(REPO / "configs" / f"{name}.yaml")).total_params == params


@pytest.mark.parametrize(("world_size", "overrides", "stage"), [
    (1, ["parallel.zero_stage=1"], 0),  # one data-parallel rank: nothing to partition
    (1, ["parallel.zero_stage=2"], 0),
    (1, ["parallel.zero_stage=3"], 3),  # asked for explicitly, kept (it changes how weights are held)
    (2, ["parallel.zero_stage=1"], 1),
    (2, ["parallel.zero_stage=2", "parallel.tensor=2"], 0),
    (2, ["parallel.zero_stage=1", "parallel.pipeline=2"], 1),  # pipelined ZeRO-0 checkpoints do not reshard
])
def test_zero_stages_that_partition_nothing_run_as_stage_0(world_size, overrides, stage):
    config = resolve_for_world(load_config(REPO / "configs" / "gpt_tiny.yaml", overrides), world_size)
    assert config.parallel.zero_stage == stage


def test_warmup_fraction_resolves_to_steps_of_the_run():
    """gpt_tiny.yaml sets warmup_steps: 30; the fraction given as an override replaces it."""
    config = load_config(TINY, ["train.warmup_fraction=0.05"])
    assert (config.train.warmup_steps, config.train.resolved_warmup_steps) == (0, 15)  # 0.05 x 300
    longer = load_config(TINY, ["train.warmup_fraction=0.05", "train.steps=1000"]).train
    assert longer.resolved_warmup_steps == 50
    assert learning_rate(0, longer) == pytest.approx(longer.lr / 50)
    assert learning_rate(49, longer) == pytest.approx(longer.lr)
    back_to_steps = load_config(TINY, ["train.warmup_fraction=0.05", "train.warmup_steps=7"]).train
    assert (back_to_steps.warmup_fraction, back_to_steps.resolved_warmup_steps) == (None, 7)


def test_a_file_sets_one_warmup_key_over_its_base_and_not_both(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {TINY}\ntrain:\n  warmup_fraction: 0.1\n")
    assert load_config(child).train.resolved_warmup_steps == 30
    both = tmp_path / "both.yaml"
    both.write_text(f"base: {TINY}\ntrain:\n  warmup_steps: 10\n  warmup_fraction: 0.1\n")
    with pytest.raises(ConfigError, match="train.warmup_steps=10 and train.warmup_fraction=0.1 are both set; set one"):
        load_config(both)


@pytest.mark.parametrize(("overrides", "warmup", "fragment"), [
    (["train.steps=20"], 19, "train.warmup_steps=30 does not fit train.steps=20: warming up over 19 steps"),
    (["train.steps=20", "train.lr_schedule=wsd"], 16,
     "train.warmup_steps=30 does not fit train.steps=20 with the WSD cooldown of 4 steps: warming up over 16 steps"),
    (["train.steps=10", "train.warmup_fraction=0.98"], 9, "train.warmup_fraction=0.98 (10 steps) does not fit"),
])
def test_a_warmup_too_long_for_a_shortened_run_is_cut_with_one_warning(overrides, warmup, fragment):
    with pytest.warns(ConfigWarning) as caught:
        train = load_config(TINY, overrides).train
    assert [str(warning.message) for warning in caught if fragment in str(warning.message)], fragment
    assert len(caught) == 1
    assert train.resolved_warmup_steps == warmup
    assert learning_rate(warmup - 1, train) == pytest.approx(train.lr), "the warmup ends at the peak"


def test_a_warmup_that_fits_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert load_config(TINY, ["train.steps=31"]).train.resolved_warmup_steps == 30


def test_a_saved_run_config_read_to_use_its_checkpoints_does_not_warn_again(tmp_path):
    """generate, export and eval read the run's config.yaml (to_train=False): the cut was the training
    command's to report, and the warmup resolves the same."""
    saved = tmp_path / "config.yaml"
    with pytest.warns(ConfigWarning):
        save_config(load_config(TINY, ["train.steps=20"]), saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert load_config(saved, to_train=False).train.resolved_warmup_steps == 19


def test_a_cooldown_branch_keeps_its_warmup_and_is_refused_instead_of_cut():
    """A branch continues its stable run's schedule; a cut warmup would not be that run's."""
    overrides = ["train.steps=100", "train.lr_schedule=wsd", "train.warmup_steps=90",
                 "train.branch_from=runs/stable/checkpoints/step_00000080"]
    with pytest.raises(ConfigError, match="train.warmup_steps=90 plus the cooldown of 20 steps"):
        load_config(TINY, overrides)


def test_the_schedule_follows_a_changed_run_length():
    """Resuming with another train.steps: the warmup of a fraction is the new length's."""
    short, long = TrainConfig(steps=100, warmup_fraction=0.1), TrainConfig(steps=200, warmup_fraction=0.1)
    assert learning_rate(15, short) < short.lr  # cosine decay has begun after 10 warmup steps
    assert learning_rate(15, long) == pytest.approx(long.lr * 16 / 20)  # still warming up over 20


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.lrr=1"], "override train.lrr=1: unknown key train.lrr (did you mean train.lr?)"),
    (["train.lr=1e-3", "model.hidden_sise=64"],
     "override model.hidden_sise=64: unknown key model.hidden_sise (did you mean model.hidden_size?)"),
    (["train.micro_batch_size=two"],
     "override train.micro_batch_size=two: train.micro_batch_size must be int, got 'two'"),
    (["model.num_kv_heads=2"], "override model.num_kv_heads=2: unknown key model.num_kv_heads (model.family=llama has "
                               "it, this config's family does not)"),
    (["model.family=rnn"], "override model.family=rnn: model.family='rnn' is not supported"),
    (["train.zero_stage=1"], "override train.zero_stage=1: unknown key train.zero_stage (it belongs under parallel: "
                             "write parallel.zero_stage)"),
])
def test_an_override_error_names_the_override(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, overrides)
    assert str(error.value).startswith(message), str(error.value)


def test_a_typo_in_a_file_names_the_file(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {TINY}\ntrain:\n  lrr: 0.001\n")
    with pytest.raises(ConfigError) as error:
        load_config(child, ["train.lr=1e-3"])
    assert str(error.value) == f"{child}: unknown key train.lrr (did you mean train.lr?)"


# The objective: section as every config was saved before each family had its own (2026-11-28): every family's
# keys at once, here with ALBERT's sentence-order pairs and a T5 noise density set.
FLAT_OBJECTIVE_AS_SAVED = """objective:
  kind: auto
  mask_prob: 0.2
  whole_word_masking: true
  span_masking: false
  span_boundary: false
  sentence_pairs: sop
  noise_density: 0.25
  mean_noise_span_length: 3.0
  noising:
  - text_infilling
  - sentence_permutation
  infilling_ratio: 0.3
  infilling_poisson_lambda: 3.0
  deletion_ratio: 0.15
"""


@pytest.mark.parametrize("family", ["gpt", "llama", "bert", "albert", "electra", "t5", "bart"])
def test_a_stored_config_with_the_flat_objective_section_reads_as_its_familys(family, tmp_path):
    """A run.yaml or checkpoint config.yaml saved before the per-family sections holds every family's objective
    keys: it loads into the family's section with the values of the keys that section has, the others (which
    its run never read) dropped, and saves back as today's config does."""
    tiny = REPO / "configs" / f"{family}_tiny.yaml"
    today = load_config(tiny, to_train=False)
    saved = tmp_path / "config.yaml"
    save_config(today, saved)
    text = saved.read_text()
    start, end = text.index("objective:\n"), text.index("data:\n")
    saved.write_text(text[:start] + FLAT_OBJECTIVE_AS_SAVED + text[end:])
    stored = load_config(saved, to_train=False)
    assert type(stored.objective) is type(today.objective)
    expected = {"mask_prob": 0.2, "whole_word_masking": True, "sentence_pairs": "sop", "noise_density": 0.25}
    for key, value in vars(stored.objective).items():
        assert value == expected.get(key, getattr(type(today.objective)(), key)), (family, key, value)
    assert stored.model == today.model and stored.train == today.train
    assert sorted(vars(stored.objective)) == sorted(vars(today.objective))


@pytest.mark.parametrize(("family", "override", "owners"), [
    ("gpt", "objective.noise_density=0.3", "t5"),
    ("gpt", "objective.mask_prob=0.3", "bert or albert or electra or bart"),
    ("electra", "objective.sentence_pairs=nsp", "bert or albert"),
    ("t5", "objective.noising=[token_masking]", "bart"),
])
def test_a_key_of_another_familys_objective_is_refused_naming_the_families_that_have_it(family, override, owners):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as error:
        load_config(REPO / "configs" / f"{family}_tiny.yaml", [override])
    assert str(error.value) == (f"override {override}: unknown key {key} (model.family={owners} has it, this "
                                "config's family does not)")


def test_a_partial_objective_section_is_not_taken_for_a_stored_flat_one():
    """Only a section holding the keys every saved flat section had is read as one; a user's GPT config that
    names BERT's and T5's keys together is refused, not quietly trimmed."""
    with pytest.raises(ConfigError, match="unknown key objective.mask_prob"):
        load_config(TINY, ["objective.mask_prob=0.2", "objective.noise_density=0.2"])
