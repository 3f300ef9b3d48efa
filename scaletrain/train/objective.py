"""The training objective of a run: which collator turns sequences into batches, and the loaders.

GPT learns next tokens (or a prefix LM), BERT masked tokens (optionally with NSP/SOP sentence
pairs), T5 corrupted spans: each objective is one registered `TrainingObjective` that a family's spec
names and the trainer looks up. The ones families share are here (SHARED_OBJECTIVES); one that only a
family trains is its folder's (T5's span corruption, ELECTRA's replaced token detection, BART's
denoising), listed in its spec's own_objectives. Every collator draws its noise from (seed, global
index), so the loaders below stay resumable from `consumed_samples` alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.utils.data import DataLoader, Dataset

from scaletrain.batch import DOCUMENT_IDS
from scaletrain.config import Config, ConfigError
from scaletrain.data.blend import BlendedDataset, check_same_tokenizer
from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.loader import batch_loader
from scaletrain.data.masking import SPAN_BOUNDARY_KEYS, mlm_collator
from scaletrain.data.objectives import CausalLMCollator, Collator, TokenizerInfo, prefix_lm_collator
from scaletrain.data.sampler import DistributedPretrainingSampler, GlobalSampleOrder
from scaletrain.data.sentence_pairs import SentencePairDataset
from scaletrain.data.seq2seq import EncoderDecoderPrefixLMCollator
from scaletrain.data.storage import dataset_location, load_manifest
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.families import FAMILIES, get_family, objective_kind
from scaletrain.model.family import ModelFamily, TrainingObjective


@dataclass(frozen=True)
class Objective:
    """A run's objective: the registered one it trains (`kind`, its name), its collator and its loaders."""

    kind: str
    collate: Collator
    config: Config
    tokenizer_info: TokenizerInfo
    # Tokens the loader cuts per sample (S + 1 are read): the collator decides, e.g. T5 reads more
    # raw tokens than its encoder length because spans collapse into sentinels.
    packed_seq_length: int

    def dataset(self, split: str, shuffle: bool) -> Dataset:
        """The split's samples keyed by global index: data.dir's, or the blend of data.blend's datasets."""
        sources = self.config.data.sources()
        if len(sources) == 1:
            return self.source_dataset(sources[0].dir, split, shuffle)
        datasets = [self.source_dataset(source.dir, split, shuffle, stream=index)
                    for index, source in enumerate(sources)]
        return BlendedDataset(datasets, [source.weight for source in sources], [source.label for source in sources])

    def source_dataset(self, location: str, split: str, shuffle: bool,
                       stream: int | None = None) -> GlobalIndexDataset | SentencePairDataset:
        """One prepared dataset's split; `stream` gives each dataset of a blend its own epoch order."""
        config = self.config
        seed = config.train.seed if shuffle else 0
        if config.objective.reads_sentence_pairs:
            documents = PackedSequenceDataset(dataset_location(config.data, location), split, config.model.seq_length)
            return SentencePairDataset(documents, self.tokenizer_info, config.model.seq_length, seed,
                                       config.objective.sentence_pairs, shuffle, stream)
        packed = PackedSequenceDataset(dataset_location(config.data, location), split, self.packed_seq_length)
        return GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed, shuffle, stream))

    def train_loader(self, data_parallel_rank: int, data_parallel_size: int, consumed_samples: int) -> DataLoader:
        sampler = DistributedPretrainingSampler(
            self.config.train.micro_batch_size, data_parallel_rank, data_parallel_size, consumed_samples
        )
        return batch_loader(self.dataset("train", shuffle=True), sampler, self.config.data.loader_workers, self.collate)

    def eval_loader(self, validation: ValidationSet, micro_batches: list[list[int]]) -> DataLoader:
        """A validation set's micro-batches of global indices (train/evaluation.py says which), with
        fixed noise: a sequence gets the same masks or spans in every evaluation."""
        return batch_loader(validation.dataset, micro_batches, 0, self.collate)

    @functools.cached_property
    def validation_sets(self) -> list[ValidationSet]:
        """Built once per run, in fixed order (global index = sequence of the split). A blend's datasets
        are evaluated one by one: each gets its own loss, and the blend's is their weighted mean."""
        sources = self.config.data.sources()
        total = sum(source.weight for source in sources)
        return [ValidationSet(source.label, source.weight / total,
                              self.source_dataset(source.dir, "val", shuffle=False)) for source in sources]


