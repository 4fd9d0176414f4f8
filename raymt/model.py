"""Encoder-decoder Transformer (Vaswani et al. 2017) in plain single-device PyTorch.

Masks are built inside `forward`/`encode` from the tokens the module actually receives,
so a batch split across devices (DDP, DataParallel) can never carry a mask shaped for
the whole batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from raymt.config import ModelConfig
from raymt.tokenizer import PAD_ID

# Incremental decoding state: {"length": int, "layers": [{"self": {...}, "cross": {...}}]}.
Cache = dict


def sinusoids(num_positions: int, dim: int) -> torch.Tensor:
    """Sinusoidal position table (num_positions, dim), sin on even and cos on odd dims."""
    position = torch.arange(num_positions, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(num_positions, dim)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table


def fairseq_sinusoids(num_positions: int, dim: int) -> torch.Tensor:
    """fairseq's table (M2M-100, NLLB) as (num_positions, dim) rows for positions 0, 1, ...: sin in
    the first half, cos in the second, frequencies 10000^(-i / (dim/2 - 1)); fairseq numbers the
    first token padding_idx + 1 = 2, so row 0 here is its position 2."""
    half = dim // 2
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    angles = torch.arange(2, num_positions + 2, dtype=torch.float32)[:, None] * inv_freq[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def halves_order(d_model: int) -> torch.Tensor:
    """(D,) raymt's dims in the layout of HF Marian's and fairseq's tables (sin in the first half,
    cos in the second): the even dims (sin), then the odd dims (cos)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def position_table(cfg: ModelConfig) -> torch.Tensor:
    """(max_positions, D) position encodings of `cfg.positions`."""
    make = fairseq_sinusoids if cfg.positions == "fairseq" else sinusoids
    return make(cfg.max_positions, cfg.d_model)


class Dropout(nn.Module):
    """nn.Dropout, with masks drawn from 16 random bits per element on CPU.

    On CPU, torch's bernoulli_ samples one element at a time, a visible share of a small
    model's training step; raw 64-bit words from the same generator, cut into 16-bit lanes,
    need a quarter of the random draws (benchmarks/NOTES.md). The rate is p rounded to 1/65536.
    Elsewhere (GPU) F.dropout's fused kernel is used as is.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.threshold = round(p * 65536)  # drop where a uniform 16-bit lane < threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x with elements zeroed at rate p and the rest scaled by 1 / (1 - p)."""
        if not self.training or self.threshold == 0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, True)
        n = x.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)
        lanes = words.view(torch.int16)[:n].view(x.shape)  # uniform over [-32768, 32767]
        keep = (lanes >= self.threshold - 32768).to(x.dtype)
        return x * keep.mul_(65536 / (65536 - self.threshold))


