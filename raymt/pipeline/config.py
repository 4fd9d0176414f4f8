"""`raymt pipeline`'s config: one TOML file, typed (`PipelineConfig`): the languages, the output
location, the corpora and a section per stage, each checked in `__post_init__` with one-line
errors; `--set STAGE.FIELD=VALUE` changes any field as the file would (`load`).

    src = "en"
    tgt = "de"
    output = "runs/pipeline-tiny"
    [corpora]            # train/valid/test prefixes (PREFIX.src, PREFIX.tgt); none: the built-in corpus;
                         # mono_src/mono_tgt: monolingual text (or builtin_mono_size: held out of the built-in)
    [prepare]            # `raymt data prepare`'s options (PrepareConfig's fields): rules, vocab_size, ...
    [mono]               # `raymt data mono`'s options (MonoConfig's): language ID, length, dedup, sample
    [backward]           # the tgt->src model: trained (as [teacher]), a checkpoint, or imported
    [bt]                 # beam, sample, noise, seed, engine: the backward model translates mono_tgt
    [scorers]            # the filters' models: forward/backward checkpoints given, else trained (as [teacher])
    [score_filter]       # enabled, keep_best or calibrate_valid: the training pairs by dual cross-entropy
    [teacher]            # num_seeds, preset, config, set, max_steps, max_minutes; stages, real_weight,
                         # average_last, finetune_*: two stages with back-translation; import_from;
                         # checkpoints: existing raymt teachers (their ensemble distils; none trained)
    [distill]            # beam, engine: the teachers translate the training sources
    [ce_filter]          # enabled, keep_best: the distilled pairs by the backward model's cross-entropy
    [student]            # preset, config, set, max_steps, max_minutes; mix_original: share of original pairs
    [export]             # dtypes compared (the faster kept), beam timed
    [evaluate]           # beam
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

from raymt.config import BT_ENGINES, CONTENT_RULES, PrepareConfig, load_file, parse_set_args, parse_value, preset
from raymt.config.corpus import SCORE_KEYS
from raymt.data.mono_clean import MonoConfig
from raymt.data.text import resolve
from raymt.errors import check
from raymt.pipeline.models import CT2_TYPES


def positive(section: str, **values: Optional[float]) -> None:
    """One line for a value given that is not > 0."""
    for name, value in values.items():
        check(value is None or value > 0, f"{section}.{name}={value} must be > 0")


@dataclass
class CorporaConfig:
    """[corpora]: the parallel corpora as prefixes (PREFIX.SRC, PREFIX.TGT); without `train`, the
    built-in corpus of the pair, generated with the sizes and seed here."""

    train: Optional[str] = None
    valid: Optional[str] = None
    test: Optional[str] = None
    builtin_train_size: int = 2000
    builtin_eval_size: int = 100
    seed: int = 1
    # Monolingual text (what `raymt data mono --input` reads: a file, glob, directory or URI): the
    # target side is back-translated for the teachers, the source side translated by them.
    mono_src: Optional[str] = None
    mono_tgt: Optional[str] = None
    # The built-in corpus only: this many more source and target lines held out of training as
    # monolingual text (mono.SRC, mono.TGT in the corpus step's directory).
    builtin_mono_size: int = 0

    def __post_init__(self) -> None:
        positive("corpora", builtin_train_size=self.builtin_train_size, builtin_eval_size=self.builtin_eval_size)
        check(self.builtin_mono_size >= 0, f"corpora.builtin_mono_size={self.builtin_mono_size} must be >= 0")
        check(
            not self.builtin_mono_size or (self.train is None and self.mono_src is None and self.mono_tgt is None),
            "corpora.builtin_mono_size holds text out of the built-in corpus: not with corpora.train, "
            "mono_src or mono_tgt (give your monolingual text as mono_src/mono_tgt)",
        )
        if self.train is None:
            check(
                self.valid is None and self.test is None,
                "corpora.valid/corpora.test without corpora.train: give all three, or none (the built-in corpus)",
            )
        else:
            check(
                self.valid is not None and self.test is not None,
                "corpora.train needs corpora.valid and corpora.test (prefixes)",
            )

    @property
    def builtin(self) -> bool:
        """Whether the corpora are the built-in corpus."""
        return self.train is None

    def has_mono(self, side: str) -> bool:
        """Whether there is monolingual text of `side` (src or tgt): given, or held out of the built-in."""
        return getattr(self, f"mono_{side}") is not None or self.builtin_mono_size > 0

    def check_files(self, src: str, tgt: str) -> None:
        """Every corpus file there (a missing one: one line naming it)."""
        for name in ("train", "valid", "test"):
            prefix = getattr(self, name)
            try:
                if prefix is not None:
                    resolve(prefix, src), resolve(prefix, tgt)
            except ValueError as err:
                raise ValueError(f"corpora.{name}: {err}") from None
        for side in ("src", "tgt"):
            spec = getattr(self, f"mono_{side}")
            plain = spec is not None and "://" not in spec and not any(c in spec for c in "*?[")
            check(not plain or Path(spec).exists(), f"corpora.mono_{side}={spec}: no such file or directory")


# The updates' cap of a training step sized to its data (patience or max_minutes ends it first).
UNSIZED_MAX_STEPS = 1_000_000


@dataclass
class TrainStage:
    """A training stage: `raymt train`'s preset, config file, --set overrides and length."""

    STAGE = "train"
    preset: str = "mini"
    config: Optional[str] = None
    set: list[str] = field(default_factory=list)
    max_steps: Optional[int] = None
    max_minutes: Optional[float] = None
    # A step whose length is not given (max_steps, or train.max_steps / train.epochs in `set` or
    # its config file) is sized to its data: it ends after `patience` evaluations in a row without
    # a better validation BLEU (or at max_minutes), never at the quick start's 400 updates.
    patience: int = 5

    def __post_init__(self) -> None:
        try:
            preset(self.preset)
        except ValueError as err:
            raise ValueError(f"{self.STAGE}.preset: {err}") from None
        check(
            self.config is None or Path(self.config).is_file(),
            f"{self.STAGE}.config={self.config}: no such file (a TOML or JSON config of `raymt train`)",
        )
        parse_set_args(list(self.set))  # one line for an item that is no FIELD=VALUE
        positive(self.STAGE, max_steps=self.max_steps, max_minutes=self.max_minutes, patience=self.patience)

    def length_given(self) -> bool:
        """Whether the stage sets its length: max_steps, or train.max_steps / train.epochs in `set` or
        in its config file."""
        keys = set(parse_set_args(list(self.set)))
        if self.config is not None:
            keys |= {f"train.{k}" for k in load_file(self.config).get("train", {})}
        return self.max_steps is not None or bool(keys & {"train.max_steps", "train.epochs"})

    def length(self) -> tuple[Optional[int], list[str]]:
        """The run's max_steps flag and the --set items that go before the stage's own: as given, or
        sized to its data (`patience`; the updates' cap UNSIZED_MAX_STEPS, which it ends before)."""
        if self.length_given():
            return self.max_steps, []
        return UNSIZED_MAX_STEPS, [f"train.patience={self.patience}"]


