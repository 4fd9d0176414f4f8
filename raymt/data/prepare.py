"""Raw parallel corpora -> a training-ready corpus directory, with Ray Data or, when small, in the driver.

The layout of a prepared corpus is `raymt.data.format`.

Training pairs go through two Ray Data passes and never sit in memory as a whole: the
first reads and cleans every input and keeps a bottom-k hash sample for SentencePiece;
the second reads again, tokenizes in parallel tasks, drops by length, ratio and (optional)
duplicates, and writes the shards. Small inputs (up to DRIVER_PAIRS pairs given in memory,
such as the built-in corpus, and files of up to DRIVER_BYTES in all, such as Multi30k) take
the same two passes in the driver, without Ray Data. Everything is written to
a sibling temporary directory that is renamed into place at the end, so an output
directory is never left half-written; an output URI (s3://...) is built in a local
temporary directory and uploaded, manifest last.

One pipeline prepares one or several corpora (`prepare_corpora`; one pair is a list of one);
`raymt.data.layout` names the files and writes the manifest.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Optional

from raymt import storage
from raymt.cluster import init_ray, machine_cpus
from raymt.config import CONTENT_RULES, PrepareConfig
from raymt.data import scores
from raymt.data.clean import READ_COUNTS, all_dropped
from raymt.data.format import SPM_FILE
from raymt.data.layout import Layout
from raymt.data.mixing import sample_sizes
from raymt.data.shards import eval_split, first_pass, in_driver, ray_data_settings, write_split
from raymt.data.sources import CorpusInput, clean_config, corpus_config, task_spec
from raymt.data.staging import build_staged, existing_corpus
from raymt.errors import check
from raymt.tags import check_source_codes, check_tags, reserved_pieces, source_prefix, source_tags
from raymt.tokenizer import Tokenizer, train_tokenizer


def _progress(message: str) -> None:
    """A progress line on stdout."""
    print(f"prepare: {message}", flush=True)


def read_tokenizer(location: str) -> Tokenizer:
    """The tokenizer at `location` (data.tokenizer): a checkpoint or export directory's spm.model,
    or a SentencePiece .model file; a one-line error when there is none."""
    location = storage.normalize(location)
    proto = storage.optional_bytes(location) if location.endswith(".model") else None
    proto = proto or storage.optional_bytes(storage.join(location, SPM_FILE))
    if proto is None:
        raise ValueError(
            f"data.tokenizer={location}: no tokenizer there; give a checkpoint or export directory "
            f"(with its {SPM_FILE}) or a SentencePiece .model file"
        )
    try:
        return Tokenizer(proto)
    except Exception as e:  # sentencepiece raises RuntimeError on a corrupt model
        raise ValueError(f"data.tokenizer={location}: not a SentencePiece model or raymt tokenizer ({e})") from None


def prepare_corpora(
    cfg: PrepareConfig,
    out: str,
    corpora: list[CorpusInput],
    tokenizer: Optional[Tokenizer] = None,
    overwrite: bool = False,
    command: Optional[str] = None,
    source_codes: Optional[dict[str, int]] = None,
) -> dict:
    """Prepare corpora into one directory (one joint SentencePiece model with the tags reserved,
    shards per corpus, sets per pair: `raymt-corpus/2`, `raymt.data.layout`); returns the manifest.
    `source_codes`: the given `tokenizer`'s model reads its source's language code (language ->
    id), put after the target tag of every source (`raymt.tags.source_prefix`). Starts Ray (ray.init)
    for inputs too large to prepare in the driver (`in_driver`)."""
    t0 = time.time()
    out = storage.normalize(out)
    check(tokenizer is not None or not source_codes, "prepare_corpora: source_codes are ids of the given tokenizer's")
    if source_codes:
        check_source_codes([c.spec for c in corpora], source_codes, "the given model")
    layout = Layout(cfg, corpora, source_codes)
    inputs = layout.check_inputs()
    reserved = reserved_pieces([c.spec for c in corpora], cfg.bt_tag, every_target=bool(source_codes))
    if tokenizer is None and cfg.tokenizer is not None:
        tokenizer = read_tokenizer(cfg.tokenizer)
    if tokenizer is not None:
        check_tags(tokenizer, reserved, "the given model")
    fp = layout.fingerprint(inputs, tokenizer)
    manifest = existing_corpus(out, fp, overwrite)
    if manifest is not None:
        print(f"prepare: {out} already prepared (same inputs and options)", flush=True)
        return manifest
    # Each corpus is prepared in the driver when it is small (`in_driver`), else with Ray Data.
    here = [in_driver(layout.train_inputs(inputs, c)) for c in corpora]
    if not all(here):
        init_ray()
    manifest = build_staged(
        out,
        lambda tmp: _build(layout, tmp, reserved, tokenizer, here),
        options=layout.options(),
        inputs=inputs,
        fingerprint=fp,
        command=command,
    )
    layout.print_summary(manifest, out, time.time() - t0)
    return manifest


def _eval_splits(layout: Layout, tmp: Path) -> tuple[dict, dict]:
    """Write each pair's validation set and test sets (text, nothing dropped); the manifest's
    entries by pair (valid, test)."""
    valid: dict[str, dict] = {}
    tests: dict[str, dict] = {}
    for c in layout.corpora:
        ccfg, pair = corpus_config(layout.cfg, c.spec), c.spec.pair
        if c.valid:
            path = layout.valid_path(pair)
            valid[pair] = {"path": path, "num_pairs": eval_split(ccfg, c.valid, tmp / path)}
        for name, sources in c.test.items():
            path = layout.test_path(pair, name)
            tests.setdefault(pair, {})[name] = {"path": path, "num_pairs": eval_split(ccfg, sources, tmp / path)}
    return valid, tests


def _build(layout: Layout, tmp: Path, reserved: list[str], tokenizer: Optional[Tokenizer], here: list[bool]) -> dict:
    """Write every file of the corpus into `tmp` (corpus i in the driver when `here[i]`); the
    manifest without its bookkeeping."""
    cfg, corpora = layout.cfg, layout.corpora
    valid, tests = _eval_splits(layout, tmp)  # the small sets first: their errors come early
    specs = [_task_specs(layout, c) for c in corpora]
    with contextlib.nullcontext() if all(here) else ray_data_settings():
        firsts: list[Optional[dict]] = [None] * len(corpora)
        if tokenizer is None:
            tokenizer, firsts = _joint_tokenizer(layout, specs, reserved, here)
        ids = {piece: tokenizer.piece_to_id(piece) for piece in reserved}
        entries = []
        for c, task_specs, first, in_here in zip(corpora, specs, firsts, here):
            tags = source_tags(c.spec, reserved)
            prefix = source_prefix(c.spec, ids, layout.source_codes)
            shown = " ".join(map(tokenizer.id_to_piece, prefix))  # <2de> <BT>; an imported NLLB's deu_Latn eng_Latn
            _progress(f"{layout.label(c)}tokenizing and writing training shards" + (f" ({shown})" * bool(prefix)))
            ccfg = clean_config(cfg, c)
            train = write_split(
                ccfg,
                task_specs,
                tokenizer.model_proto,
                tmp,
                layout.train_dir(c),
                in_here,
                first,
                prefix,
                layout.where(c),
            )
            entries.append(
                {
                    "name": c.spec.name,
                    "src_lang": c.spec.src_lang,
                    "tgt_lang": c.spec.tgt_lang,
                    "origin": c.spec.origin,
                    "weight": c.spec.weight,
                    "source_tags": tags,
                    "content_rules": [rule for rule in CONTENT_RULES if getattr(ccfg, rule)],
                    "train": train,
                }
            )
    (tmp / SPM_FILE).write_bytes(tokenizer.model_proto)
    return layout.manifest(tokenizer, entries, valid, tests, ids)


def _task_specs(layout: Layout, c: CorpusInput) -> list[dict]:
    """Corpus `c`'s training inputs as its prepare tasks read them; with a score filter, each with
    its scores and the corpus's threshold (`scores.score_entries`)."""
    cfg = clean_config(layout.cfg, c)
    specs = [task_spec(s, corpus_config(layout.cfg, c.spec)) for s in c.train]
    if scores.filters(cfg):
        for spec, entry in zip(specs, scores.score_entries(cfg, c, f"corpus {c.spec.name}")):
            spec["scores"] = entry
    return specs


def joint_sample(samples: list[list[str]], shares: list[int]) -> tuple[list[str], list[int]]:
    """The SentencePiece sample: the first k_i pairs of each corpus's sample (its sources, then
    its targets, each ordered by hash), k_i at most the pairs it holds; and the k_i taken."""
    # Pass 1 counted duplicate pairs, which a sample holds once: k_i may exceed its pairs.
    shares = [min(k, len(sentences) // 2) for sentences, k in zip(samples, shares)]
    joint: list[str] = []
    for sentences, k in zip(samples, shares):
        half = len(sentences) // 2
        joint += sentences[:k] + sentences[half : half + k]
    return joint, shares


def _joint_tokenizer(
    layout: Layout, specs: list[list[dict]], reserved: list[str], here: list[bool]
) -> tuple[Tokenizer, list[dict]]:
    """Pass 1 per corpus (a bottom-k hash sample and counts), then one SentencePiece model on the
    k_i smallest hashes of corpus i, k_i the temperature's share of sp_sample_size (`sample_sizes`;
    one corpus: its whole sample), the tags reserved; the tokenizer and each corpus's pass-1 counts."""
    cfg, corpora = layout.cfg, layout.corpora
    samples, firsts, sizes = [], [], []
    for c, task_specs, in_here in zip(corpora, specs, here):
        _progress(f"{layout.label(c)}reading {len(task_specs)} training input(s) and sampling for SentencePiece")
        sentences, first = first_pass(corpus_config(cfg, c.spec), task_specs, in_here)
        if not sentences:
            raise all_dropped(first["input"], first, layout.where(c))
        samples.append(sentences)
        firsts.append(first)
        # Pairs that pass the text rules: the corpus's size as far as pass 1 knows it.
        sizes.append(first["input"] - sum(first.get(rule, 0) for rule in READ_COUNTS[1:]))
    shares = sample_sizes(sizes, cfg.sp_sample_size, cfg.temperature, [c.spec.weight for c in corpora])
    joint, shares = joint_sample(samples, shares)
    _progress(
        f"training SentencePiece ({cfg.sp_model_type}, {cfg.vocab_size} pieces) on {len(joint) // 2} pairs"
        + layout.sample_note(shares, reserved)
    )
    tokenizer = train_tokenizer(
        joint,
        cfg.vocab_size,
        cfg.sp_model_type,
        sample_size=len(joint),
        seed=cfg.seed,
        num_threads=machine_cpus(),
        control_symbols=reserved,
    )
    return tokenizer, firsts
