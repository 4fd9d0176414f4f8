"""The one resource planner (raymt.cluster.plan): shares derived from the cluster, one-line errors."""

import pytest

from raymt.cluster import data_cpus, plan


@pytest.mark.parametrize(
    "num_cpus, num, cpus, threads", [(2, 2, 0.5, 1), (8, 2, 3.5, 3), (16, 4, 3.75, 3), (1, 1, 0.5, 1)]
)
def test_workers_share_what_ray_data_leaves(num_cpus, num, cpus, threads):
    workers = plan(num, total={"CPU": num_cpus})
    assert workers.cpus == cpus and workers.num_threads == threads
    assert workers.cpus * num + data_cpus(num_cpus) <= num_cpus
    assert workers.resources() == {"CPU": cpus}


def test_whole_cpus_fit_several_groups():
    """Tune's trials take one CPU per worker when they can, so several trials run at once."""
    trial = plan(2, total={"CPU": 8}, whole_cpus=True)
    assert (trial.cpus, trial.fits) == (1.0, 3)
    assert plan(2, total={"CPU": 2}, whole_cpus=True).cpus == 0.5


def test_a_group_without_ray_data_beside_it_takes_every_cpu():
    """Back-translation's actors: the driver reads the input, so no CPU is kept for Ray Data."""
    actors = plan(2, total={"CPU": 2}, keep_cpus=0)
    assert (actors.cpus, actors.num_threads) == (1.0, 1)
    assert plan(2, total={"CPU": 8}, keep_cpus=0).num_threads == 4
    with pytest.raises(ValueError, match="needs 3 CPUs but the cluster has 2 CPUs: lower"):
        plan(3, cpus_each=1.0, total={"CPU": 2}, keep_cpus=0)


def test_gpu_workers():
    workers = plan(2, use_gpu=True, total={"CPU": 4, "GPU": 4})
    assert workers.resources() == {"CPU": 1.0, "GPU": 1} and workers.fits == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num": 8}, "train.num_workers=8 x 0.25 CPUs needs 2 CPUs but the cluster's 2 CPUs leave 1"),
        ({"num": 2, "cpus_each": 1.0}, "needs 2 CPUs but the cluster's 2 CPUs leave 1"),
        ({"num": 3, "use_gpu": True}, "train.num_workers=3 with --gpu needs 3 GPUs; the cluster has 0"),
        ({"num": 5, "what": "--num-actors 5", "fix": "lower --num-actors"}, "--num-actors 5 x 0.25 CPUs"),
    ],
)
def test_what_does_not_fit_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        plan(total={"CPU": 2}, **kwargs)
    assert "\n" not in str(err.value)


class GpuNodes:
    """A fixed cluster of the given nodes' resources (RayCluster's `resources` and `nodes`)."""

    def __init__(self, *nodes: dict):
        self.per_node = list(nodes)

    def resources(self) -> dict:
        return {k: sum(n.get(k, 0) for n in self.per_node) for k in ("CPU", "GPU")}

    def nodes(self) -> list[dict]:
        return self.per_node


def test_cpus_per_gpu_worker_are_checked_per_node():
    """--gpu with train.cpus_per_worker: each GPU worker's CPUs must be on its GPU's node."""
    head, gpu_node = {"CPU": 64}, {"CPU": 8, "GPU": 4}  # 2 CPUs a GPU on the GPU node
    assert plan(4, use_gpu=True, cpus_each=2.0, cluster=GpuNodes(head, gpu_node)).cpus == 2.0
    with pytest.raises(ValueError) as err:  # the head's CPUs are of no use to a GPU worker
        plan(4, use_gpu=True, cpus_each=3.0, cluster=GpuNodes(head, gpu_node))
    assert "\n" not in str(err.value)
    assert "GPU nodes hold 2 workers of 3 CPUs and a GPU" in str(err.value) and "train.cpus_per_worker" in str(
        err.value
    )
    with pytest.raises(ValueError, match="no GPU node has 16 CPUs .the most is 8.: lower train.cpus_per_worker"):
        plan(1, use_gpu=True, cpus_each=16.0, cluster=GpuNodes(head, gpu_node))


def test_cpus_per_gpu_worker_are_checked_against_the_total_without_nodes():
    with pytest.raises(ValueError, match=r"x 4 CPUs needs 8 CPUs; the cluster has 6: lower train.cpus_per_worker"):
        plan(2, use_gpu=True, cpus_each=4.0, total={"CPU": 6, "GPU": 2})
    assert plan(2, use_gpu=True, cpus_each=3.0, total={"CPU": 6, "GPU": 2}).cpus == 3.0
