"""The run directory: its layout, a run directory opened once (`RunDir`: its saved config and
Ray Train's snapshot of its checkpoints, read once), continuing it (`RunDir.resume_config`, the
one door of `train.run`'s resume_dir and `--resume`), what a new run from a checkpoint's weights
keeps (`init_config`: its model and vocabulary), the checks before a run starts or continues there
(a checkpoint to continue, same mix, same tag side, same model shape and vocabulary, writable) and
the files a run writes for a resume and for people. Plain values only: the command line's flags
are read in raymt.train."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import tempfile
from pathlib import Path
from typing import Any, Optional

from raymt import storage
from raymt.checkpoint import RAY_SNAPSHOT_FILE, SPM_FILE, load_config
from raymt.config import BUILTIN_LANGS, SCHEDULE_FIELDS, Config, CorpusSpec, apply_overrides
from raymt.data.format import open_corpus
from raymt.data.mixing import mixed
from raymt.tags import check_tag_side
from raymt.tokenizer import Tokenizer

RUN_CONFIG = "raymt_config.json"
# Where a run started from a checkpoint's weights (--init) took them: a resume before its first
# checkpoint starts there again.
INIT_FILE = "init_checkpoint.json"
METRICS_CSV = "logs/metrics.csv"
CORPUS_DIR = "corpus"  # a run's own prepared corpus, on the run's storage: every node reads it


def mixes_corpora(cfg: Config) -> bool:
    """Whether a run mixes corpora (several, or a back-translated one: data.corpora, or a --corpus
    prepared from them)."""
    if cfg.data.corpus is None:
        return mixed(cfg.data.corpora)
    try:
        return mixed(open_corpus(cfg.data.corpus).training_corpora)
    except ValueError:  # not (or no longer) a prepared corpus: plan_data says so where it reads it
        return False


MIX_FIELDS = ("corpora", "corpus", "temperature")


def _mix_field(cfg: Config, field: str) -> str:
    """data.corpora (its corpora's names), data.corpus or data.temperature, in words."""
    if field == "corpora":
        return "[" + ", ".join(c.name for c in cfg.data.corpora) + "]"
    return f"{getattr(cfg.data, field)}" if field == "corpus" else f"{cfg.data.temperature:g}"


class RunDir:
    """A run directory (a local path or a URI), opened once: its location, and what it holds as
    first read (the config the run saved when it started, Ray Train's snapshot of its checkpoints);
    the checks before a run starts or continues there, and the files it writes there."""

    def __init__(self, location: str | Path):
        self.location = storage.normalize(location)

    def path(self, *parts: str) -> str:
        """`location/part/...`: a file or directory of the run."""
        return storage.join(self.location, *parts)

    @functools.cached_property
    def saved(self) -> Optional[Config]:
        """The config the run saved when it started; None where there is none (read once)."""
        saved = storage.optional_bytes(self.path(RUN_CONFIG))
        return None if saved is None else Config.from_dict(json.loads(saved))

    @functools.cached_property
    def snapshot(self) -> Optional[bytes]:
        """Ray Train's snapshot of the run's checkpoints as first read; None when there is none."""
        return storage.optional_bytes(self.path(RAY_SNAPSHOT_FILE))

    def registered_checkpoints(self) -> int:
        """How many checkpoints Ray Train registered in the run (0 when none)."""
        try:
            return len(json.loads(self.snapshot)["checkpoint_results"]) if self.snapshot else 0
        except (json.JSONDecodeError, KeyError, TypeError):
            return 0

    def latest_checkpoint(self) -> Optional[str]:
        """The checkpoint Ray Train would continue the run from (its latest registered one), if any."""
        try:
            snapshot = json.loads(self.snapshot) if self.snapshot else None
            name = snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] if snapshot else None
        except (json.JSONDecodeError, KeyError, TypeError):
            return None
        return self.path(name) if name else None

    def resume_config(self, cfg: Config) -> Config:
        """`cfg` placed in the run directory it continues (train.storage_path and train.name), after
        the checks before Ray starts: a run directory, with a registered checkpoint if it trained,
        the same mix of corpora and the same tag side as its saved config."""
        if self.saved is None:
            raise ValueError(
                f"--resume {self.location}: not a run directory (no {RUN_CONFIG}); a checkpoint starts a new run "
                "instead (--init CHECKPOINT_DIR, or train.run(cfg, init_checkpoint=CHECKPOINT_DIR))"
            )
        self.check_resumable()
        self.check_same_mix(cfg)
        check_tag_side(cfg.data.tag_side, trained=self.saved.data.tag_side, model=f"--resume {self.location}: the run")
        parent, name = storage.split(self.location)
        return apply_overrides(cfg, {"train.storage_path": parent, "train.name": name})

    def check_resumable(self) -> None:
        """A one-line error when a run that trained has no registered checkpoint to continue from
        (it would silently start again at step 0)."""
        if self.registered_checkpoints():
            return
        last = _last_step(storage.optional_bytes(self.path(METRICS_CSV)))
        found = [n for n in storage.listdir(self.location) if n.startswith("checkpoint_")]
        if last is not None or found:
            trained = f"logged step {last}" if last is not None else f"has {len(found)} checkpoint_* directories"
            raise ValueError(
                f"--resume {self.location}: the run {trained} but Ray Train registered no checkpoint "
                f"there (no {RAY_SNAPSHOT_FILE} listing one), so it would start again at step 0; "
                f"start a new run from one of its checkpoint_* directories (--init {self.location}/checkpoint_... "
                "--name NEW) or from scratch"
            )

    def check_same_mix(self, cfg: Config) -> None:
        """A one-line error, before Ray starts, when a resumed multi-corpus run is given other
        corpora or another data.temperature than it saved: its checkpoints' data positions are
        positions in its mix (the workers check the checkpoint's `data_mix` too). One-pair runs
        resume as they always have."""
        saved = self.saved
        assert saved is not None, "resume_config checks that it is a run directory"
        changed = [f for f in MIX_FIELDS if getattr(saved.data, f) != getattr(cfg.data, f)]
        if not changed or not (mixes_corpora(saved) or mixes_corpora(cfg)):
            return
        diff = "; ".join(
            f"data.{f} {_mix_field(saved, f)} there, {_mix_field(cfg, f)} here"
            if _mix_field(saved, f) != _mix_field(cfg, f)
            else f"data.{f}: other files, weights or sets"
            for f in changed
        )
        start = self.latest_checkpoint() or f"{self.location}/checkpoint_..."
        raise ValueError(
            f"--resume {self.location}: the run's mix of corpora cannot change ({diff}); "
            f"start a new run from its checkpoint instead: --init {start} --name NEW"
        )

    def start_checkpoint(self) -> Optional[str]:
        """The checkpoint the run started from (--init) while it has none of its own registered:
        a resume then starts from those weights again, as the run did."""
        record = storage.optional_bytes(self.path(INIT_FILE))
        if record is None or self.registered_checkpoints():
            return None
        return json.loads(record)["init_checkpoint"]

    def check_writable(self) -> None:
        """A one-line error, before Ray starts and without leaving anything behind, if a local run
        directory cannot be written (Ray Train checks remote storage itself)."""
        if storage.is_uri(self.location):
            return
        directory = existing = Path(self.location)
        while not existing.exists():
            existing = existing.parent
        try:
            if not existing.is_dir():
                raise NotADirectoryError(f"{existing} is a file, not a directory")
            tempfile.TemporaryFile(dir=existing).close()
        except OSError as err:
            raise ValueError(
                f"cannot write the run directory {directory} ({err.strerror or err}): pass a writable --storage-path"
            ) from None

    def write_run_files(self, cfg: Config, tokenizer: Tokenizer, init_checkpoint: Optional[str] = None) -> None:
        """The run's config and SentencePiece model, and the checkpoint it started from, for
        --resume and for people."""
        storage.write_bytes(self.path(SPM_FILE), tokenizer.model_proto)
        storage.write_bytes(self.path(RUN_CONFIG), json.dumps(cfg.to_dict(), indent=2).encode())
        if init_checkpoint is not None:
            record = {"init_checkpoint": init_checkpoint}
            storage.write_bytes(self.path(INIT_FILE), json.dumps(record, indent=2).encode())


