"""`raymt.export --format marian`: the Hugging Face MarianMTModel it writes computes what raymt computes."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from agreement import assert_agree, raymt_scorer  # noqa: E402
from tiny_checkpoint import make_checkpoint, one_thread, tokenizer  # noqa: E402, F401 (autouse fixture)

from raymt import export, exporting  # noqa: E402
from raymt.batching import collate  # noqa: E402
from raymt.checkpoint import save_checkpoint  # noqa: E402
from raymt.config import Config, DataConfig, ModelConfig, OptimConfig  # noqa: E402
from raymt.decoding import DecodeOptions, _max_lengths, decode, length_batches, pad_batch  # noqa: E402
from raymt.model import Transformer  # noqa: E402
from raymt.optim import loss_sum, make_optimizer  # noqa: E402
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402

pytestmark = pytest.mark.hosts  # decoded outputs across engines or hosts: ./run.sh test --hosts

VOCAB = tokenizer().vocab_size
SENTENCES = ["Monday, July 4, 1999", "twelve kilometers and March 3, 2021"]


def post_norm_model(activation: str = "relu", layers: int = 2, seed: int = 0) -> Transformer:
    """A random tiny post-norm raymt model without dropout."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        dropout=0.0,
        activation=activation,
        pre_norm=False,
        max_positions=64,
    )
    model = Transformer(cfg, VOCAB).eval()
    with torch.no_grad():  # norms away from their (1, 0) init, so that a missed copy shows
        for name, param in model.named_parameters():
            if ".norm." in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


def exported(model: Transformer, tmp_path, name: str = "marian"):
    """The model saved as a raymt checkpoint, exported with --format marian, loaded by transformers."""
    config = Config(model=model.cfg, data=DataConfig(vocab_size=VOCAB))
    checkpoint = save_checkpoint(tmp_path / f"{name}-checkpoint", model, config, tokenizer())
    out = tmp_path / name
    assert export.main(["--checkpoint", str(checkpoint), "--output", str(out), "--format", "marian"]) == 0
    marian = transformers.MarianMTModel.from_pretrained(str(out)).eval()
    # transformers 5.24 reloads the (fixed) sinusoid tables as trainable parameters; raymt never trains them.
    for stack in (marian.model.encoder, marian.model.decoder):
        stack.embed_positions.weight.requires_grad_(False)
    return marian


def random_rows(n: int, max_len: int, seed: int) -> list[list[int]]:
    """n random rows of 1..max_len ordinary tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, VOCAB, (int(k),), generator=g).tolist()
        for k in torch.randint(1, max_len + 1, (n,), generator=g)
    ]


def hf_logits(marian, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    """Teacher forcing: (B, S), (B, T) ids -> (B, T, V) logits."""
    return marian(input_ids=src, attention_mask=src != PAD_ID, decoder_input_ids=tgt_in, use_cache=False).logits


def test_pre_norm_model_is_refused(tmp_path, err_lines):
    checkpoint = make_checkpoint(tmp_path / "pre-norm")  # the tiny preset is pre-norm
    out = tmp_path / "out"
    assert export.main(["--checkpoint", str(checkpoint), "--output", str(out), "--format", "marian"]) == 2
    err = err_lines()
    assert len(err) == 1 and "post-norm" in err[0] and "model.pre_norm=false" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_exported_model_has_raymts_logits(activation, tmp_path):
    model = post_norm_model(activation)
    marian = exported(model, tmp_path)
    assert marian.lm_head.weight.data_ptr() == marian.model.encoder.embed_tokens.weight.data_ptr()
    trained = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (model, marian)]
    assert trained[0] == trained[1], "a weight has no counterpart"
    # Rows of different lengths: padding in both the source and the target.
    batch = collate([r + [EOS_ID] for r in random_rows(6, 9, seed=1)], random_rows(6, 7, seed=2))
    assert (batch.src == PAD_ID).any() and (batch.tgt_in == PAD_ID).any()
    with torch.no_grad():
        expected = model(batch.src, batch.tgt_in)
        torch.testing.assert_close(hf_logits(marian, batch.src, batch.tgt_in), expected, atol=1e-5, rtol=1e-5)
        # The in-memory twin (raymt's own position values) agrees too.
        torch.testing.assert_close(
            hf_logits(exporting.to_marian(model), batch.src, batch.tgt_in), expected, atol=1e-5, rtol=1e-5
        )


def test_exported_tokenizer_gives_raymts_ids(tmp_path):
    exported(post_norm_model(), tmp_path)
    hf = transformers.MarianTokenizer.from_pretrained(str(tmp_path / "marian"))
    ours = tokenizer()
    assert hf(SENTENCES)["input_ids"] == [ids + [EOS_ID] for ids in ours.encode_batch(SENTENCES)]
    ids = ours.encode(SENTENCES[1])
    assert hf.decode(ids + [EOS_ID], skip_special_tokens=True) == ours.decode(ids)


def ended_by_eos(outputs: list[list[int]], sources: list[list[int]], a: float, b: int) -> int:
    """Rows that ended with EOS before the length limit a * len + b forced it."""
    return sum(len(out) < int(a * len(src) + b) - 1 for out, src in zip(outputs, sources))


def copy_model(activation: str) -> Transformer:
    """Trained 100 steps to copy (random models never emit EOS); PAD and BOS then outscore EOS."""
    model = post_norm_model(activation, layers=1).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(100):
        rows = random_rows(32, 8, seed=100 + step)
        batch = collate([r + [EOS_ID] for r in rows], rows)
        (loss_sum(model(batch.src, batch.tgt_in), batch.tgt_out, 0.0) / batch.num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        model.embed.weight[[PAD_ID, BOS_ID]] = 1.1 * model.embed.weight[EOS_ID]
    return model.eval()


def hf_search(marian, src: torch.Tensor, limits: torch.Tensor, beam: int) -> list[list[int]]:
    """HF `generate` with raymt's per-sentence limits (EOS only, once a row holds `limit` tokens)."""
    everything = list(range(VOCAB))
    allowed = lambda i, ids: [EOS_ID] if ids.numel() >= int(limits[i]) else everything  # ids: BOS + output
    out = marian.generate(
        input_ids=src,
        attention_mask=src != PAD_ID,
        num_beams=beam,
        do_sample=False,
        max_new_tokens=int(limits.max()),
        early_stopping=True,
        length_penalty=0.0,
        prefix_allowed_tokens_fn=allowed,
    )
    rows = [row[1:] for row in out.tolist()]
    return [row[: row.index(EOS_ID)] if EOS_ID in row else row for row in rows]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("beam", [1, 5])
