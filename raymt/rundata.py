"""What a run trains, validates and tests on, settled on the driver before Ray starts
(`plan_data`: every input checked, the small sets read) and prepared once Ray is up
(`materialize`).

One planning path: a single pair is a mix of one corpus. Its inputs plan and prepare as several
corpora do (one real pair reserves no tags); a prepared `--corpus` (either format) is read pair by
pair. Validation and test sets are keyed by pair ("en-de") whatever their number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from raymt import storage
from raymt.checkpoint import CONFIG_FILE, SPM_FILE, languages_entry, model_languages
from raymt.config import Config, CorpusSpec, PrepareConfig, apply_overrides, run_prepare_config
from raymt.data import builtin, sources
from raymt.data.format import MANIFEST_FILE, PreparedCorpus, open_corpus
from raymt.data.text import Pairs
from raymt.errors import check
from raymt.rundir import CORPUS_DIR
from raymt.tags import check_source_codes, check_tag_side, check_tags, reserved_pieces
from raymt.tokenizer import Tokenizer


@dataclass
class PairTags:
    """A run's pairs and their tags: its checkpoints' config.json entry (`languages_entry`; None for
    one pair without tags) and the ids put before each pair's validation and test sources."""

    languages: Optional[dict]
    prefixes: dict[str, list[int]]  # "en-de" -> [id of <2de>] (and of en's code); [] where the corpus reserves no tag


def pair_tags(corpus: PreparedCorpus, tag_side: str = "src") -> PairTags:
    """The PairTags of a prepared corpus: its pairs in the order of its training corpora, and
    where the model reads its target tag (data.tag_side: "tgt" needs a tag per target language);
    a corpus with source language codes (an imported NLLB's) keeps them as `source_tags`."""
    pairs = list(dict.fromkeys((c.src_lang, c.tgt_lang) for c in corpus.training_corpora))
    prefixes = {f"{s}-{t}": corpus.prefix_ids(f"{s}-{t}") for s, t in pairs}
    check_tag_side(tag_side, corpus.training_corpora, every_target=bool(corpus.source_codes))
    if len(pairs) == 1 and not corpus.reserved:  # one untagged pair: its checkpoints name no languages
        return PairTags(None, prefixes)
    return PairTags(languages_entry(pairs, corpus.reserved, tag_side, corpus.source_codes), prefixes)


@dataclass
class RunData:
    """What a run trains and validates on, settled on the driver before Ray starts."""

    corpus_dir: str  # where its prepared corpus is: given (data.corpus) or made in the run directory
    # "valid" and "test": pair ("en-de") -> (sources, references) in memory; a test set for
    # each pair that has one (its first).
    eval_sets: dict[str, dict[str, Pairs]]
    tokenizer: Optional[Tokenizer]  # known up front (corpus, resumed run, checkpoint) or None
    corpora: Optional[list] = None  # sources.CorpusInput list still to prepare into `corpus`
    # the settings `corpora` are prepared with (the run's data.* options): None for a prepared corpus
    prepare_config: Optional[PrepareConfig] = None
    # language -> id of the code its model reads first in each source (an imported NLLB's
    # languages "source_tags"), put after the target tag of every source; {} for other models
    source_codes: dict[str, int] = field(default_factory=dict)


def plan_data(
    cfg: Config, run_dir: str | Path, resume_dir: Optional[str], init_checkpoint: Optional[str | Path]
) -> tuple[Config, RunData]:
    """Check every input and read the small sets; nothing here needs Ray. A run on a prepared
    corpus gets its pairs in data.corpora (its checkpoints' languages, the test set's scorer)."""
    known = _known_tokenizer(resume_dir, init_checkpoint, cfg.data.tokenizer)
    # A model that reads its source's code (an imported NLLB) passes it on to a student of its tokenizer.
    codes = _known_codes(init_checkpoint or (None if resume_dir else cfg.data.tokenizer))
    given = str(init_checkpoint or resume_dir or f"data.tokenizer={cfg.data.tokenizer}")
    check(
        resume_dir or init_checkpoint or known is None or cfg.data.vocab_size in (None, known.vocab_size),
        f"data.vocab_size={cfg.data.vocab_size}, but {given} has {known and known.vocab_size} pieces: leave "
        "data.vocab_size unset (the given tokenizer sets it)",
    )
    if cfg.data.corpus is not None:
        cfg, run_data = plan_prepared(cfg, known, given, codes)
    else:
        corpus_dir = storage.join(str(run_dir), CORPUS_DIR)
        cfg, run_data = plan_inputs(cfg, corpus_dir, resume_dir, known, given, codes)
    # A prepared corpus's pairs are in corpora now; a model that reads language codes tags every target.
    check_tag_side(cfg.data.tag_side, cfg.data.corpora, every_target=bool(run_data.source_codes))
    return cfg, run_data