# What a run started from a checkpoint's weights keeps: the model's shape (every model.* field but
# the dropout rates, which fine-tuning may lower) and the vocabulary (its SentencePiece model,
# whose data.* options only matter where one is trained).
TUNABLE_MODEL_FIELDS = ("dropout", "attention_dropout")
VOCABULARY_FIELDS = ("vocab_size", "sp_model_type", "sp_sample_size")


def fixed_changes(saved: Config, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(field, value in `saved`, value in `cfg`) of each field a run from `saved`'s weights keeps
    that `cfg` changes: its model's shape and vocabulary."""
    fixed = [f"model.{f.name}" for f in dataclasses.fields(saved.model) if f.name not in TUNABLE_MODEL_FIELDS]
    fixed += [f"data.{name}" for name in VOCABULARY_FIELDS]
    return [
        (key, field_value(saved, key), field_value(cfg, key))
        for key in fixed
        if field_value(saved, key) != field_value(cfg, key)
    ]


def field_value(cfg: Config, key: str) -> Any:
    """The value of a dotted field ("model.d_model") of `cfg`."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check_shape(cfg: Config, checkpoint: str | Path) -> None:
    """A one-line error when the starting checkpoint's model differs in shape or vocabulary (or
    tag side) from the config's."""
    saved, _ = load_config(checkpoint)
    diff = [f"{key} {there} there, {here} here" for key, there, here in fixed_changes(saved, cfg)]
    check_tag_side(cfg.data.tag_side, trained=saved.data.tag_side, model=str(checkpoint))
    if diff:
        raise ValueError(
            f"{checkpoint} holds a model of another shape or vocabulary ({'; '.join(diff)}): a run from its "
            "weights keeps every model.* field but the dropout rates, and its SentencePiece model; "
            "leave them as the checkpoint has them, or train from scratch"
        )