def test_search_matches_raymt(activation, beam, tmp_path):
    """Greedy and beam search (length penalty 0 on both sides) give raymt's ids."""
    sources = [r + [EOS_ID] for r in random_rows(24, 11, seed=3)]
    model = copy_model(activation)
    marian = exported(model, tmp_path)
    ended = 0  # rows that ended by EOS before their length limit forced it
    # raymt's default limits (most rows end by EOS), then tight ones (most are forced to end).
    for batch_size, a, b in ((24, 1.2, 10), (5, 1.2, 10), (5, 0.5, 2)):
        opts = DecodeOptions(beam=beam, length_penalty=0.0, max_len_a=a, max_len_b=b)
        expected: list[list[int]] = [[] for _ in sources]
        got: list[list[int]] = [[] for _ in sources]
        for idx in length_batches([len(s) for s in sources], batch_size):
            src = pad_batch([sources[i] for i in idx])
            for i, ours, theirs in zip(
                idx, decode(model, src, opts), hf_search(marian, src, _max_lengths(model, src, opts), beam)
            ):
                expected[i], got[i] = ours, theirs
        # Another library's kernels: equal but for ties (tests/agreement.py).
        assert_agree([raymt_scorer(model)], sources, got, expected)
        ended += ended_by_eos(expected, sources, a, b)
    assert 0 < ended < 3 * len(sources)


def test_train_steps_match_raymt(tmp_path):
    """Two updates of the exported model equal two raymt `train_step`s (label smoothing, clipping, AdamW)."""
    from raymt.trainer import train_step

    model = post_norm_model("gelu")
    marian = exported(model, tmp_path, "before").train()
    cfg = Config(model=model.cfg, optim=OptimConfig(lr=1e-3, clip_norm=0.5))
    ours, theirs = make_optimizer(model, cfg.optim), make_optimizer(marian, cfg.optim)
    for seed in (4, 5):
        batch = collate([r + [EOS_ID] for r in random_rows(6, 9, seed)], random_rows(6, 7, seed + 10))
        train_step(model, ours, [batch], batch.num_tokens, cfg)
        loss = loss_sum(hf_logits(marian, batch.src, batch.tgt_in), batch.tgt_out, cfg.optim.label_smoothing)
        (loss / batch.num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(marian.parameters(), cfg.optim.clip_norm)
        theirs.step()
        theirs.zero_grad(set_to_none=True)
    expected = exported(model, tmp_path, "after").state_dict()
    for name, value in marian.state_dict().items():
        # Key biases shift every score of a softmax row equally: their exact gradient is 0, and
        # Adam turns the float noise left in it into steps of up to lr, different on each side.
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5, msg=name)
