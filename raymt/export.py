"""`python -m raymt.export`: a self-contained model directory for inference.

Its writers, and what each format holds, are raymt/exporting.py's (`export_model`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raymt.argos import export_argos
from raymt.checkpoint import SPM_FILE, model_languages, tag_side
from raymt.command import flag, main_of
from raymt.errors import check
from raymt.exporting import DTYPES, FORMATS, export_model
from raymt.tags import tag_lang


@dataclass(kw_only=True)
class ExportConfig:
    """`raymt export`: a checkpoint, where its export goes, in which format and weight type."""

    checkpoint: str = flag(help="checkpoint directory (of a run, or averaged), or its URI (s3://...)", required=True)
    output: str = flag(help="new directory for the exported model", required=True)
    format: str = flag(
        "auto",
        "weights file: safetensors if installed (auto), safetensors, or torch; "
        "or a CTranslate2 model directory (ctranslate2), or a Hugging Face "
        "MarianMTModel directory (marian, post-norm models only), or Argos Translate "
        "packages, one .argosmodel per pair (argos)",
        choices=(*FORMATS, "argos"),
    )
    dtype: str = flag(
        "auto",
        "store floating-point weights in this dtype (loaded back as float32; "
        "ctranslate2, argos: its weight type, also int8; marian: the HF model's dtype; "
        "default auto: int8 for argos, else float32)",
        choices=("auto", *DTYPES, "int8"),
    )

    def __post_init__(self) -> None:
        formats = (*FORMATS, "argos")
        check(self.format in formats, f"--format {self.format}: one of {', '.join(formats)}")
        check(self.dtype in ("auto", *DTYPES, "int8"), f"--dtype {self.dtype}: one of auto, {', '.join(DTYPES)}, int8")

    @property
    def weight_type(self) -> str:
        """The dtype `auto` stands for: int8 for an Argos package (a CPU deployment), else float32."""
        if self.dtype != "auto":
            return self.dtype
        return "int8" if self.format == "argos" else "float32"


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    return main_of("python -m raymt.export", ExportConfig, run, argv, __doc__.split("\n\n")[0])


def run(cfg: ExportConfig) -> Path:
    """Export `cfg.checkpoint` (`export_model`) and say how to translate with it; returns the output."""
    if cfg.format == "argos":
        return run_argos(cfg)
    output = export_model(cfg.checkpoint, cfg.output, cfg.format, cfg.weight_type)
    files = sorted(p.name for p in output.iterdir())
    size = sum(os.path.getsize(output / f) for f in files) / 2**20
    print(f"exported {cfg.checkpoint} -> {output} ({', '.join(files)}; {size:.1f} MiB)")
    if cfg.format == "ctranslate2":
        print(
            f'translate: ctranslate2.Translator("{output}").translate_batch(pieces) '
            f"with pieces from {output / SPM_FILE}"
        )
        languages = model_languages(output)
        tags = [piece for piece in (languages or {}).get("reserved", {}) if tag_lang(piece) is not None]
        if tags and tag_side(languages) == "tgt":  # docs/translate.md, "Multilingual models"
            print(
                f"multilingual: the target's tag is the decoder's prefix, target_prefix=[[\"{tags[0]}\"]] "
                f"(tags: {', '.join(tags)}); drop it from each hypothesis"
            )
        elif tags:
            print(f'multilingual: the target\'s tag goes first, ["{tags[0]}"] + pieces (tags: {", ".join(tags)})')
    elif cfg.format == "marian":
        print(
            f'translate: transformers.MarianMTModel.from_pretrained("{output}").generate(...) '
            f'with ids from MarianTokenizer.from_pretrained("{output}")'
        )
    else:
        print(f'translate: python -m raymt.translate --checkpoint {output} "..."')
    return output


def run_argos(cfg: ExportConfig) -> Path:
    """Export `cfg.checkpoint` as Argos Translate packages and say how to install them."""
    packages = export_argos(cfg.checkpoint, cfg.output, cfg.weight_type)
    for path in packages:
        print(f"exported {cfg.checkpoint} -> {path} ({os.path.getsize(path) / 2**20:.1f} MiB, {cfg.weight_type})")
    print(
        f"install: python -c 'import argostranslate.package as p; p.install_from_path(\"{packages[0]}\")' "
        "(it unzips into ARGOS_PACKAGES_DIR); offline: ARGOS_CHUNK_TYPE=SPACY splits sentences with the "
        "package's spaCy pipeline (docs/serving.md)"
    )
    return Path(cfg.output)


if __name__ == "__main__":
    sys.exit(main())