def init_config(saved: Config) -> Config:
    """The config a new run from a checkpoint's weights (`--init`) builds on: the defaults, with
    the checkpoint's model, vocabulary, tag side, decoding and batch schedule (`SCHEDULE_FIELDS`,
    which GPU defaults leave alone); its data is the command's. A one-pair checkpoint's pair is the
    default (of a SPEC without SRC-TGT:, and the built-in corpus's where it has its languages)."""
    kept = {key: field_value(saved, key) for key in (*SCHEDULE_FIELDS, "data.tag_side")}
    kept.update({f"data.{name}": getattr(saved.data, name) for name in VOCABULARY_FIELDS})
    pairs = saved.data.pairs()
    if len(pairs) == 1 and all(lang in BUILTIN_LANGS for lang in pairs[0]):
        kept["data.corpora"] = [CorpusSpec(*pairs[0])]
    fresh = dataclasses.replace(Config(), model=saved.model, decode=saved.decode)
    return apply_overrides(fresh, kept)


def run_pairs(cfg: Config) -> list[str]:
    """The pairs a run trains ("en-de"), for its name: a prepared corpus's, or its corpora's."""
    if cfg.data.corpus is not None:  # data.corpora gets them from its manifest only later
        try:
            return open_corpus(cfg.data.corpus).pairs
        except ValueError:  # not a prepared corpus: plan_data says so
            pass
    return [f"{src}-{tgt}" for src, tgt in cfg.data.pairs()]


def finalize(cfg: Config) -> Config:
    """Give the run a name and an absolute storage path (URIs such as s3:// stay as they are; a
    relative path in a `ray job submit` job goes under ~/raymt: storage.output_location)."""
    # Named after its pairs: "raymt-en-de-...", or "raymt-en-de+de-en-..." for a mixed run.
    name = cfg.train.name or f"raymt-{'+'.join(run_pairs(cfg))}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    location = storage.output_location(cfg.train.storage_path, "--storage-path")  # never into a job's package
    if not storage.is_uri(location):
        location = str(Path(location).resolve())
    return apply_overrides(cfg, {"train.name": name, "train.storage_path": location})


def run_location(cfg: Config) -> str:
    """The run directory: STORAGE_PATH/NAME, a local path or a URI; everything a resume needs is there."""
    return storage.join(cfg.train.storage_path, cfg.train.name)


def _csv_steps(metrics_csv: Optional[bytes]) -> list[int]:
    """The steps of a metrics.csv's rows (none when it is missing)."""
    rows = (metrics_csv or b"").decode().splitlines()[1:]
    return [int(row.split(",")[0]) for row in rows if row]


def first_step(metrics_csv: Optional[bytes]) -> Optional[int]:
    """The first step logged by this run (above log_every when it continued another run)."""
    return next(iter(_csv_steps(metrics_csv)), None)


def _last_step(metrics_csv: Optional[bytes]) -> Optional[int]:
    """The last step a run logged, if any."""
    steps = _csv_steps(metrics_csv)
    return steps[-1] if steps else None
