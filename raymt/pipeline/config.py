"""`raymt pipeline`'s config: one TOML file, typed (`PipelineConfig`): the languages, the output
location, the corpora and a section per stage, each checked in `__post_init__` with one-line
errors; `--set STAGE.FIELD=VALUE` changes any field as the file would (`load`).

    src = "en"
    tgt = "de"
    output = "runs/pipeline-tiny"
    [corpora]            # train/valid/test prefixes (PREFIX.src, PREFIX.tgt); none: the built-in corpus
    [prepare]            # `raymt data prepare`'s options (PrepareConfig's fields): rules, vocab_size, ...
    [scorers]            # the filters' models: forward/backward checkpoints given, else trained (as [teacher])
    [score_filter]       # enabled, keep_best or calibrate_valid: the training pairs by dual cross-entropy
    [teacher]            # num_seeds, preset, config, set, max_steps, max_minutes
    [distill]            # beam, engine: the teachers translate the training sources
    [ce_filter]          # enabled, keep_best: the distilled pairs by the backward model's cross-entropy
    [student]            # preset, config, set, max_steps, max_minutes
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

    def __post_init__(self) -> None:
        positive("corpora", builtin_train_size=self.builtin_train_size, builtin_eval_size=self.builtin_eval_size)
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

    def check_files(self, src: str, tgt: str) -> None:
        """Every corpus file there (a missing one: one line naming it)."""
        for name in ("train", "valid", "test"):
            prefix = getattr(self, name)
            try:
                if prefix is not None:
                    resolve(prefix, src), resolve(prefix, tgt)
            except ValueError as err:
                raise ValueError(f"corpora.{name}: {err}") from None


@dataclass
class TrainStage:
    """A training stage: `raymt train`'s preset, config file, --set overrides and length."""

    STAGE = "train"
    preset: str = "mini"
    config: Optional[str] = None
    set: list[str] = field(default_factory=list)
    max_steps: Optional[int] = None
    max_minutes: Optional[float] = None

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
        positive(self.STAGE, max_steps=self.max_steps, max_minutes=self.max_minutes)


@dataclass
class TeacherStage(TrainStage):
    """[teacher]: `num_seeds` teachers (teacher-N trains with train.seed=N), their ensemble distilled."""

    STAGE = "teacher"
    num_seeds: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("teacher", num_seeds=self.num_seeds)


@dataclass
class StudentStage(TrainStage):
    """[student]: the student trained on the teachers' translations with their vocabulary."""

    STAGE = "student"
    preset: str = "student_mini"


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
        self.check_filters()

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
        if name == "set":
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