@dataclass
class TeacherStage(TrainStage):
    """[teacher]: `num_seeds` teachers (teacher-N trains with train.seed=N), their ensemble distilled.
    With back-translated pairs, `stages` 2: stage 1 (teacher-N-bt) on the original and back-translated
    pairs mixed (the original weighted `real_weight`), stage 2 (teacher-N) on the original pairs from
    the average of stage 1's `average_last` last checkpoints (teacher-N-avg), with `finetune_set`
    added and its own length if given; `stages` 1: teacher-N on the mix. `import_from`: one teacher
    imported (`raymt import` of a Hugging Face directory or Hub id), none trained. `checkpoints`:
    existing raymt checkpoints, the teachers (several: their ensemble distils), none trained."""

    STAGE = "teacher"
    num_seeds: int = 1
    stages: int = 2
    real_weight: float = 1.0
    average_last: int = 4
    finetune_set: list[str] = field(default_factory=list)
    finetune_max_steps: Optional[int] = None
    finetune_max_minutes: Optional[float] = None
    import_from: Optional[str] = None
    revision: Optional[str] = None
    checkpoints: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("teacher", num_seeds=self.num_seeds, real_weight=self.real_weight, average_last=self.average_last)
        positive("teacher", finetune_max_steps=self.finetune_max_steps, finetune_max_minutes=self.finetune_max_minutes)
        check(self.stages in (1, 2), f"teacher.stages={self.stages}: 1 or 2 (with back-translated pairs)")
        parse_set_args(list(self.finetune_set))
        check(
            self.import_from is None or self.num_seeds == 1,
            f"teacher.import_from with teacher.num_seeds={self.num_seeds}: an imported teacher is one teacher",
        )
        check_import("teacher", self.import_from, self.revision)
        self.check_checkpoints()

    def check_checkpoints(self) -> None:
        """One line for a given teacher that is no directory, or given beside import_from or num_seeds."""
        if not self.checkpoints:
            return
        check(
            self.import_from is None,
            "teacher.checkpoints and teacher.import_from both name the teachers: give one",
        )
        check(
            self.num_seeds == 1,
            f"teacher.num_seeds={self.num_seeds} with teacher.checkpoints: the teachers are the checkpoints given",
        )
        for path in self.checkpoints:
            check(Path(path).is_dir(), f"teacher.checkpoints: {path}: no such directory (a raymt checkpoint)")

    @property
    def trained(self) -> bool:
        """Whether the pipeline trains the teachers (neither imported nor given)."""
        return self.import_from is None and not self.checkpoints


