"""`raymt import DIR --output CKPT`: a Hugging Face translation model as a raymt checkpoint.

DIR is a model directory as `save_pretrained` writes it, or a Hub id (Helsinki-NLP/opus-mt-en-de,
as a model card names it) read through huggingface_hub's cache (`model_directory`: HF_HOME,
HF_HUB_CACHE and HF_HUB_OFFLINE as huggingface_hub reads them, `--revision` a pin). The directory's
config.json, weights (model.safetensors, its shards or pytorch_model.bin, read with
weights_only=True) and tokenizer files are read without transformers (and, a directory, without a
network), and written as a checkpoint that every raymt command takes (translate, evaluate, serve,
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
from raymt.errors import check, first_line
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
# The files of a Hub repository that an import reads: configurations, tokenizers, safetensors
# weights; pytorch_model.bin only where there are none (OPUS-MT's repositories also hold TF, Flax
# and Rust copies of the weights, which are not downloaded).
HUB_FILES = ["*.json", "*.spm", "*.model", "*.safetensors"]
HUB_BIN = ["pytorch_model.bin"]


@dataclass(kw_only=True)
class ImportConfig:
    """`raymt import`: a Hugging Face model directory, the new checkpoint, and the languages the
    directory does not say (or, NLLB and M2M-100, the default pair)."""

    directory: str = flag(
        help="a Hugging Face model directory (OPUS-MT Marian, M2M-100 or NLLB), or a Hub id "
        "(Helsinki-NLP/opus-mt-en-de) from huggingface_hub's cache, downloaded unless HF_HUB_OFFLINE is set",
        positional=True,
    )
    output: str = flag(help="new directory for the raymt checkpoint", required=True)
    src_lang: Optional[str] = flag(
        None,
        "the source language, when neither the tokenizer nor the name says it; NLLB, M2M-100: the "
        "default pair's (a language of the model: de or deu_Latn)",
    )
    tgt_lang: Optional[str] = flag(None, "the target language, as --src-lang")
    revision: Optional[str] = flag(None, "a Hub id's revision: a branch, tag or commit (default: main)")


def model_directory(name: str | Path, revision: Optional[str] = None) -> tuple[Path, str]:
    """(the directory, the model's name) that `name` means: a directory as it is (it wins over a Hub
    id of the same name), else a Hub id's snapshot (`hub_snapshot`) and the id's NAME."""
    path = Path(name)
    if path.is_dir():
        check(revision is None, f"--revision {revision} pins a Hub id's version, but {name} is a local directory")
        return path, path.resolve().name
    return hub_snapshot(str(name), revision), str(name).rsplit("/", 1)[-1]


def hub_snapshot(repo_id: str, revision: Optional[str] = None) -> Path:
    """The snapshot of the Hub model `repo_id` at `revision` in huggingface_hub's cache (HUB_FILES,
    else HUB_BIN), downloaded where it is not cached unless HF_HUB_OFFLINE is set; a one-line error
    saying what `repo_id` is not, and how to fix it, otherwise."""
    not_dir = f"{repo_id} is not a directory"
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise ValueError(
            f"{not_dir}; reading it as a Hub id needs huggingface_hub (pip install huggingface_hub), or "
            "give a Hugging Face model directory (save_pretrained)"
        ) from None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(
            f"{not_dir}, nor a Hugging Face Hub id (ORG/NAME, as a model card names it); give a model "
            "directory (save_pretrained) or a Hub id"
        ) from None
    which = repo_id + (f" at revision {revision}" if revision else "")
    offline = constants.HF_HUB_OFFLINE
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline))
        if not any(path.glob("*.safetensors")):
            snapshot_download(repo_id, revision=revision, allow_patterns=HUB_BIN, local_files_only=offline)
        return path
    except RevisionNotFoundError:
        raise ValueError(f"{not_dir}, and the Hub model {repo_id} has no revision {revision} (--revision)") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{not_dir}, nor a model on the Hugging Face Hub (a private or gated one needs `hf auth login`)"
        ) from None
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub could not be reached ({first_line(err)[:120]})"
        # IncompleteSnapshotError (newer huggingface_hub): files its cached tree listing names are missing
        held = "is only partly" if type(err).__name__ == "IncompleteSnapshotError" else "is not"
        raise ValueError(
            f"{not_dir}, and the Hub id {which} {held} in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and {why}: download it with network (HF_HUB_OFFLINE unset), or pass a model directory"
        ) from None
    except OSError as err:  # the Hub's HTTP errors (HfHubHTTPError), a cache that cannot be written
        raise ValueError(f"{not_dir}, and the Hub id {which} could not be downloaded: {first_line(err)}") from None


def read_hf(directory: str | Path, name: str = "") -> HFModel:
    """config.json, the weights and tokenizer_config.json of a model directory, the family checked;
    `name`: the model's (a Hub id's NAME), by default the directory's."""
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
    return HFModel(directory, config, read_weights(directory), files.json("tokenizer_config.json"), name)


def imported_data(hf: HFModel, pairs: list, languages: Optional[dict]) -> DataConfig:
    """The data section of an imported model: its pairs (data.corpora, without files) and tag side.
    data.corpus names the directory imported: what the model was trained on is not raymt's to
    know, and its pairs (any languages, not the built-in corpus's) name no files. A training run
    from it (`--init`) names its own corpora."""
    corpora = [CorpusSpec(s, t) for s, t in pairs]
    return DataConfig(corpora=corpora, corpus=str(hf.directory.resolve()), tag_side=tag_side(languages))


def import_model(
    directory: str | Path,
    output: str | Path,
    src_lang: Optional[str] = None,
    tgt_lang: Optional[str] = None,
    revision: Optional[str] = None,
) -> Path:
    """Write the HF model of `directory` (or a Hub id's at `revision`: `model_directory`) as a
    raymt checkpoint in a new `output` directory."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose a new directory")
    hf = read_hf(*model_directory(directory, revision))
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
    output = import_model(cfg.directory, cfg.output, cfg.src_lang, cfg.tgt_lang, cfg.revision)
    print(f"imported {cfg.directory} -> {output}")
    src, tgt = load_config(output)[0].data.pair()
    langs = f" --src-lang {src} --tgt-lang {tgt}" if (model_languages(output) or {}).get("source_tags") else ""
    print(f'translate: raymt translate --checkpoint {output}{langs} "..."')
    return output


if __name__ == "__main__":
    sys.exit(main())
