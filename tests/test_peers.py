"""benchmarks/peers.py: the Hugging Face MarianMTModel twin computes what the raymt model computes."""

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import peers  # noqa: E402
from benchmarks.peers import marian_logits, marian_train_step, marian_translate, to_marian  # noqa: E402
from raymt.batching import collate  # noqa: E402
from raymt.config import Config, ModelConfig, OptimConfig  # noqa: E402
from raymt.decoding import DecodeOptions, decode, length_batches, pad_batch  # noqa: E402
from raymt.model import Transformer  # noqa: E402
from raymt.optim import loss_sum, make_optimizer  # noqa: E402
from raymt.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402

VOCAB = 64


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: a second thread only waits on a busy machine (seconds per test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def post_norm_model(activation: str = "relu", layers: int = 2, seed: int = 0) -> Transformer:
    """A random tiny post-norm raymt model without dropout."""
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=layers,
                      num_decoder_layers=layers, dropout=0.0, activation=activation,
                      pre_norm=False, max_positions=64)
    model = Transformer(cfg, VOCAB).eval()
    with torch.no_grad():  # norms away from their (1, 0) init, so that a missed copy shows
        for name, param in model.named_parameters():
            if ".norm." in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


def random_rows(n: int, max_len: int, seed: int) -> list[list[int]]:
    """n random rows of 1..max_len ordinary tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(k),), generator=g).tolist()
            for k in torch.randint(1, max_len + 1, (n,), generator=g)]


def test_pre_norm_model_is_refused():
    cfg = ModelConfig(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)
    with pytest.raises(ValueError, match="post-norm"):
        to_marian(Transformer(cfg, VOCAB))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_teacher_forcing_logits_match(activation):
    model = post_norm_model(activation)
    marian = to_marian(model).eval()
    assert marian.lm_head.weight.data_ptr() == marian.model.encoder.embed_tokens.weight.data_ptr()
    trained = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (model, marian)]
    assert trained[0] == trained[1], "a weight has no counterpart"
    # Rows of different lengths: padding in both the source and the target.
    batch = collate([r + [EOS_ID] for r in random_rows(6, 9, seed=1)], random_rows(6, 7, seed=2))
    assert (batch.src == PAD_ID).any() and (batch.tgt_in == PAD_ID).any()
    with torch.no_grad():
        expected = model(batch.src, batch.tgt_in)
        got = marian_logits(marian, batch.src, batch.tgt_in)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


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


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("beam", [1, 5])
def test_search_matches_raymt(activation, beam):
    """Greedy and beam search (length penalty 0 on both sides) give raymt's ids, in input order."""
    sources = [r + [EOS_ID] for r in random_rows(24, 11, seed=3)]
    model = copy_model(activation)
    ended = 0  # rows that ended by EOS before their length limit forced it
    # raymt's default limits (most rows end by EOS), then tight ones (most are forced to end).
    for batch_size, a, b in ((24, 1.2, 10), (5, 1.2, 10), (5, 0.5, 2)):
        opts = DecodeOptions(beam=beam, length_penalty=0.0, max_len_a=a, max_len_b=b)
        expected: list[list[int]] = [[] for _ in sources]
        for idx in length_batches([len(s) for s in sources], batch_size):
            for i, ids in zip(idx, decode(model, pad_batch([sources[i] for i in idx]), opts)):
                expected[i] = ids
        assert marian_translate(to_marian(model), sources, beam, a, b, batch_size) == expected
        ended += ended_by_eos(expected, sources, a, b)
    assert 0 < ended < 3 * len(sources)


def test_translate_decodes_the_batches_raymt_decodes(monkeypatch):
    """Same length-sorted batches as raymt's translate, so that speeds compare like for like."""
    sources = [r + [EOS_ID] for r in random_rows(11, 9, seed=6)]
    seen = []
    monkeypatch.setattr(peers, "marian_generate",
                        lambda model, src, *args: seen.append(src.tolist()) or [[] for _ in src])
    marian_translate(to_marian(post_norm_model()), sources, beam_size=5, batch_size=4)
    assert seen == [pad_batch([sources[i] for i in idx]).tolist()
                    for idx in length_batches([len(s) for s in sources], 4)]


def test_train_steps_match_raymt():
    """Two updates of the twin equal two raymt `train_step`s (label smoothing, clipping, AdamW)."""
    from raymt.trainer import train_step

    model = post_norm_model("gelu")
    marian = to_marian(model)
    cfg = Config(model=model.cfg, optim=OptimConfig(lr=1e-3, clip_norm=0.5))
    ours, theirs = make_optimizer(model, cfg.optim), make_optimizer(marian, cfg.optim)
    for seed in (4, 5):
        batch = collate([r + [EOS_ID] for r in random_rows(6, 9, seed)], random_rows(6, 7, seed + 10))
        train_step(model, ours, [batch], batch.num_tokens, cfg)
        assert marian_train_step(marian, theirs, batch, cfg.optim.label_smoothing,
                                 cfg.optim.clip_norm) == batch.num_tokens
    expected = to_marian(model).state_dict()
    for name, value in marian.state_dict().items():
        # Key biases shift every score of a softmax row equally: their exact gradient is 0, and
        # Adam turns the float noise left in it into steps of up to lr, different on each side.
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5, msg=name)
