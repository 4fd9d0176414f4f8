"""Model presets as functions: tiny, mini (the default), small, base and big."""

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


PRESETS: dict[str, Callable[[], ModelConfig]] = {"tiny": tiny, "mini": mini, "small": small, "base": base, "big": big}


def preset(name: str) -> ModelConfig:
    """The model preset called `name`."""
    check(name in PRESETS, f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
