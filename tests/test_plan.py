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