def check_import(stage: str, directory: Optional[str], revision: Optional[str]) -> None:
    """One line for a stage's import_from that is neither a directory nor a Hub id, or a lone revision."""
    check(revision is None or directory is not None, f"{stage}.revision without {stage}.import_from: give both")
    hub_id = directory is not None and directory.count("/") == 1 and not directory.startswith((".", "/"))
    check(
        directory is None or Path(directory).is_dir() or hub_id,
        f"{stage}.import_from={directory}: no such directory, nor a Hub id (ORG/NAME)",
    )


@dataclass
class BackwardStage(TrainStage):
    """[backward]: the tgt->src model that back-translates corpora.mono_tgt: trained on the training
    pairs reversed (as [teacher]), or an existing raymt `checkpoint`, or imported (`import_from`:
    `raymt import` of a Hugging Face directory or Hub id)."""

    STAGE = "backward"
    checkpoint: Optional[str] = None
    import_from: Optional[str] = None
    revision: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.checkpoint is None or self.import_from is None,
            "backward.checkpoint and backward.import_from both name the backward model: give one",
        )
        check(
            self.checkpoint is None or Path(self.checkpoint).is_dir(),
            f"backward.checkpoint={self.checkpoint}: no such directory (a raymt checkpoint)",
        )
        check_import("backward", self.import_from, self.revision)

    @property
    def trained(self) -> bool:
        """Whether the pipeline trains the backward model."""
        return self.checkpoint is None and self.import_from is None


# The fields of [mono]: `raymt data mono`'s options but its input, output, language and sets.
MONO_SKIP = ("input", "output", "lang", "column", "exclude")
# Its rules of content, off for the built-in corpus's generated text unless set (as [prepare]'s).
MONO_CONTENT_RULES = ("alpha_ratio", "repeats", "wrong_language")


@dataclass
class MonoStage:
    """[mono]: `raymt data mono`'s options for corpora.mono_src and mono_tgt (MonoConfig's defaults);
    `exclude_eval`: drop the lines of the validation and test sets."""

    min_chars: int = MonoConfig.min_chars
    max_chars: int = MonoConfig.max_chars
    min_words: int = MonoConfig.min_words
    max_words: Optional[int] = MonoConfig.max_words
    alpha_ratio: bool = MonoConfig.alpha_ratio
    alpha_ratio_min: float = MonoConfig.alpha_ratio_min
    repeats: bool = MonoConfig.repeats
    repeats_max: int = MonoConfig.repeats_max
    wrong_language: bool = MonoConfig.wrong_language
    wrong_language_confidence: float = MonoConfig.wrong_language_confidence
    wrong_language_min_chars: int = MonoConfig.wrong_language_min_chars
    dedup: bool = MonoConfig.dedup
    near_dedup: bool = MonoConfig.near_dedup
    max_lines: Optional[int] = MonoConfig.max_lines
    seed: int = MonoConfig.seed
    exclude_eval: bool = True

    def config(self, input: str, output: str, lang: str, exclude: Sequence[str] = ()) -> MonoConfig:
        """`raymt data mono`'s config of one side (its checks, as mono.FIELD)."""
        options = {k: v for k, v in dataclasses.asdict(self).items() if k != "exclude_eval"}
        try:
            return MonoConfig(input=[input], output=output, lang=lang, exclude=list(exclude), **options)
        except ValueError as err:
            raise ValueError(f"[mono]: {err}") from None


