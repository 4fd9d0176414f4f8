"""Test helpers: tiny random Hugging Face translation models saved as their hubs ship them
(OPUS-MT's Marian directories), with SentencePiece models trained here on built-in corpus text.
transformers is the reference; nothing is downloaded."""

import functools
import io
import json
from pathlib import Path
from typing import Sequence

import sentencepiece as spm
import torch

from raymt.data.builtin import generate


@functools.lru_cache(maxsize=None)
def opus_spm(lang: str, vocab_size: int = 200) -> bytes:
    """A SentencePiece model as OPUS-MT's source.spm/target.spm are (unk 0, <s> 1, </s> 2, no pad)."""
    src, tgt = generate(400, "en", lang if lang != "en" else "de", seed=2)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(src if lang == "en" else tgt),
        model_writer=buffer,
        vocab_size=vocab_size,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return buffer.getvalue()


def opus_vocab(source: bytes, target: bytes, codes: Sequence[str] = ()) -> dict[str, int]:
    """Marian's joint vocab.json: </s> 0, <unk> 1, the language codes, both models' pieces, <pad> last."""
    pieces = ["</s>", "<unk>", *(f">>{c}<<" for c in codes)]
    for proto in (source, target):
        sp = spm.SentencePieceProcessor(model_proto=proto)
        ordinary = [i for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_unknown(i)]
        pieces += [sp.id_to_piece(i) for i in ordinary]
    pieces = list(dict.fromkeys(pieces)) + ["<pad>"]
    return {p: i for i, p in enumerate(pieces)}


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Layer norms and biases away from their init, so that a weight copied wrong shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=g))


def save_opus_mt(
    directory: Path,
    codes: Sequence[str] = (),
    tie: bool = True,
    activation: str = "swish",
    langs: tuple[str, str] = ("en", "de"),
    seed: int = 0,
) -> Path:
    """A random tiny MarianMTModel in OPUS-MT's configuration (swish, scaled embeddings, decoder
    start = pad, final_logits_bias) with its tokenizer files, as `save_pretrained` writes it."""
    import transformers

    source, target = opus_spm(langs[0]), opus_spm(langs[1])
    vocab = opus_vocab(source, target, codes)
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab),
        decoder_vocab_size=len(vocab),
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        activation_function=activation,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=64,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=tie,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    perturb(model, seed)
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)
        if not tie:  # transformers 5 unties every embedding: one for both stacks, a separate output
            for stack in (model.model.encoder, model.model.decoder):
                stack.embed_tokens.weight.copy_(model.model.shared.weight)
    directory.mkdir(parents=True, exist_ok=True)
    model.generation_config.update(bad_words_ids=[[pad]], num_beams=4, max_length=64)
    model.save_pretrained(str(directory))
    (directory / "source.spm").write_bytes(source)
    (directory / "target.spm").write_bytes(target)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer_config = {"source_lang": langs[0], "target_lang": langs[1], "separate_vocabs": False}
    tokenizer_config.update(tokenizer_class="MarianTokenizer", model_max_length=64)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory
