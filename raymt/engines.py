"""Translation engines: raymt's own decoder and CTranslate2 behind one interface.

`load_engine(checkpoint, engine="auto"|"raymt"|"ctranslate2", device, threads)` loads a raymt
checkpoint or export (or a `raymt export --format ctranslate2` directory) once. The engine
knows its model (`engine.info`: config, tokenizer, languages and trained pairs), encodes texts
into source ids (a tagged model's target tag, an imported NLLB's source language code, the
pieces, EOS: `engine.encode`) and translates a batch of encoded sources into the n best
(score, text) per sentence (`translate_ids`). Each source carries its own tag, so one batch
may hold several target languages; a model trained with its tag on the decoder side
(data.tag_side "tgt") gets it from there as its decoder's forced prefix, taken by the engine
(CTranslate2's `target_prefix`), never in an output; a caller that batches many requests'
sentences cuts the batches itself (`token_batches`, by padded source tokens, each source costing
`engine.length(source)`). `translate` does the whole job for a
list of texts, in the length-sorted batches of `raymt translate`. An engine also scores given
outputs (sockeye's Scorer beside its Translator): `score_ids` gives each target's teacher-forced
log-probabilities (its tokens and EOS; a decoder-side tag forced at no cost) for a batch, `score`
for texts in token-budget batches (`raymt data score`'s cross-entropies).

raymt's engine decodes as `raymt.decoding` does, at the precision `raymt.precision.for_inference`
picks. CTranslate2's runs the model exported once into raymt's cache (int8 on a CPU, float16
on a GPU by default); raymt's length limit a * src_len + b is applied by truncation, its length
penalty is CTranslate2's and its scores are CTranslate2's. Nothing here imports Ray.

Several checkpoints (`load_engine([a, b])`, `load_model_info([a, b])`) are an ensemble
(`raymt.ensemble.Ensemble`), raymt's engine only (CTranslate2 has none: `auto` resolves to
raymt's, `ctranslate2` is refused): raymt checkpoints with one tokenizer and the same languages
and tags (`check_ensemble`). The first checkpoint's config is the ensemble's (its pair, its
precision); sources are cut to the positions every member has (`ModelInfo.max_positions`); the
decoding options are the caller's, as for one model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence, Union

import torch

from raymt import storage
from raymt.batching import pad_batch
from raymt.checkpoint import (
    CONFIG_FILE,
    RAYMT_CONFIG_FILE,
    SPM_FILE,
    check_checkpoint,
    check_languages,
    load_model,
    local_checkpoint,
    tag_side,
    weights_file,
)
from raymt.config import Config, DecodeOptions
from raymt.decoding import decode_ids, encode_sources, length_batches, split_tags, token_log_probs
from raymt.ensemble import Decoder, Ensemble
from raymt.errors import check, first_line
from raymt.exporting import export_model
from raymt.precision import for_inference
from raymt.tags import decode_tags
from raymt.tokenizer import Tokenizer

ENGINE_CHOICES = ("auto", "raymt", "ctranslate2")
Translation = tuple[float, str]  # (score, text)
# One target language for every sentence, or one per sentence (None: the model's only target).
TargetLangs = Union[None, str, Sequence[Optional[str]]]
# One checkpoint (path or URI), or several decoded as an ensemble.
Checkpoints = Union[str, Path, Sequence[Union[str, Path]]]


# ---------------------------------------------------------------- the model, without its weights


def is_ct2_export(directory: Path) -> bool:
    """Whether a local directory is a `raymt export --format ctranslate2` output."""
    return (directory / "model.bin").is_file() and (directory / RAYMT_CONFIG_FILE).is_file()


def _json(path: Path) -> dict:
    """A JSON object from a file, with a one-line error."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {first_line(err)}") from None


