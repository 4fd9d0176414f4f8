"""`raymt import DIR --output CKPT`: a Hugging Face translation model as a raymt checkpoint.

Reads a model directory as `save_pretrained` writes it (config.json, model.safetensors, its shards
or pytorch_model.bin, read with weights_only=True; the tokenizer's files) without transformers or a
network, and writes a checkpoint that every raymt command takes (translate, evaluate, serve,
backtranslate, average, export, `train --init`). The family comes from config.json's model_type
(`IMPORTERS`), each in a module of its own:

- `marian` (OPUS-MT, raymt.hf_marian): post-norm, separate or shared vocabularies, multi-target
  models' `>>fr<<` codes as raymt's source-side tags.
- `m2m_100` (NLLB-200, M2M-100, raymt.hf_m2m): pre-norm, fairseq's positions, every language
  code a decoder-side target tag and a source tag; `--src-lang`/`--tgt-lang` pick the default pair.

The model computes what the HF model computes. Two rearrangements keep raymt's conventions: the
vocabulary is reordered so raymt's special ids hold (PAD 0, UNK 1, BOS 2 = the HF decoder start,
EOS 3; rows the HF model lacks, and BOS where the decoder starts with EOS (</s>, NLLB), get an
output bias of ABSENT_LOGIT, so they take no probability: raymt.hf_model), and Marian's model
dimension is reordered from HF's sinusoid layout (sin in the first half, cos in the second) to
raymt's (interleaved), the inverse of `export --format marian`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from raymt.checkpoint import load_config, model_languages, save_checkpoint, tag_side
from raymt.command import flag, main_of
from raymt.config import Config
from raymt.config.corpus import CorpusSpec
from raymt.config.sections import DataConfig
from raymt.hf_m2m import import_m2m
from raymt.hf_marian import import_marian
from raymt.hf_model import HFModel, Imported, read_weights
from raymt.model import build_model

# config.json's model_type -> its family's importer (a directory, --src-lang, --tgt-lang).
IMPORTERS: dict[str, Callable[[HFModel, Optional[str], Optional[str]], Imported]] = {
    "marian": import_marian,
    "m2m_100": import_m2m,
}
FAMILIES = tuple(IMPORTERS)


@dataclass(kw_only=True)
class ImportConfig:
    """`raymt import`: a Hugging Face model directory, the new checkpoint, and the languages the
    directory does not say (or, NLLB and M2M-100, the default pair)."""

    directory: str = flag(help="a Hugging Face model directory (OPUS-MT Marian, M2M-100 or NLLB)", positional=True)
    output: str = flag(help="new directory for the raymt checkpoint", required=True)
    src_lang: Optional[str] = flag(
        None,
        "the source language, when neither the tokenizer nor the name says it; NLLB, M2M-100: the "
        "default pair's (a language of the model: de or deu_Latn)",
    )
    tgt_lang: Optional[str] = flag(None, "the target language, as --src-lang")


def read_hf(directory: str | Path) -> HFModel:
    """config.json, the weights and tokenizer_config.json of a model directory, the family checked."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory; give a Hugging Face model directory (save_pretrained)")
    files = HFModel(directory, {}, {})  # the directory's files, before its weights are read
    config = files.json("config.json", "the model's configuration")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        what = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise ValueError(
            f"{directory} holds a {model_type or 'model without a model_type'} model ({what}); raymt imports "
            "encoder-decoder translation models of the families marian (OPUS-MT) and m2m_100 (M2M-100, NLLB)"
        )
    return HFModel(directory, config, read_weights(directory), files.json("tokenizer_config.json"))


def imported_data(hf: HFModel, pairs: list, languages: Optional[dict]) -> DataConfig:
    """The data section of an imported model: its pairs (data.corpora, without files) and tag side.
    data.corpus names the directory imported: what the model was trained on is not raymt's to
    know, and its pairs (any languages, not the built-in corpus's) name no files. A training run
    from it (`--init`) names its own corpora."""
    corpora = [CorpusSpec(s, t) for s, t in pairs]
    return DataConfig(corpora=corpora, corpus=str(hf.directory.resolve()), tag_side=tag_side(languages))


def import_model(
    directory: str | Path, output: str | Path, src_lang: Optional[str] = None, tgt_lang: Optional[str] = None
) -> Path:
    """Write the HF model of `directory` as a raymt checkpoint in a new `output` directory."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    hf = read_hf(directory)
    model_cfg, state, tokenizer, languages, pairs = IMPORTERS[hf.get("model_type")](hf, src_lang, tgt_lang)
    data = imported_data(hf, pairs, languages)
    config = Config(model=model_cfg, data=data)
    model = build_model(model_cfg, tokenizer.vocab_size)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"{hf.directory}: the weights do not fit config.json's shape ({str(err).splitlines()[0]})"
        ) from None
    return save_checkpoint(output, model.eval(), config, tokenizer, languages=languages)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    return main_of("raymt import", ImportConfig, run, argv, __doc__.split("\n\n")[0])


def run(cfg: ImportConfig) -> Path:
    """Import `cfg.directory` (`import_model`) and say how to translate with it; returns the checkpoint."""
    output = import_model(cfg.directory, cfg.output, cfg.src_lang, cfg.tgt_lang)
    print(f"imported {cfg.directory} -> {output}")
    src, tgt = load_config(output)[0].data.pair()
    langs = f" --src-lang {src} --tgt-lang {tgt}" if (model_languages(output) or {}).get("source_tags") else ""
    print(f'translate: raymt translate --checkpoint {output}{langs} "..."')
    return output


if __name__ == "__main__":
    sys.exit(main())