class Attention(nn.Module):
    """Multi-head attention through `scaled_dot_product_attention`, with an optional K/V cache."""

    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)  # K and V in one matmul
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (B, T, D) -> (B, H, T, D/H)
        return x.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        memory: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        cache: Optional[dict] = None,
    ) -> torch.Tensor:
        """Self-attention over `x` (memory None) or cross-attention from `x` to `memory`."""
        b, t, d = x.shape
        q = self._heads(self.q_proj(x))
        if memory is not None and cache is not None and "k" in cache:
            k, v = cache["k"], cache["v"]  # cross-attention K/V are computed once
        else:
            k, v = (self._heads(z) for z in self.kv_proj(x if memory is None else memory).chunk(2, -1))
            if cache is not None:
                if memory is None and "k" in cache:  # self-attention K/V grow per step
                    k = torch.cat([cache["k"], k], dim=2)
                    v = torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        if is_causal and cache is not None and k.size(2) > t:
            # T new queries after cached keys: query i sees keys up to L + i (is_causal would align
            # the mask top-left, hiding cached keys from the later queries). (T, L + T)
            mask, is_causal = torch.ones(t, k.size(2), dtype=torch.bool, device=q.device).tril(k.size(2) - t), False
        # torch 2.13's bf16 flash-attention backward on a CPU costs ~7x fp32's once a side
        # reaches 12 tokens (benchmarks/NOTES.md, issue 47): attention trains in fp32 there,
        # the matmuls around it stay in bf16.
        fp32 = q.is_cpu and q.requires_grad and torch.is_autocast_enabled("cpu")
        if fp32:
            q, k, v = q.float(), k.float(), v.float()
        with torch.autocast("cpu", enabled=False) if fp32 else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0
            )
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """Position-wise two-layer MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.activation = {"gelu": F.gelu, "swish": F.silu}.get(cfg.activation, F.relu)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class Residual(nn.Module):
    """Residual connection around a sublayer, with pre- or post-layer-norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        """x + sublayer(x), normalized before (pre-norm) or after (post-norm)."""
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg)
        self.res1, self.res2 = Residual(cfg), Residual(cfg)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """(B, S, D) -> (B, S, D)."""
        x = self.res1(x, lambda h: self.self_attn(h, mask=src_mask))
        return self.res2(x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder memory, feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
        self.cross_attn = Attention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg)
        self.res1, self.res2, self.res3 = Residual(cfg), Residual(cfg), Residual(cfg)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: Optional[dict] = None
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); with a cache, T new positions follow the cached ones."""
        # Right padding means a causal mask alone keeps real positions off padding. Without a
        # cache the answer needs no shape (a size test under torch.compile breaks the graph).
        causal = cache is None or x.size(1) > 1
        self_cache = None if cache is None else cache["self"]
        cross_cache = None if cache is None else cache["cross"]
        x = self.res1(x, lambda h: self.self_attn(h, is_causal=causal, cache=self_cache))
        x = self.res2(x, lambda h: self.cross_attn(h, memory, mask=src_mask, cache=cross_cache))
        return self.res3(x, self.ffn)


class Transformer(nn.Module):
    """Encoder-decoder Transformer with one embedding for source and target (or, with
    `cfg.target_vocab_size`, a target embedding of the decoder's own ids), tied to the output
    unless `cfg.tie_output` is false."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size  # source ids (and target ids when shared)
        self.target_vocab_size = cfg.target_vocab_size or vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.register_buffer("positions", position_table(cfg), persistent=False)
        # Imported models' options (raymt.hf_import); absent from raymt's own state dicts.
        separate = cfg.target_vocab_size is not None
        self.target_embed = nn.Embedding(self.target_vocab_size, cfg.d_model, padding_idx=PAD_ID) if separate else None
        self.output = None if cfg.tie_output else nn.Linear(cfg.d_model, self.target_vocab_size, bias=False)
        if cfg.output_bias:  # fixed, as Marian's final_logits_bias: fine-tuning leaves it
            self.register_buffer("output_bias", torch.zeros(self.target_vocab_size))
        else:
            self.output_bias = None
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers))
        # Pre-norm stacks end with a norm; post-norm layers already end normalized.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, N(0, d^-1/2) embeddings with a zero padding row."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for embed in (self.embed, self.target_embed):
            if embed is not None:
                nn.init.normal_(embed.weight, std=self.cfg.d_model**-0.5)
                with torch.no_grad():
                    embed.weight[PAD_ID].zero_()

    def target_embedding(self) -> nn.Embedding:
        """The decoder's input embedding: the shared one, or the target's own."""
        return self.embed if self.target_embed is None else self.target_embed

    def output_weight(self) -> torch.Tensor:
        """(V_tgt, D) the output projection: the decoder's embedding, or an untied matrix."""
        return self.target_embedding().weight if self.output is None else self.output.weight

    def _embed(self, tokens: torch.Tensor, start: int = 0, table: Optional[nn.Embedding] = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, D) scaled embeddings (of `table`, else the source's) plus positions
        start..start+T-1."""
        t = tokens.size(1)
        if start + t > self.cfg.max_positions:
            raise ValueError(f"sequence of {start + t} tokens exceeds model.max_positions={self.cfg.max_positions}")
        x = (self.embed if table is None else table)(tokens) * self.embed_scale + self.positions[start : start + t]
        return self.dropout(x)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) ids -> memory (B, S, D) and src_mask (B, 1, 1, S), True where attended."""
        src_mask = (src != PAD_ID)[:, None, None, :]
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.encoder_norm(x), src_mask

    def decode(
        self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: Optional[Cache] = None
    ) -> torch.Tensor:
        """(B, T) target ids -> logits (B, T, V_tgt); with a cache, only new tokens are passed."""
        start = 0 if cache is None else cache["length"]
        x = self._embed(tgt, start, self.target_embedding())
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_mask, None if cache is None else cache["layers"][i])
        if cache is not None:
            cache["length"] += tgt.size(1)
        return F.linear(self.decoder_norm(x), self.output_weight(), self.output_bias)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: (B, S) source and (B, T) shifted target ids -> logits (B, T, V)."""
        memory, src_mask = self.encode(src)
        return self.decode(tgt, memory, src_mask)

    def new_cache(self) -> Cache:
        """An empty incremental-decoding cache."""
        return {"length": 0, "layers": [{"self": {}, "cross": {}} for _ in self.decoder]}


def build_model(cfg: ModelConfig, vocab_size: int) -> Transformer:
    """The Transformer of `cfg` over `vocab_size` ids: the one place a model is constructed."""
    return Transformer(cfg, vocab_size)


def reorder_cache(cache: Cache, index: torch.Tensor, parts: tuple[str, ...] = ("self", "cross")) -> None:
    """Select rows `index` of the cached K/V of `parts` in place (beam reordering, pruning)."""
    for layer in cache["layers"]:
        for name in parts:
            part = layer[name]
            for key in part:
                part[key] = part[key].index_select(0, index)