def builtin_sources(cfg: Config):
    """The `corpus_inputs` callback of a run: a corpus without files gets the built-in splits
    of its pair at data.builtin_train_size/builtin_eval_size, generated from train.seed."""
    sizes = cfg.data.builtin_train_size, cfg.data.builtin_eval_size
    return lambda spec, _: builtin.sources(spec.src_lang, spec.tgt_lang, *sizes, cfg.train.seed)


def plan_inputs(
    cfg: Config,
    corpus_dir: str,
    resume_dir: Optional[str],
    known: Optional[Tokenizer],
    given: str,
    codes: Optional[dict[str, int]] = None,
) -> tuple[Config, RunData]:
    """plan_data for a run that prepares its own corpus into `corpus_dir`: each corpus's sources,
    each pair's validation and (first) test set read into memory, checked before Ray starts;
    `codes`: the starting model's source language codes (a resumed run's: its corpus's)."""
    specs = cfg.data.corpora
    resumed = resume_dir is not None and storage.exists(storage.join(corpus_dir, MANIFEST_FILE))
    codes = codes or (open_corpus(corpus_dir).source_codes if resumed else {})
    if codes:
        check_source_codes(specs, codes, given)
    options = run_prepare_config(cfg)
    corpora = sources.corpus_inputs(specs, options, builtin_sources(cfg))
    valid, test = {}, {}
    for c in corpora:
        corpus_cfg = sources.corpus_config(options, c.spec)
        if c.valid:
            valid[c.spec.pair] = sources.read_eval(corpus_cfg, c.valid)
        if c.test:
            test[c.spec.pair] = sources.read_eval(corpus_cfg, next(iter(c.test.values())))
    if known is not None:
        check_tags(known, reserved_pieces(specs, cfg.data.bt_tag, every_target=bool(codes)), given)
    for c in corpora:  # validation sets are prepared from memory (read once)
        c.valid = [sources.Source(kind="pairs", pairs=valid[c.spec.pair])] if c.valid else []
    if resumed:
        corpora = None  # prepared when the run started
    return cfg, RunData(corpus_dir, {"valid": valid, "test": test}, known, corpora, options, codes)


def plan_prepared(
    cfg: Config, known: Optional[Tokenizer], given: str, codes: Optional[dict[str, int]] = None
) -> tuple[Config, RunData]:
    """plan_data for a prepared corpus (data.corpus): each pair's validation set and first test
    set; a one-pair corpus's may be replaced by data.corpora's valid/test. Its pairs become
    data.corpora (without files); a starting model's source language `codes` must be its codes."""
    corpus = open_corpus(cfg.data.corpus)
    pairs = [tuple(pair.split("-", 1)) for pair in corpus.pairs]  # codes hold no '-'
    valid_given = next((c.valid for c in cfg.data.corpora if c.valid), None)
    test_given = next((c.test for c in cfg.data.corpora if c.test), ())
    check(
        len(pairs) == 1 or not (valid_given or test_given),
        f"--valid/--test PREFIX replace a one-pair corpus's sets, but {corpus.location} holds several "
        "pairs: prepare it again with --valid/--test SRC-TGT:SPEC",
    )
    specs = [CorpusSpec(src, tgt, valid=valid_given, test=test_given) for src, tgt in pairs]
    cfg = apply_overrides(cfg, {"data.corpora": specs})
    tokenizer = corpus.tokenizer()
    check(
        known is None or known.model_proto == tokenizer.model_proto,
        f"{given} has a different SentencePiece model than the corpus {corpus.location}: "
        "prepare the corpus with that model, or train from scratch on it",
    )
    theirs = corpus.source_codes
    check(
        not codes or (theirs and all(codes.get(lang) == i for lang, i in theirs.items())),
        f"{given} reads the source's language code first in each source, but {corpus.location} was prepared "
        f"{'with other ids for them' if theirs else 'without them'}: let the run prepare its corpus (--train, --pairs)",
    )
    _temperature_note(cfg, corpus)
    # How a given valid/test set is read (built only then: a corpus's vocabulary may be no prepare's).
    options = run_prepare_config(cfg) if valid_given or test_given else None
    valid, test = {}, {}
    for pair in corpus.pairs:
        valid[pair] = _read_set(options, valid_given) if valid_given else corpus.eval_set("valid", pair)
        names = corpus.test_names(pair)
        if test_given:
            test[pair] = _read_set(options, test_given[0])
        elif names:
            test[pair] = corpus.eval_set(names[0], pair)
    return cfg, RunData(corpus.location, {"valid": valid, "test": test}, tokenizer, source_codes=theirs)


