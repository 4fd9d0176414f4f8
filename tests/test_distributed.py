"""Distribution on a real 2-worker Ray Train run (gloo): gradients, split outputs, lockstep."""

import sys

import pytest
import torch

from raymt.batching import collate
from raymt.config import Config, tiny
from raymt.model import Transformer
from raymt.trainer import lockstep, train_step, unwrap

pytestmark = pytest.mark.timeout(300)

VOCAB = 64


def make_rows(n, seed):
    """Rows of very different lengths: src ends in EOS, tgt is raw ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (2, n), generator=g)
    src = [torch.randint(4, VOCAB, (int(k),), generator=g).tolist() + [3] for k in lengths[0]]
    tgt = [torch.randint(4, VOCAB, (int(k),), generator=g).tolist() for k in lengths[1]]
    return src, tgt


def fresh_model(cfg):
    torch.manual_seed(0)
    return Transformer(cfg.model, VOCAB)


def sgd(model):
    # SGD (lr 1) makes the parameter change equal the gradient; Adam's first step is
    # about lr * sign(grad), which turns float noise in near-zero gradients into lr-sized jumps.
    return torch.optim.SGD(model.parameters(), lr=1.0)


def run_steps(model, groups, cfg, collective, device="cpu"):
    """Train on per-step groups through `lockstep` + `train_step`; returns the step count."""
    opt = sgd(model)
    flat = [b for g in groups for b in g]
    steps = 0
    for update in lockstep(flat, cfg.optim.update_freq, torch.device(device), collective):
        _, applied = train_step(model, opt, update.batches, update.num_tokens, cfg, world_size=collective.world_size)
        assert applied.item() == 1
        steps += 1
    return steps


def worker_loop(loop_config):
    """Runs on each Ray Train worker."""
    import ray.train
    import ray.train.torch

    from raymt.distributed import TorchCollective

    cfg = Config.from_dict(loop_config["config"])
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(fresh_model(cfg))
    src, tgt = loop_config["src"][rank], loop_config["tgt"][rank]
    micro = [collate(src[i : i + 3], tgt[i : i + 3]) for i in range(0, len(src), 3)]
    model.eval()
    with torch.no_grad():
        outputs = [model(b.src, b.tgt_in) for b in micro]
    steps = run_steps(model, [micro], cfg, TorchCollective())
    torch.save(
        {"outputs": outputs, "steps": steps, "params": unwrap(model).state_dict()},
        f"{loop_config['out']}/rank{rank}.pt",
    )
    ray.train.report({"steps": steps})


def fit_two_workers(tmp_path, cfg, src_parts, tgt_parts):
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    TorchTrainer(
        worker_loop,
        train_loop_config={"config": cfg.to_dict(), "src": src_parts, "tgt": tgt_parts, "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path / "ray")),
    ).fit()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.slow  # ~20 s: a 2-worker Ray Train run (CI runs it: .ci/run)
@pytest.mark.ci
def test_two_workers_match_one_process_on_the_union(ray_cluster, tmp_path):
    """Gradient equivalence, split-output equivalence and lockstep under uneven shards."""
    cfg = Config(model=tiny())
    cfg.optim.update_freq = 2
    src, tgt = make_rows(21, seed=1)
    # Rank 0 gets 15 rows (5 micro-batches -> 3 updates), rank 1 gets 6 (2 -> 1 update):
    # rank 1 must take dummy steps and nobody may hang.
    parts_src, parts_tgt = [src[:15], src[15:]], [tgt[:15], tgt[15:]]
    results = fit_two_workers(tmp_path, cfg, parts_src, parts_tgt)
    assert [r["steps"] for r in results] == [3, 3]

    # Reference: one process, each update on the union of both workers' micro-batches.
    reference = fresh_model(cfg)
    micro = [[collate(s[i : i + 3], t[i : i + 3]) for i in range(0, len(s), 3)] for s, t in zip(parts_src, parts_tgt)]
    reference.eval()
    with torch.no_grad():
        for rank in range(2):
            for batch, out in zip(micro[rank], results[rank]["outputs"]):
                torch.testing.assert_close(out, reference(batch.src, batch.tgt_in), atol=1e-5, rtol=1e-5)
        # The same rows decoded as one unsplit batch give the same outputs row by row.
        whole = collate(src, tgt)
        full = reference(whole.src, whole.tgt_in)
        for rank, offset in ((0, 0), (1, 15)):
            for j, (batch, out) in enumerate(zip(micro[rank], results[rank]["outputs"])):
                for i in range(out.size(0)):
                    n = int((batch.tgt_out[i] != 0).sum())
                    torch.testing.assert_close(out[i, :n], full[offset + 3 * j + i, :n], atol=1e-5, rtol=1e-5)

    opt = sgd(reference)
    updates = [(micro[0][k : k + 2], micro[1][k : k + 2]) for k in range(0, 6, 2)]
    for mine, theirs in updates:
        group = mine + theirs
        train_step(reference, opt, group, sum(b.num_tokens for b in group), cfg)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(results[0]["params"][name], value, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[1]["params"][name], results[0]["params"][name])


def test_default_scaling_leaves_a_cpu_for_ray_data(ray_cluster):
    """2 workers on 2 CPUs take half a CPU each, so Ray Data always has one to run on."""
    from raymt.train import scaling

    workers = scaling(Config())
    assert workers.resources() == {"CPU": 0.5} and workers.num_threads == 1
    cfg = Config()
    cfg.train.num_workers = 3
    cfg.train.cpus_per_worker = 1.0
    with pytest.raises(ValueError, match="needs 3 CPUs but the cluster's 2 CPUs leave 1"):
        scaling(cfg)
    cfg.train.cpus_per_worker = None
    cfg.train.num_workers = 8  # 8 x the 0.25-CPU minimum does not fit either
    with pytest.raises(ValueError, match="needs 2 CPUs"):
        scaling(cfg)
    cfg.train.num_workers = 3
    cfg.train.use_gpu = True
    with pytest.raises(ValueError, match="needs 3 GPUs; the cluster has 0"):
        scaling(cfg)