@dataclass
class BtStage:
    """[bt]: the backward model translates the monolingual target text (`raymt backtranslate`):
    at `beam`, or sampled (`sample`), or noised beam output (`noise`), seeded by `seed`."""

    beam: int = 5
    sample: bool = False
    noise: bool = False
    seed: int = 1
    engine: str = "auto"
    shard_lines: int = 10_000  # the restart unit; not in the key (the output is the same)

    def __post_init__(self) -> None:
        positive("bt", beam=self.beam, shard_lines=self.shard_lines)
        check(self.engine in BT_ENGINES, f"bt.engine={self.engine!r}: one of {', '.join(BT_ENGINES)}")
        check(not (self.sample and self.noise), "bt.sample and bt.noise are two ways of back-translating: pick one")


@dataclass
class StudentStage(TrainStage):
    """[student]: the student trained on the teachers' translations with their vocabulary."""

    STAGE = "student"
    preset: str = "student_mini"
    # The original training pairs' share of the student's (the distilled ones get the rest).
    mix_original: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0.0 <= self.mix_original < 1.0, f"student.mix_original={self.mix_original} must be in [0, 1)")


@dataclass
class DistillStage:
    """[distill]: the teachers translate the training sources (`raymt backtranslate --format text`)."""

    beam: int = 5
    engine: str = "auto"
    shard_lines: int = 10_000  # the restart unit; not in the key (the output is the same)

    def __post_init__(self) -> None:
        positive("distill", beam=self.beam, shard_lines=self.shard_lines)
        check(self.engine in BT_ENGINES, f"distill.engine={self.engine!r}: one of {', '.join(BT_ENGINES)}")


@dataclass
class ScorersStage(TrainStage):
    """[scorers]: the models of the score filters: a src->tgt `forward` and a tgt->src `backward`
    raymt checkpoint, each given or else trained (scorer-fwd on the prepared pairs, scorer-bwd on
    them reversed) with this stage's preset, config, set and length, as [teacher]'s."""

    STAGE = "scorers"
    forward: Optional[str] = None
    backward: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("forward", "backward"):
            given = getattr(self, name)
            check(
                given is None or Path(given).is_dir(),
                f"scorers.{name}={given}: no such directory (a raymt checkpoint; leave it out to train one)",
            )


@dataclass
class ScoreFilterStage:
    """[score_filter]: the training pairs scored by dual conditional cross-entropy ([scorers]'
    models, `raymt data score`) and the corpus prepared again without those under a threshold set
    without labels: the best `keep_best` fraction, or `calibrate_valid` (the score that this share
    of the validation pairs, scored alike, fall under; CALIBRATE_VALID when neither is set)."""

    CALIBRATE_VALID: ClassVar[float] = 0.05
    enabled: bool = False
    keep_best: Optional[float] = None
    calibrate_valid: Optional[float] = None

    def __post_init__(self) -> None:
        check(
            self.keep_best is None or self.calibrate_valid is None,
            "score_filter.keep_best and score_filter.calibrate_valid are two thresholds: set one",
        )
        check(
            self.keep_best is None or 0 < self.keep_best <= 1,
            f"score_filter.keep_best={self.keep_best} must be in (0, 1]",
        )
        check(
            self.calibrate_valid is None or 0 < self.calibrate_valid < 1,
            f"score_filter.calibrate_valid={self.calibrate_valid} must be in (0, 1): the share of validation "
            "pairs under the threshold",
        )

    def rule(self) -> dict[str, float]:
        """prepare's score option that applies the threshold (`PrepareConfig` field -> value)."""
        if self.keep_best is not None:
            return {"keep_best": self.keep_best}
        return {"calibrate_valid": self.calibrate_valid or self.CALIBRATE_VALID}


@dataclass
class CeFilterStage:
    """[ce_filter]: the teachers' translations scored by [scorers]' backward model (exp(-H(src |
    translation)), `raymt data score` without a forward model, as mozilla/translations filters
    them); the student trains on the best `keep_best` of them."""

    enabled: bool = False
    keep_best: float = 0.95

    def __post_init__(self) -> None:
        check(0 < self.keep_best <= 1, f"ce_filter.keep_best={self.keep_best} must be in (0, 1]")