@dataclass
class ModelInfo:
    """What is known of a model before its weights load: kind, config, tokenizer and languages."""

    location: str  # normalized path or URI
    kind: str  # "raymt" (a checkpoint or export) or "ctranslate2" (a CTranslate2 export)
    config: Config
    tokenizer: Tokenizer
    languages: Optional[dict]  # config.json's "languages" (tagged multilingual models), else None
    members: tuple["ModelInfo", ...] = ()  # an ensemble's models, this one (the first) included; () for one

    @property
    def checkpoints(self) -> list[str]:
        """The locations of the checkpoints decoded together: an ensemble's, or this one's."""
        return [m.location for m in self.members] or [self.location]

    @property
    def max_positions(self) -> int:
        """Source and output positions every model has (an ensemble's least)."""
        return min(m.config.model.max_positions for m in self.members or (self,))

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) language pairs the model was trained on."""
        if self.languages:
            return [(src, tgt) for src, tgt in self.languages["pairs"]]
        return [self.config.data.pair()]  # untagged: one pair

    @property
    def tag_side(self) -> str:
        """Where the model reads its target tag: "src" (before the source), or "tgt" (its
        decoder's first token after BOS: the engine moves it from each encoded source there)."""
        return tag_side(self.languages)

    @property
    def target_langs(self) -> list[str]:
        """The languages the model translates into, sorted."""
        return sorted({tgt for _, tgt in self.pairs})

    def tags(self, tgt_lang: Optional[str]) -> list[str]:
        """The tag pieces before a source to translate into `tgt_lang` (None: the model's only
        target); one-line errors for a missing or untrained language: the one check of --tgt-lang."""
        if self.languages:  # a multilingual model (design-inputs.md section 6)
            return decode_tags(tgt_lang, self.languages["target_langs"], list(self.languages["reserved"]))
        src, tgt = self.config.data.pair()
        check(
            tgt_lang in (None, tgt),
            f"--tgt-lang {tgt_lang}: this model translates {src} -> {tgt} only (one pair, no language tags); "
            f"pass --tgt-lang {tgt} or none, or use a model trained into {tgt_lang}",
        )
        return []

    def source_tag(self, src_lang: Optional[str]) -> list[int]:
        """[the id of `src_lang`'s code] for a model that reads its source's language first (an
        imported NLLB or M2M-100: `source_tags`; None: the source of config.json's pair), else [];
        a one-line error for a language it lacks: the one check of --src-lang and serve's source."""
        sources = (self.languages or {}).get("source_tags")
        if not sources:
            return []
        src_lang = src_lang or self.config.data.pair()[0]
        check(
            src_lang in sources,
            f"--src-lang {src_lang}: this model reads {', '.join(sorted(sources))}; pick one of them",
        )
        return [sources[src_lang]]

    def prefix(self, tgt_lang: Optional[str], src_lang: Optional[str] = None) -> list[int]:
        """The ids of `tags(tgt_lang)` and of `source_tag(src_lang)`: what starts each source into
        `tgt_lang`; a one-line error when spm.model lacks a tag as the control symbol of the id
        config.json reserves for it."""
        tok, reserved = self.tokenizer, (self.languages or {}).get("reserved", {})
        pieces = self.tags(tgt_lang)
        for piece in pieces:  # a tag must be a control symbol, or it would be text
            i = reserved.get(piece)
            check(
                i is not None and tok.piece_to_id(piece) == i and tok.is_control(i),
                f"{self.location}: config.json reserves id {i} for {piece} but spm.model does not; "
                "the files come from different runs",
            )
        return [reserved[piece] for piece in pieces] + self.source_tag(src_lang)

    def encode(
        self, texts: Sequence[str], tgt_lang: TargetLangs = None, src_lang: Optional[str] = None
    ) -> list[list[int]]:
        """Source ids of each text: its target's tag, its source language's (`source_tag`), its
        pieces (cut to fit the model's positions) and EOS, as `raymt.decoding.encode_sources` makes them."""
        max_positions = self.max_positions
        if tgt_lang is None or isinstance(tgt_lang, str):
            return encode_sources(self.tokenizer, texts, max_positions, self.prefix(tgt_lang, src_lang))
        langs = list(tgt_lang)
        check(len(langs) == len(texts), f"{len(texts)} texts but {len(langs)} target languages")
        prefixes = {lang: self.prefix(lang, src_lang) for lang in dict.fromkeys(langs)}
        return [encode_sources(self.tokenizer, [t], max_positions, prefixes[lang])[0] for t, lang in zip(texts, langs)]

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        """Target ids of each text (its pieces, without BOS and EOS), cut so that BOS, a decoder-side
        tag, the pieces and EOS fit the model's positions: the outputs an engine scores (`Engine.score`)."""
        room = self.max_positions - 2 - (1 if self.tag_side == "tgt" else 0)
        return [ids[:room] for ids in self.tokenizer.encode_batch(texts, side="tgt")]


def load_model_info(checkpoints: Checkpoints) -> ModelInfo:
    """The model's kind, config, tokenizer and languages (several checkpoints: an ensemble's, the
    first's with its `members`, `check_ensemble`); one-line errors for a missing or broken one."""
    paths = [checkpoints] if isinstance(checkpoints, (str, Path)) else list(checkpoints)
    check(len(paths) > 0, "--checkpoint: give at least one checkpoint")
    infos = [_model_info(str(p)) for p in paths]
    if len(infos) == 1:
        return infos[0]
    check_ensemble(infos)
    return replace(infos[0], members=tuple(infos))


def check_ensemble(infos: Sequence[ModelInfo]) -> None:
    """One-line errors unless the models can decode as an ensemble: raymt checkpoints (not
    CTranslate2 exports) with the first's tokenizer, languages and tags."""
    first = infos[0]
    for info in infos:
        check(
            info.kind == "raymt",
            f"--checkpoint {info.location} is a CTranslate2 export: an ensemble decodes raymt checkpoints "
            "(CTranslate2 has no ensembles); pass the raymt checkpoint it came from",
        )
    for info in infos[1:]:
        check(
            info.tokenizer.model_proto == first.tokenizer.model_proto,
            f"--checkpoint {info.location} has another tokenizer than {first.location}: an ensemble averages "
            "its models' log-probabilities token by token, so they must share one spm.model",
        )
        check(
            (info.pairs, info.languages) == (first.pairs, first.languages),
            f"--checkpoint {info.location} was trained on other languages or tags ({_languages(info)}) than "
            f"{first.location} ({_languages(first)}): an ensemble's models must translate the same pairs alike",
        )


def _languages(info: ModelInfo) -> str:
    """A model's pairs and tag side, shortly: "en-de, de-en; tags in the decoder"."""
    pairs = ", ".join(f"{src}-{tgt}" for src, tgt in info.pairs)
    if info.languages is None:
        return f"{pairs}; untagged"
    return f"{pairs}; tags {'in the decoder' if info.tag_side == 'tgt' else 'before the source'}"


def _model_info(checkpoint: str) -> ModelInfo:
    """One checkpoint's or export's kind, config, tokenizer and languages."""
    directory = local_checkpoint(checkpoint)
    if is_ct2_export(directory):
        path = directory / RAYMT_CONFIG_FILE
        meta = _json(path)
        try:
            config = Config.from_dict(meta["config"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a raymt export config ({err})") from None
        tokenizer = Tokenizer.load(directory / SPM_FILE)
        kind = "ctranslate2"
    else:
        config, tokenizer = check_checkpoint(directory)
        path = directory / CONFIG_FILE
        meta = _json(path)
        kind = "raymt"
    languages = meta.get("languages")
    languages = None if languages is None else check_languages(languages, str(path))
    return ModelInfo(storage.normalize(checkpoint), kind, config, tokenizer, languages)


def resolve_engine(requested: str, model: ModelInfo) -> str:
    """'raymt' or 'ctranslate2' for --engine; auto takes CTranslate2 when it is installed."""
    check(requested in ENGINE_CHOICES, f"--engine {requested}: no such engine; pick one of {', '.join(ENGINE_CHOICES)}")
    if model.members:  # an ensemble (every member a raymt checkpoint: check_ensemble)
        check(
            requested != "ctranslate2",
            f"--engine ctranslate2 decodes one model, not an ensemble of {len(model.members)} (CTranslate2 has "
            "no ensembles): pass --engine raymt, or one --checkpoint",
        )
        return "raymt"
    have_ct2 = importlib.util.find_spec("ctranslate2") is not None
    if model.kind == "ctranslate2":
        if requested == "raymt":
            raise ValueError(
                f"--engine raymt: {model.location} is a CTranslate2 export; pass the raymt checkpoint "
                "it came from, or --engine ctranslate2"
            )
        if not have_ct2:
            raise ValueError(f"{model.location} is a CTranslate2 export: pip install ctranslate2")
        return "ctranslate2"
    if requested == "ctranslate2" and not have_ct2:
        raise ValueError("--engine ctranslate2 needs the ctranslate2 package: pip install ctranslate2")
    if requested == "auto":
        return "ctranslate2" if have_ct2 else "raymt"
    return requested


def ct2_model_dir(checkpoint: str, cache: Optional[str] = None) -> Path:
    """A local CTranslate2 directory of the model: the export itself, or the checkpoint exported once
    into raymt's cache (keyed by its location and weights), renamed into place whole."""
    local = local_checkpoint(checkpoint)
    if is_ct2_export(local):
        return local
    stat = weights_file(local).stat()
    key = hashlib.sha256(f"{storage.normalize(checkpoint)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    target = (Path(cache) if cache else storage.cache_root()) / "ctranslate2" / key[:16]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        export_model(local, tmp / "model", "ctranslate2")
        os.replace(tmp / "model", target)
    except OSError:
        if not target.is_dir():  # else another process won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# CTranslate2 on a CPU: a server's batch of 64 Multi30k sentences in arrival order decodes ~1.1x as
# fast cut by CTranslate2 into length-sorted sub-batches of 128-256 source tokens as in one batch
# (1 thread, int8; benchmarks/NOTES.md), and `translate`'s length-sorted batches gain too. With
# 2 intra threads such sub-batches leave each thread too little work a step: offline 270
# sentences/s against 431 for whole batches (1 thread: 357 against 329; issue 60,
# benchmarks/NOTES.md), so only a one-thread engine cuts them.
CT2_CPU_SUB_BATCH_TOKENS = 256


def token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices sorted by length (stable), cut so that each batch's padded size (sentences x
    longest) stays within max_tokens; a sentence longer than that is a batch of its own."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


# ---------------------------------------------------------------- the engines


class Engine(ABC):
    """A loaded model: encodes texts and translates batches of encoded sources."""

    name: ClassVar[str]

    def __init__(self, info: ModelInfo):
        self.info = info

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's SentencePiece tokenizer."""
        return self.info.tokenizer

    def encode(
        self, texts: Sequence[str], tgt_lang: TargetLangs = None, src_lang: Optional[str] = None
    ) -> list[list[int]]:
        """Source ids of each text into its target language (ModelInfo.encode)."""
        return self.info.encode(texts, tgt_lang, src_lang)

    def length(self, source: Sequence[int]) -> int:
        """The tokens a source costs in a batch's padded size (its ids, EOS included)."""
        return len(source)

    @abstractmethod
    def translate_ids(
        self, sources: Sequence[Sequence[int]], opts: DecodeOptions, n_best: int = 1
    ) -> list[list[Translation]]:
        """One batch of encoded sources (each ending in EOS): the n_best (score, text) each, best first."""

    @abstractmethod
    def score_ids(self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> list[list[float]]:
        """One batch of encoded sources (each ending in EOS) and target ids (`ModelInfo.encode_targets`):
        each target's teacher-forced log-probabilities, token by token and then EOS (a decoder-side tag
        forced at no cost, as decoding forces it); summed, decoding's length-penalty-0 score."""

    def score(
        self,
        texts: Sequence[str],
        targets: Sequence[str],
        tgt_lang: TargetLangs = None,
        src_lang: Optional[str] = None,
        max_tokens: int = 4096,
    ) -> list[list[float]]:
        """Each target's teacher-forced log-probabilities given its text (sockeye's Scorer beside its
        Translator): its tokens' and EOS's, in input order, scored in length-sorted batches of at most
        `max_tokens` padded tokens (each pair costing the longer of its source and its target with BOS
        and EOS); a tagged model gets its tag, `src_lang` as `translate` takes it."""
        sources, outputs = self.encode(texts, tgt_lang, src_lang), self.info.encode_targets(targets)
        out: list[list[float]] = [[] for _ in sources]
        for batch in token_batches([max(len(s), len(t) + 2) for s, t in zip(sources, outputs)], max_tokens):
            for i, log_probs in zip(batch, self.score_ids([sources[i] for i in batch], [outputs[i] for i in batch])):
                out[i] = log_probs
        return out

    def translate(
        self,
        texts: Sequence[str],
        opts: DecodeOptions,
        tgt_lang: TargetLangs = None,
        n_best: int = 1,
        batch_size: int = 64,
        src_lang: Optional[str] = None,
    ) -> list[list[Translation]]:
        """Texts in length-sorted batches of batch_size sentences: the n_best (score, text) each,
        in input order (raymt's engine: what `raymt.decoding.translate_nbest` gives); `src_lang`:
        the texts' language, for a model that reads it (`ModelInfo.source_tag`)."""
        encoded = self.encode(texts, tgt_lang, src_lang)
        out: list[list[Translation]] = [[] for _ in encoded]
        for batch in length_batches([len(e) for e in encoded], batch_size):
            for i, hyps in zip(batch, self.translate_ids([encoded[i] for i in batch], opts, n_best)):
                out[i] = hyps
        return out


class RaymtEngine(Engine):
    """raymt's own decoder (raymt.decoding) on CPU or GPU, at the precision for_inference picks
    (an ensemble's: its first checkpoint's)."""

    name = "raymt"

    def __init__(self, info: ModelInfo, device: str = "cpu", **_: Any):
        super().__init__(info)
        models = [load_model(c, device)[0] for c in info.checkpoints]
        self.model: Decoder = Ensemble(models) if info.members else models[0]
        self.device = device
        self.autocast = for_inference(device, info.config, info.tokenizer.vocab_size).apply().autocast

    def translate_ids(
        self, sources: Sequence[Sequence[int]], opts: DecodeOptions, n_best: int = 1
    ) -> list[list[Translation]]:
        """One batch of encoded sources: the n_best (score, text) each (raymt.decoding.decode_ids)."""
        with self.autocast():
            return decode_ids(self.model, self.tokenizer, sources, opts, n_best, self.device, self.info.tag_side)

    def score_ids(self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each target's teacher-forced log-probabilities (raymt.decoding.token_log_probs)."""
        src, prefix = split_tags(pad_batch(sources, self.device), self.info.tag_side)
        with self.autocast():
            return token_log_probs(self.model, src, targets, prefix)


class CT2Engine(Engine):
    """CTranslate2 on the model exported once (int8 on CPU by default); raymt's per-sentence
    length limit (a * src_len + b) by truncation, scores are CTranslate2's."""

    name = "ctranslate2"

    def __init__(
        self,
        info: ModelInfo,
        device: str = "cpu",
        threads: Optional[int] = None,
        compute_type: str = "auto",
        cache: Optional[str] = None,
    ):
        import ctranslate2

        super().__init__(info)
        directory = ct2_model_dir(info.location, cache)
        kind, _, index = device.partition(":")
        if compute_type == "auto":
            compute_type = "float16" if kind == "cuda" else "int8"
        self.translator = ctranslate2.Translator(
            str(directory),
            device=kind,
            device_index=int(index or 0),
            compute_type=compute_type,
            intra_threads=threads or 1,
            inter_threads=1,
        )
        self.ct2 = ctranslate2
        self.max_src = info.config.model.max_positions - 1
        self.sub_batch_tokens = CT2_CPU_SUB_BATCH_TOKENS if kind == "cpu" and (threads or 1) == 1 else 0

    def length(self, source: Sequence[int]) -> int:
        """The tokens a source costs in a batch: its pieces (CTranslate2 appends EOS itself)."""
        return len(source) - 1

    def translate_ids(
        self, sources: Sequence[Sequence[int]], opts: DecodeOptions, n_best: int = 1
    ) -> list[list[Translation]]:
        """One batch of encoded sources: the n_best (score, text) each, CTranslate2's scores."""
        check(1 <= n_best <= opts.beam, f"n_best={n_best} must be between 1 and the beam size {opts.beam}")
        if not sources:
            return []
        tok, forced = self.tokenizer, int(self.info.tag_side == "tgt")
        # A decoder-side tag (each source's first id) is the target prefix CTranslate2 forces.
        prefixes = [[tok.id_to_piece(s[0])] for s in sources] if forced else None
        sources = [s[forced:] for s in sources]
        pieces = [[tok.id_to_piece(i) for i in s[:-1]] for s in sources]  # without EOS: CTranslate2 adds it
        limits = [min(int(opts.max_len_a * len(s) + opts.max_len_b) + forced, self.max_src) for s in sources]
        if opts.sample and opts.seed is not None:
            self.ct2.set_random_seed(opts.seed % (2**31))
        results = self.translator.translate_batch(
            pieces,
            prefixes,
            beam_size=opts.beam,
            num_hypotheses=n_best,
            length_penalty=opts.length_penalty,
            max_decoding_length=max(1, max(limits) - 1),
            min_decoding_length=0,
            return_scores=True,
            sampling_topk=(opts.top_k if opts.sample else 1),
            sampling_temperature=opts.temperature,
            # On a CPU CTranslate2 sorts a batch by length and decodes it in sub-batches of this
            # many source tokens: less padding, and faster per sentence than one wide batch.
            max_batch_size=self.sub_batch_tokens,
            batch_type="tokens",
        )
        return [self._hypotheses(result, limit, forced) for result, limit in zip(results, limits)]

    def score_ids(self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each target's teacher-forced log-probabilities: CTranslate2's `score_batch` at the engine's
        compute type (float32: raymt's to ~1e-6 a token); a decoder-side tag forced, its own not counted."""
        if not sources:
            return []
        tok, forced = self.tokenizer, int(self.info.tag_side == "tgt")
        pieces = [[tok.id_to_piece(i) for i in s[forced:-1]] for s in sources]  # CTranslate2 adds EOS
        outputs = [
            [tok.id_to_piece(s[0])] * forced + [tok.id_to_piece(i, "tgt") for i in t] for s, t in zip(sources, targets)
        ]
        results = self.translator.score_batch(
            pieces, outputs, offset=forced, max_batch_size=self.sub_batch_tokens, batch_type="tokens"
        )
        return [list(result.log_probs) for result in results]

    def _hypotheses(self, result: Any, limit: int, forced: int = 0) -> list[Translation]:
        """(score, text) of one sentence's hypotheses, each cut to raymt's limit (EOS included)
        after the `forced` prefix tokens CTranslate2 returns first."""
        tok, out = self.tokenizer, []
        for k, hyp in enumerate(result.hypotheses):
            kept = hyp[forced : max(forced, limit - 1)]
            ids = [tok.piece_to_id(p, "tgt") for p in kept if not p.startswith("<raymt_filler_")]
            out.append((float(result.scores[k]) if result.scores else 0.0, self.tokenizer.decode(ids)))
        return out


ENGINES: dict[str, type[Engine]] = {"raymt": RaymtEngine, "ctranslate2": CT2Engine}


def check_device(device: str) -> None:
    """A one-line error for a --device torch cannot parse or this machine does not have."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a torch device; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is available on this machine; use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu")


def load_engine(
    checkpoint: Checkpoints,
    engine: str = "auto",
    device: str = "cpu",
    threads: Optional[int] = None,
    compute_type: str = "auto",
    cache: Optional[str] = None,
) -> Engine:
    """The model of a checkpoint or export loaded into an engine (auto: CTranslate2 when installed;
    several checkpoints: an ensemble, raymt's engine);
    `threads`: this process's torch threads and CTranslate2's intra_threads (default 1);
    `compute_type` and `cache` (where checkpoints are exported to): CTranslate2's."""
    info = load_model_info(checkpoint)
    name = resolve_engine(engine, info)
    if threads:
        torch.set_num_threads(threads)
    return ENGINES[name](info, device=device, threads=threads, compute_type=compute_type, cache=cache)
