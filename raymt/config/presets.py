"""Model presets as functions: tiny, mini (the default), small, base and big; the students of
`raymt distill`: student_mini and student_base."""

from __future__ import annotations

from typing import Callable

from raymt.config.sections import ModelConfig
from raymt.errors import check


def tiny() -> ModelConfig:
    """Tests: 2+2 layers of width 32."""
    return ModelConfig(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=2, num_decoder_layers=2, dropout=0.0)


def mini() -> ModelConfig:
    """The default: 2+2 layers, 128 wide; learns the built-in corpus in minutes on 2 CPUs."""
    return ModelConfig()


def small() -> ModelConfig:
    """Multi30k-sized corpora: 3+3 layers, 256 wide, FFN 1024, 4 heads."""
    return ModelConfig(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3)


def base() -> ModelConfig:
    """Transformer base (the paper): 6+6 layers, 512, FFN 2048, 8 heads."""
    return ModelConfig(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6, dropout=0.1)


def big() -> ModelConfig:
    """Transformer big (the paper): 6+6 layers, 1024, FFN 4096, 16 heads, dropout 0.3."""
    return ModelConfig(d_model=1024, num_heads=16, d_ff=4096, num_encoder_layers=6, num_decoder_layers=6, dropout=0.3)


def student_mini() -> ModelConfig:
    """A student of 4+4 x 128 teachers (the multi30k-cpu recipe's): a deep encoder and one decoder
    layer (Kasai et al. 2021: decoding time is the decoder's, quality the encoder's)."""
    return ModelConfig(d_model=128, num_heads=4, d_ff=256, num_encoder_layers=4, num_decoder_layers=1, dropout=0.1)


def student_base() -> ModelConfig:
    """A student of base-sized teachers, in the spirit of Bergamot's "tiny" (256 wide, FFN 1536,
    6 encoder and 2 decoder layers; theirs has SSRU decoder layers, these are attention)."""
    return ModelConfig(d_model=256, num_heads=8, d_ff=1536, num_encoder_layers=6, num_decoder_layers=2, dropout=0.1)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "mini": mini,
    "small": small,
    "base": base,
    "big": big,
    "student_mini": student_mini,
    "student_base": student_base,
}


def preset(name: str) -> ModelConfig:
    """The model preset called `name`."""
    check(name in PRESETS, f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
