"""Batch shapes on GPU/compiled runs: an epoch of WMT-like lengths takes few (B, S, T) shapes,
padding rows carry no loss, and the idle worker's dummy batch is one of the shapes."""

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymt.batching import ShapeLadder, chunk_batches
from raymt.config import Config, DataConfig, ModelConfig, tiny
from raymt.data.epoch import Mix, Position, restore_position
from raymt.data.stream import TrainStream
from raymt.flags import build_config
from raymt.model import Transformer
from raymt.optim import loss_sum, make_optimizer
from raymt.tokenizer import EOS_ID, PAD_ID
from raymt.train import parse_args
from raymt.trainer import compile_model, train_step

VOCAB = 64


def wmt_like(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """WMT-like token lengths: lognormal source (median 22, 1..200), target ~1.08x longer."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.lognormal(np.log(22), 0.65, n)), 1, 200).astype(np.int64)
    tgt = np.clip(np.round(src * rng.lognormal(0.08, 0.2, n)), 1, 200).astype(np.int64)
    return src, tgt


def write_shard(path, src_lens, tgt_lens, seed=0) -> Mix:
    """One Parquet shard of random ids with the given lengths (the prepared-corpus layout), as one pair's `Mix`."""
    rng = np.random.default_rng(seed)

    def column(lens):
        values = pa.array(rng.integers(4, VOCAB, int(lens.sum())).astype(np.int32))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        return pa.ListArray.from_arrays(offsets, values)

    pq.write_table(pa.table({"src_ids": column(src_lens), "tgt_ids": column(tgt_lens)}), path, row_group_size=8192)
    return Mix.of_shards([(str(path), len(src_lens))])


def gpu_data() -> DataConfig:
    """The data section `raymt train --gpu` runs with (config.device_defaults)."""
    return build_config(parse_args(["--gpu"])).data


def real_pairs(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(src without EOS, tgt) of each row that is not an all-PAD padding row."""
    out = []
    for s, t in zip(batch.src.tolist(), batch.tgt_out.tolist()):
        if t[0] != PAD_ID:
            out.append((tuple(s[: s.index(EOS_ID)]), tuple(t[: t.index(EOS_ID)])))
    return out


def test_an_epoch_of_wmt_like_lengths_takes_at_most_16_shapes(tmp_path):
    # 60k pairs, one epoch of --gpu batches (32k tokens, widths of 8) through the worker's stream.
    src_lens, tgt_lens = wmt_like(60_000)
    files = write_shard(tmp_path / "part-00000.parquet", src_lens, tgt_lens)
    cfg = gpu_data()
    batches = list(TrainStream(files, cfg, seed=1, rank=0, world_size=1, position=Position(0)))
    shapes = Counter((b.src.shape[0], b.src.shape[1], b.tgt_out.shape[1]) for b in batches)
    # Free row counts (the old cut): 30 shapes in 73 batches here (the issue: 46 in 145).
    assert len(shapes) <= 16, sorted(shapes)
    assert all(rows * max(s, t) <= cfg.max_tokens for rows, s, t in shapes)  # memory stays bounded
    real = int((src_lens + 1).sum() + (tgt_lens + 1).sum())
    padded = sum(b.src.numel() + b.tgt_out.numel() for b in batches)
    # Measured: 0.72 of the tensors are real tokens (0.78 with free rows and widths of 8).
    assert real / padded > 0.68, real / padded
    assert sum(b.num_tokens for b in batches) == int((tgt_lens + 1).sum())  # padding rows count 0
    assert sum(len(real_pairs(b)) for b in batches) == len(src_lens)  # every pair once


def test_the_dummy_batch_of_an_idle_worker_has_a_shape_of_the_ladder():
    cfg = build_config(parse_args(["--gpu"]))
    torch.manual_seed(0)
    model = Transformer(tiny(), vocab_size=VOCAB)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append((args[0].shape, args[1].shape)))
    # An empty group: this worker ran out and steps on the dummy batch, weighted zero.
    total, applied = train_step(model, make_optimizer(model, cfg.optim), [], 1000, cfg)
    [(src_shape, tgt_shape)] = seen
    rows, width = src_shape
    assert tgt_shape == src_shape and width % cfg.data.pad_multiple == 0
    assert rows == cfg.data.max_tokens // width  # a rung of the ladder: (max_tokens // width, width)
    assert float(total) == 0.0 and float(applied) == 1.0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.slow  # ~2 s: inductor (CI runs it: .ci/run; the default suite stays under 5 min)
@pytest.mark.ci
def test_a_compiled_model_compiles_nothing_new_for_the_dummy_batch(tmp_path):
    """The old one-token dummy batch (rows 1, a size torch.compile specializes) recompiled
    when a worker ran out at an epoch's end; on the ladder it is a shape already handled."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    src_lens, tgt_lens = wmt_like(150, seed=4)
    files = write_shard(tmp_path / "part.parquet", np.minimum(src_lens, 30), np.minimum(tgt_lens, 30))
    one_layer = ModelConfig(
        d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0
    )  # little to trace
    cfg = Config(model=one_layer, data=DataConfig(max_tokens=512, max_len=30, pad_multiple=8, shape_buckets=4))
    torch.manual_seed(0)
    model = Transformer(cfg.model, vocab_size=VOCAB)
    optimizer = make_optimizer(model, cfg.optim)
    compiled = compile_model(model, backend=counting_backend)
    shapes = set()
    for batch in TrainStream(files, cfg.data, seed=0, rank=0, world_size=1, position=Position(0)):
        train_step(compiled, optimizer, [batch], batch.num_tokens, cfg)
        shapes.add(batch.src.shape)
        if len(shapes) == 3:  # torch.compile has made rows and widths dynamic by now
            break
    assert graphs and len(shapes) == 3, (graphs, shapes)
    before = len(graphs)
    train_step(compiled, optimizer, [], 1, cfg)  # this worker ran out: the dummy step
    assert len(graphs) == before, graphs


def test_padding_rows_and_columns_change_no_loss_or_token_count(tmp_path):
    src_lens, tgt_lens = wmt_like(400, seed=2)
    src_lens, tgt_lens = np.minimum(src_lens, 30), np.minimum(tgt_lens, 30)
    files = write_shard(tmp_path / "part.parquet", src_lens, tgt_lens, seed=2)
    free = DataConfig(max_tokens=512, max_len=30, pad_multiple=8)
    laddered = DataConfig(max_tokens=512, max_len=30, pad_multiple=8, shape_buckets=4)
    read = lambda cfg: list(TrainStream(files, cfg, seed=0, rank=0, world_size=1, position=Position(0)))
    torch.manual_seed(0)
    model = Transformer(tiny(), vocab_size=VOCAB).eval()
    for a, b in zip(read(free), read(laddered)):
        assert real_pairs(a) == real_pairs(b) and a.num_tokens == b.num_tokens
        assert b.src.shape[0] >= a.src.shape[0] and b.src.shape[1] >= a.src.shape[1]
        with torch.no_grad():
            loss_a = loss_sum(model(a.src, a.tgt_in), a.tgt_out, 0.1)
            loss_b = loss_sum(model(b.src, b.tgt_in), b.tgt_out, 0.1)
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("stop_after", [1, 4])
def test_a_laddered_stream_resumes_exactly(tmp_path, stop_after):
    src_lens, tgt_lens = wmt_like(3000, seed=3)
    files = write_shard(tmp_path / "part.parquet", src_lens, tgt_lens, seed=3)
    cfg = DataConfig(
        max_tokens=2048, max_len=200, pad_multiple=8, shape_buckets=6, window_rows=500, shuffle_buffer_rows=1000
    )
    stream = lambda position: TrainStream(files, cfg, seed=5, rank=0, world_size=2, position=position)
    full = [real_pairs(b) for b in stream(Position(2))]
    first, head = stream(Position(2)), []
    for b in first:
        head.append(real_pairs(b))
        if len(head) == stop_after:
            break
    first.close()
    position = restore_position([first.position.to_dict(), Position(2).to_dict()], 0, 2, 2)
    assert head + [real_pairs(b) for b in stream(position)] == full


def test_the_gpu_and_compiled_defaults_turn_the_ladder_on_and_the_cpu_keeps_free_shapes():
    assert build_config(parse_args([])).data.shape_buckets == 0
    assert gpu_data().shape_buckets > 0
    assert build_config(parse_args(["--set", "train.compile=true"])).data.shape_buckets > 0
    assert build_config(parse_args(["--gpu", "--set", "data.shape_buckets=0"])).data.shape_buckets == 0
    with pytest.raises(ValueError, match="data.shape_buckets=1 must be 0"):
        DataConfig(shape_buckets=1)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 120), st.integers(1, 120)), min_size=1, max_size=300),
    st.integers(2, 10),
    st.sampled_from([1, 8]),
    st.integers(0, 2**32 - 1),
)
def test_laddered_batches_keep_every_row_once_on_at_most_shape_buckets_shapes(lens, buckets, multiple, seed):
    cfg = DataConfig(max_tokens=512, max_len=120, pad_multiple=multiple, shape_buckets=buckets)
    ladder = ShapeLadder.from_config(cfg)
    assert len(ladder.widths) <= buckets and ladder.widths[-1] >= cfg.max_len + 1
    assert all(w % multiple == 0 for w in ladder.widths)
    src_lens = np.array([s for s, _ in lens]) + 1  # EOS / BOS included
    tgt_lens = np.array([t for _, t in lens]) + 1
    batches = chunk_batches(src_lens, tgt_lens, 100, cfg.max_tokens, np.random.default_rng(seed), ladder=ladder)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(lens)))
    for b in batches:
        rows, width = ladder.shape(int(max(src_lens[b].max(), tgt_lens[b].max())))
        assert width in ladder.widths and len(b) <= rows and rows * width <= cfg.max_tokens