@dataclass
class ExportStage:
    """[export]: the student in CTranslate2, at the fastest of `dtypes` on one thread at `beam`."""

    dtypes: list[str] = field(default_factory=lambda: list(CT2_TYPES))
    beam: int = 5

    def __post_init__(self) -> None:
        check(bool(self.dtypes), f"export.dtypes is empty: one or more of {', '.join(CT2_TYPES)}")
        for dtype in self.dtypes:
            check(dtype in CT2_TYPES, f"export.dtypes: {dtype!r} is not one of {', '.join(CT2_TYPES)}")
        positive("export", beam=self.beam)


@dataclass
class EvaluateStage:
    """[evaluate]: every model on the test set at `beam` (the student greedy too)."""

    beam: int = 5

    def __post_init__(self) -> None:
        positive("evaluate", beam=self.beam)


@dataclass
class PipelineConfig:
    """The whole pipeline: languages, output location, corpora and a section per stage."""

    src: str
    tgt: str
    output: str
    corpora: CorporaConfig = field(default_factory=CorporaConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    mono: MonoStage = field(default_factory=MonoStage)
    backward: BackwardStage = field(default_factory=BackwardStage)
    bt: BtStage = field(default_factory=BtStage)
    scorers: ScorersStage = field(default_factory=ScorersStage)
    score_filter: ScoreFilterStage = field(default_factory=ScoreFilterStage)
    teacher: TeacherStage = field(default_factory=TeacherStage)
    distill: DistillStage = field(default_factory=DistillStage)
    ce_filter: CeFilterStage = field(default_factory=CeFilterStage)
    student: StudentStage = field(default_factory=StudentStage)
    export: ExportStage = field(default_factory=ExportStage)
    evaluate: EvaluateStage = field(default_factory=EvaluateStage)

    def __post_init__(self) -> None:
        check(self.src != self.tgt, f"src and tgt are both {self.src!r}: pick two languages")
        check(
            (self.prepare.src_lang, self.prepare.tgt_lang) == (self.src, self.tgt),
            "prepare.src_lang/tgt_lang: the languages are src and tgt (top level)",
        )
        check(bool(self.output), "output is empty: a directory for the pipeline's steps")
        self.corpora.check_files(self.src, self.tgt)
        for side, lang in (("src", self.src), ("tgt", self.tgt)):
            if self.corpora.has_mono(side):
                self.mono.config("-", "-", lang)  # its checks with the language (language ID knows it?)
        check(
            self.teacher.import_from is None or not self.corpora.has_mono("tgt"),
            "corpora.mono_tgt is back-translated for the teachers to train on, but teacher.import_from "
            "imports the teacher: drop one",
        )
        check(
            not self.teacher.checkpoints or not self.corpora.has_mono("tgt"),
            "corpora.mono_tgt is back-translated for the teachers to train on, but teacher.checkpoints "
            "gives the teachers: drop one",
        )
        check(
            not self.teacher.checkpoints or not self.score_filter.enabled,
            "score_filter filters the teachers' training pairs, but teacher.checkpoints gives the teachers: "
            "drop one (ce_filter filters the distilled pairs)",
        )
        self.check_filters()

    @property
    def back_translates(self) -> bool:
        """Whether the teachers train on back-translated pairs (monolingual target text, trained teachers)."""
        return self.corpora.has_mono("tgt") and self.teacher.trained

    def check_filters(self) -> None:
        """One line when [score_filter] is on and [prepare] filters by score itself."""
        own = [k for k in SCORE_KEYS if getattr(self.prepare, k) is not None]
        check(
            not (self.score_filter.enabled and own),
            f"prepare.{own[0] if own else ''} with score_filter.enabled: the score filter sets prepare's threshold "
            "and scores; leave prepare's out",
        )

    @property
    def pair(self) -> tuple[str, str]:
        """(src, tgt)."""
        return self.src, self.tgt


SECTIONS: dict[str, type] = {
    f.name: f.default_factory().__class__  # type: ignore[misc]
    for f in dataclasses.fields(PipelineConfig)
    if f.default_factory is not dataclasses.MISSING
}
TOP_FIELDS = ("src", "tgt", "output")
# The lists of `raymt train --set` items: --set STAGE.FIELD=ITEM adds one.
SET_LISTS = ("set", "finetune_set")
# Fields of a section that the pipeline sets itself.
SET_BY_PIPELINE = {"prepare": ("src_lang", "tgt_lang")}


def section_fields(section: str) -> list[str]:
    """The fields a section may set."""
    return [f.name for f in dataclasses.fields(SECTIONS[section]) if f.name not in SET_BY_PIPELINE.get(section, ())]


def typed(where: str, value: Any, kind: Any) -> Any:
    """`value` of a TOML file or --set checked against the field's type (an int is a float too)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union and type(None) in args:
        if value is None:
            return None
        kind = next(a for a in args if a is not type(None))
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        check(isinstance(value, list), f"{where}={value!r} must be a list (a TOML array)")
        return [typed(where, v, typing.get_args(kind)[0]) for v in value]
    if origin is dict or kind is dict:
        check(isinstance(value, dict), f"{where}={value!r} must be a table")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    name = kind.__name__
    check(ok, f"{where}={value!r} must be {'an' if name[0] in 'aeiou' else 'a'} {name}")
    return value


def apply_sets(data: dict, sets: Sequence[str]) -> dict:
    """`data` (the file's tables) with each --set STAGE.FIELD=VALUE (FIELD=VALUE at the top level),
    typed as `raymt train --set` types it; a stage's `set` list gets the item added (the later of
    two for one field wins), another list field takes comma-separated values."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in sets:
        ((key, raw),) = parse_set_args([item]).items()  # in order: two items of one list both count
        section, _, name = key.rpartition(".")
        if not section:
            data[name] = raw
            continue
        check(section in SECTIONS, f"--set {key}: no section [{section}]; use one of {', '.join(SECTIONS)}")
        allowed = section_fields(section)
        check(name in allowed, f"--set {key}: [{section}] has no field {name!r}; use one of {', '.join(allowed)}")
        kind = typing.get_type_hints(SECTIONS[section])[name]
        table = data.setdefault(section, {})
        if name in SET_LISTS:
            table[name] = [*table.get(name, []), raw]
        elif typing.get_origin(kind) is list:
            table[name] = [v.strip() for v in raw.split(",") if v.strip()]
        else:
            table[name] = parse_value(raw, kind, key)
    return data


def build_section(section: str, table: Any, pair: tuple[str, str], builtin: bool) -> Any:
    """The config of one [section]: its fields checked by name and type."""
    check(isinstance(table, dict), f"{section} must be a [{section}] table")
    cls, allowed = SECTIONS[section], section_fields(section)
    for name in table:
        check(name in allowed, f"[{section}] has no field {name!r}; use one of {', '.join(allowed)}")
    hints = typing.get_type_hints(cls)
    values = {name: typed(f"{section}.{name}", v, hints[name]) for name, v in table.items()}
    if section == "prepare":
        values.update(src_lang=pair[0], tgt_lang=pair[1])
        if builtin:  # generated text: the content rules off (as in a run on it), unless set here
            values = {**{rule: False for rule in CONTENT_RULES}, **values}
    if section == "mono" and builtin:  # the built-in corpus's held-out text: generated, as above
        values = {**{rule: False for rule in MONO_CONTENT_RULES}, **values}
    return cls(**values)


def from_dict(data: dict, output: Optional[str] = None, sets: Sequence[str] = ()) -> PipelineConfig:
    """The PipelineConfig of a TOML file's tables, --output and --set."""
    data = apply_sets(data, sets)
    if output is not None:
        data["output"] = output
    valid = [*TOP_FIELDS, *(f"[{s}]" for s in SECTIONS)]
    for name in data:
        check(
            name in TOP_FIELDS or name in SECTIONS,
            f"unknown section or field {name!r}; use one of {', '.join(valid)}",
        )
    for name in TOP_FIELDS:
        check(name in data, f"{name} is missing: the config needs src, tgt and output (or --output DIR)")
        check(isinstance(data[name], str), f"{name}={data[name]!r} must be a string")
    pair = (data["src"], data["tgt"])
    corpora = build_section("corpora", data.get("corpora", {}), pair, False)
    sections = {s: build_section(s, data.get(s, {}), pair, corpora.builtin) for s in SECTIONS if s != "corpora"}
    return PipelineConfig(src=pair[0], tgt=pair[1], output=data["output"], corpora=corpora, **sections)


def load(path: str, output: Optional[str] = None, sets: Sequence[str] = ()) -> PipelineConfig:
    """The PipelineConfig of a TOML file, --output and --set (a one-line ValueError for a mistake)."""
    check(path.endswith(".toml"), f"{path}: a pipeline config is a TOML file (recipes/pipeline-tiny.toml)")
    return from_dict(load_file(path), output, sets)
