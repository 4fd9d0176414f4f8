"""Test helpers: tiny random Hugging Face translation models saved as their hubs ship them
(OPUS-MT's Marian directories, NLLB's M2M-100 ones), with SentencePiece models trained here on built-in corpus text.
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


def opus_separate_vocabs(source: bytes, target: bytes, codes: Sequence[str] = ()) -> tuple[dict, dict]:
    """Marian's separate vocab.json and target_vocab.json (of another size): </s> 0, <unk> 1, the
    language codes (source), each model's pieces; <pad> last in the source's and at the same id in
    the target's (config.json's pad_token_id is both stacks')."""
    vocabs = []
    for proto, extra in ((source, codes), (target, ())):
        sp = spm.SentencePieceProcessor(model_proto=proto)
        ordinary = [
            sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_unknown(i)
        ]
        vocabs.append(list(dict.fromkeys(["</s>", "<unk>", *(f">>{c}<<" for c in extra), *ordinary])))
    source_pieces, target_pieces = vocabs
    pad = len(source_pieces)
    assert len(target_pieces) > pad, "the target's vocabulary must be the larger (its <pad> at the source's id)"
    source_pieces.append("<pad>")
    target_pieces.insert(pad, "<pad>")
    return {p: i for i, p in enumerate(source_pieces)}, {p: i for i, p in enumerate(target_pieces)}


# Both families' test models: d=16, 2+2 layers, no dropout (outputs compare exactly).
TINY_SHAPE = dict(
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


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
    separate: bool = False,
) -> Path:
    """A random tiny MarianMTModel in OPUS-MT's configuration (swish, scaled embeddings, decoder
    start = pad, final_logits_bias) with its tokenizer files, as `save_pretrained` writes it;
    `separate`: separate vocabularies of different sizes (target_vocab.json, the decoder's own embedding)."""
    import transformers

    source, target = opus_spm(langs[0]), opus_spm(langs[1], 300 if separate else 200)
    if separate:
        vocab, target_vocab = opus_separate_vocabs(source, target, codes)
    else:
        vocab = target_vocab = opus_vocab(source, target, codes)
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab),
        decoder_vocab_size=len(target_vocab),
        **TINY_SHAPE,
        activation_function=activation,
        max_position_embeddings=64,
        scale_embedding=True,
        share_encoder_decoder_embeddings=not separate,
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
        if not tie and not separate:  # transformers 5 unties every embedding: one for both stacks, a separate output
            for stack in (model.model.encoder, model.model.decoder):
                stack.embed_tokens.weight.copy_(model.model.shared.weight)
    directory.mkdir(parents=True, exist_ok=True)
    model.generation_config.update(bad_words_ids=[[pad]], num_beams=4, max_length=64)
    transformers.utils.logging.disable_progress_bar()  # no bar on stderr, where tests read one-line errors
    model.save_pretrained(str(directory))
    (directory / "source.spm").write_bytes(source)
    (directory / "target.spm").write_bytes(target)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    if separate:
        (directory / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False))
    tokenizer_config = {"source_lang": langs[0], "target_lang": langs[1], "separate_vocabs": separate}
    tokenizer_config.update(tokenizer_class="MarianTokenizer", model_max_length=64)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


NLLB_CODES = ("eng_Latn", "deu_Latn", "fra_Latn", "spa_Latn")


@functools.lru_cache(maxsize=None)
def nllb_spm(vocab_size: int = 300) -> bytes:
    """A BPE SentencePiece model as NLLB's sentencepiece.bpe.model is (unk 0, <s> 1, </s> 2, no
    pad), trained on built-in English, German, French and Spanish text."""
    text: list[str] = []
    for lang in ("de", "fr", "es"):
        src, tgt = generate(300, "en", lang, seed=2)
        text += src + tgt
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=buffer,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return buffer.getvalue()


def save_nllb(directory: Path, codes: Sequence[str] = NLLB_CODES, extra_rows: int = 2, seed: int = 0) -> Path:
    """A random tiny NLLB-200 (`save_m2m100_model`; `extra_rows` embedding rows past the tokenizer's
    ids, as NLLB-200 has 256206 rows for 256204 ids) with NllbTokenizer's files for `codes`
    (sentencepiece.bpe.model, tokenizer.json, tokenizer_config.json), as `save_pretrained` writes them."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentencepiece.bpe.model").write_bytes(nllb_spm())
    config = {"tokenizer_class": "NllbTokenizer", "extra_special_tokens": list(codes), "src_lang": codes[0]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = transformers.NllbTokenizer.from_pretrained(str(directory))  # converts the SentencePiece model
    tokenizer.save_pretrained(str(directory))
    return save_m2m100_model(directory, len(tokenizer) + extra_rows, seed)


def save_m2m100(directory: Path, seed: int = 0) -> Path:
    """A random tiny M2M-100 (`save_m2m100_model`) with M2M100Tokenizer's files: vocab.json (fairseq's
    dictionary, in an order of its own), sentencepiece.bpe.model and tokenizer_config.json with the
    wmt21 language codes; the embedding also has rows for the codes and 8 "madeup words"."""
    import random

    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentencepiece.bpe.model").write_bytes(nllb_spm())
    sp = spm.SentencePieceProcessor(model_proto=nllb_spm())
    pieces = [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
    random.Random(seed).shuffle(pieces)
    vocab = {p: i for i, p in enumerate(["<s>", "<pad>", "</s>", "<unk>", *pieces])}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer = transformers.M2M100Tokenizer(
        str(directory / "vocab.json"),
        str(directory / "sentencepiece.bpe.model"),
        src_lang="en",
        tgt_lang="de",
        language_codes="wmt21",
    )
    tokenizer.save_pretrained(str(directory))
    return save_m2m100_model(directory, len(vocab) + len(tokenizer.lang_code_to_id) + 8, seed)


def save_m2m100_model(directory: Path, vocab_size: int, seed: int = 0) -> Path:
    """A random tiny M2M100ForConditionalGeneration in NLLB-200's and M2M-100's configuration
    (pre-norm, relu, scaled embeddings, fairseq positions, decoder start </s>) saved in `directory`."""
    import transformers

    config = transformers.M2M100Config(
        vocab_size=vocab_size,
        **TINY_SHAPE,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        max_position_embeddings=64,
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.M2M100ForConditionalGeneration(config).eval()
    perturb(model, seed)
    model.generation_config.update(max_length=64)
    model.save_pretrained(str(directory))
    return directory