def on_prepared(cfg: Config, run_data: RunData) -> Config:
    """The config of runs on the corpus `run_data` just prepared (a sweep's trials): data.corpus,
    data.corpora its pairs (its validation and test sets are in it)."""
    specs = [CorpusSpec(src, tgt) for src, tgt in cfg.data.pairs()]
    return apply_overrides(cfg, {"data.corpus": run_data.corpus_dir, "data.corpora": specs})


def _read_set(options: Optional[PrepareConfig], location: str) -> Pairs:
    """A valid/test set that replaces a one-pair corpus's, read whole (stripped, nothing dropped)."""
    assert options is not None, "plan_prepared builds the settings where a set is given"
    return sources.read_eval(options, [sources.source_from_spec(location, options)])


def _temperature_note(cfg: Config, corpus: PreparedCorpus) -> None:
    """A note when a corpus's SentencePiece sample was mixed at another temperature than this run's."""
    prepared_at = corpus.options.get("temperature", cfg.data.temperature)
    if prepared_at != cfg.data.temperature:  # data.temperature mixes; a sweep may vary it on purpose
        print(
            f"note: {cfg.data.corpus} was prepared with --temperature {prepared_at:g} (its SentencePiece sample); "
            f"this run mixes its corpora at data.temperature={cfg.data.temperature:g} "
            f"(--set data.temperature={prepared_at:g} mixes them as prepared)",
            flush=True,
        )


def _known_tokenizer(
    resume_dir: Optional[str], init_checkpoint: Optional[str | Path], given: Optional[str] = None
) -> Optional[Tokenizer]:
    """The SentencePiece model a resumed run or a starting checkpoint already has, else the one
    data.tokenizer names (`given`)."""
    for directory in (resume_dir, init_checkpoint):
        proto = storage.optional_bytes(storage.join(directory, SPM_FILE)) if directory is not None else None
        if proto is not None:
            return Tokenizer(proto)
    if given is not None:
        from raymt.data.prepare import read_tokenizer  # prepare starts Ray: rundata stays plain (test_boundary)

        return read_tokenizer(given)
    return None


def _known_codes(init_checkpoint: Optional[str | Path]) -> dict[str, int]:
    """The id of each language's code that a starting checkpoint reads first in its sources (an
    imported NLLB's or M2M-100's languages "source_tags"); {} for other models."""
    if init_checkpoint is None or not storage.exists(storage.join(str(init_checkpoint), CONFIG_FILE)):
        return {}  # no config.json: no languages (`run` refuses such a checkpoint earlier: rundir.check_shape)

    return dict((model_languages(init_checkpoint) or {}).get("source_tags", {}))


def materialize(run_data: RunData) -> PreparedCorpus:
    """Prepare the corpus if the run makes its own (Ray Data, or the driver for small inputs),
    with the settings planned (`RunData.prepare_config`), then open it: its training corpora
    (shards, tags, weight) and tokenizer."""
    from raymt.data import prepare  # prepare starts Ray: rundata stays plain (test_boundary)

    if run_data.corpora is not None:
        assert run_data.prepare_config is not None, "plan_inputs plans the corpora with their settings"
        prepare.prepare_corpora(
            run_data.prepare_config,
            run_data.corpus_dir,
            run_data.corpora,
            tokenizer=run_data.tokenizer,
            source_codes=run_data.source_codes,
        )
    return open_corpus(run_data.corpus_dir)