@dataclass(frozen=True)
class ValidationSet:
    name: str
    weight: float  # normalised over the blend; 1 without one
    dataset: GlobalIndexDataset | SentencePairDataset

    @property
    def num_samples(self) -> int:
        return self.dataset.order.num_samples

    @property
    def num_tokens(self) -> int:
        """The tokens its sequences hold (the packed length each sample reads, times its samples)."""
        return self.num_samples * self.dataset.sequence_length


def build_objective(config: Config) -> Objective:
    """The run's objective: the registered one its config names (objective.kind, or the family's
    default), with the tokenizer facts its collator needs."""
    sources = config.data.sources()
    if len(sources) > 1:
        check_same_tokenizer({source.label: load_manifest(dataset_location(config.data, source.dir))
                              for source in sources})
    info = TokenizerInfo.from_tokenizer(Tokenizer.load(dataset_location(config.data).tokenizer_path()))
    kind = objective_kind(config)
    collate = training_objective(kind).collator(config, info, get_family(config.model.family))
    # sentence-pair MLM reads whole documents (packed_seq_length None) and cuts pairs itself
    return Objective(kind, collate, config, info, collate.packed_seq_length or config.model.seq_length)


def _document_separator(config: Config, info: TokenizerInfo, family: ModelFamily) -> int | None:
    """The eos id when the family's model reads document ids (model.document_masking / document_positions):
    the collator then marks the packed documents by it."""
    return info.eos_id if DOCUMENT_IDS in family.batch_schema(config).optional_inputs else None


def _causal_lm(config: Config, info: TokenizerInfo, family: ModelFamily) -> Collator:
    return CausalLMCollator(config.model.seq_length, _document_separator(config, info, family))


def _prefix_lm(config: Config, info: TokenizerInfo, family: ModelFamily) -> Collator:
    """A decoder-only model attends the prefix bidirectionally (data/objectives.py); an encoder-decoder
    reads it with its encoder and predicts the rest with its decoder (data/seq2seq.py)."""
    if family.encoder_decoder:
        return EncoderDecoderPrefixLMCollator(info, config.train.seed, config.model.seq_length)
    return prefix_lm_collator(config.train.seed, config.model.seq_length, _document_separator(config, info, family))


def _masked_lm(config: Config, info: TokenizerInfo, family: ModelFamily) -> Collator:
    objective = config.objective
    if objective.span_boundary and not set(SPAN_BOUNDARY_KEYS) <= set(family.batch_schema(config).inputs):
        raise ConfigError(f"objective.span_boundary=true, but a {family.name} model has no span boundary head to "
                          "read the span boundaries (BERT has it); set objective.span_boundary=false")
    return mlm_collator(
        info, config.train.seed, config.model.seq_length, sentence_pairs=objective.sentence_pairs != "none",
        whole_word_masking=objective.whole_word_masking, span_masking=objective.span_masking,
        mask_prob=objective.mask_prob, span_boundary=objective.span_boundary,
    )


SHARED_OBJECTIVES = (
    TrainingObjective("causal_lm", _causal_lm),
    TrainingObjective("prefix_lm", _prefix_lm),
    TrainingObjective("mlm", _masked_lm),
)


def registered_objectives() -> dict[str, TrainingObjective]:
    """Every objective by name: the shared ones above, then each family's own (its spec's own_objectives), in
    the registry's order."""
    objectives = {objective.name: objective for objective in SHARED_OBJECTIVES}
    for name in FAMILIES:
        objectives.update((objective.name, objective) for objective in get_family(name).own_objectives)
    return objectives


def training_objective(name: str) -> TrainingObjective:
    """The registered objective `name`; a family spec naming another is a bug in that spec."""
    objectives = registered_objectives()
    if name not in objectives:
        raise ConfigError(f"objective {name!r} is not a registered training objective; the known ones are "
                          f"{', '.join(objectives)} (train/objective.py SHARED_OBJECTIVES and the families' "
                          "own_objectives)")
    return objectives[name]
