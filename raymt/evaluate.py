"""`python -m raymt.evaluate`: decode test sets across a Ray cluster and score them with sacreBLEU.

The driver encodes every test set as the model does (`raymt.engines.ModelInfo.encode`) and
cuts it into the length-sorted batches that `raymt.translate` decodes. Each batch is one row
of a Ray Data dataset; `map_batches` hands the rows to a pool of actors (a callable class
that loads raymt's engine once per actor). A batch decodes the same way whichever actor gets
it, so hypotheses do not depend on the number of actors and equal `raymt.translate`'s. Rows
carry their sentence index and are sorted back into input order on the driver.

Scores: sacreBLEU BLEU, chrF and TER on detokenized text (with signatures), plus
case-insensitive BLEU with sacreBLEU's 13a tokenizer (`lowercase=True`), the closest
sacreBLEU equivalent of the tokenized, lowercased multi-bleu numbers of many papers.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from raymt import metrics, storage
from raymt.autoscale import RayCluster, release_request
from raymt.checkpoint import default_src_lang
from raymt.cluster import CPU_ACTORS, actor_plan, default_actors, init_ray
from raymt.command import flag, group, parse
from raymt.config import Config, DecodeOptions, TrainConfig
from raymt.data.text import Pairs, read_parallel
from raymt.decoding import length_batches
from raymt.engines import load_engine, load_model_info
from raymt.errors import check, cli_error
from raymt.provenance import describe_checkpoint, describe_checkpoints

PROG = "python -m raymt.evaluate"
REPORT_FILE = "report.json"


@dataclass
class EvaluateConfig:
    """`raymt evaluate`: the checkpoints (several: an ensemble), the test sets and their languages,
    the actors that decode them, the search and where the hypotheses and report.json go."""

    checkpoint: tuple[str, ...] = flag(
        default_factory=tuple,
        help="checkpoint or exported model directory, or its URI (s3://...); repeated: an ensemble of models "
        "that share a tokenizer",
        repeat=True,
        required=True,
    )
    test: tuple[str, ...] = flag(
        default_factory=tuple,
        help="test set PREFIX.<src-lang> / PREFIX.<tgt-lang> (plain or .gz); repeatable",
        metavar="PREFIX",
        repeat=True,
        required=True,
    )
    src_lang: Optional[str] = flag(
        None,
        "source language suffix (default: the source of the checkpoint's pair; a multilingual model's "
        "one source into --tgt-lang)",
    )
    tgt_lang: Optional[str] = flag(
        None,
        "target language suffix (default: the target of the checkpoint's pair); for a multilingual "
        "(tagged) model also the tag before each source, and required",
    )
    output_dir: str = flag("evaluation", "hypotheses and report.json go here")
    num_actors: Optional[int] = flag(
        None, f"decoding actors (model replicas); default {CPU_ACTORS}, with --gpu one per GPU of the cluster"
    )
    gpu: bool = flag(False, "one GPU per actor")
    cpus_per_actor: Optional[float] = flag(
        None, "CPUs reserved per actor (default: the CPUs Ray Data leaves, split among the actors; 1 with --gpu)"
    )
    autoscale_timeout_s: float = flag(
        TrainConfig.autoscale_timeout_s,
        "seconds to wait for an autoscaling cluster to bring up the actors' GPUs or CPUs (0: never wait)",
        name="--autoscale-timeout",
    )
    num_cpus: Optional[int] = flag(None, "CPUs of the local Ray instance (ignored with RAY_ADDRESS)")
    decode: DecodeOptions = group(DecodeOptions, skip=("sample", "temperature", "top_k", "seed"))  # searches
    batch_size: int = flag(64, "sentences per batch (as raymt.translate)")
    verbose: bool = flag(False, "also print Ray's own INFO lines and internal messages (else in Ray's log files)")

    def __post_init__(self) -> None:
        check(bool(self.checkpoint), "--checkpoint is required: a checkpoint directory or its URI")
        check(bool(self.test), "--test PREFIX is required: a test set")
        check(self.num_actors is None or self.num_actors >= 1, f"--num-actors {self.num_actors} must be >= 1")
        check(self.batch_size >= 1, f"--batch-size {self.batch_size} must be >= 1")
        check(
            self.cpus_per_actor is None or self.cpus_per_actor > 0,
            f"--cpus-per-actor {self.cpus_per_actor} must be > 0",
        )


@dataclass
class Plan:
    """What `run` decodes, checked before Ray starts: the config with its languages (the files'
    suffixes) and output directory resolved, its test sets read, and a multilingual model's tags."""

    cfg: EvaluateConfig
    sets: dict[str, Pairs]
    tag_lang: Optional[str] = None  # the target tag before each source (None: a one-pair model)
    tag_src: Optional[str] = None  # the source language it reads (an imported NLLB's code)


def read_test_sets(prefixes: Sequence[str], src_lang: str, tgt_lang: str) -> dict[str, Pairs]:
    """Test sets by name (the prefix's file name), each checked for equal line counts."""
    sets: dict[str, Pairs] = {}
    for prefix in prefixes:
        name = Path(prefix).name
        if name in sets:
            raise ValueError(f"two test sets are named {name!r}; their outputs would overwrite each other")
        sets[name] = read_parallel(prefix, src_lang, tgt_lang)
    return sets


def plan_batches(encoded_sets: Sequence[Sequence[Sequence[int]]], batch_size: int) -> list[dict]:
    """Dataset rows, one per decoding batch of each set's encoded sources (`ModelInfo.encode`) in
    `Engine.translate`'s length-sorted batches: set id, sentence indices and flattened source ids."""
    rows = []
    for set_id, encoded in enumerate(encoded_sets):
        for idx in length_batches([len(e) for e in encoded], batch_size):
            rows.append(
                {
                    "set": set_id,
                    "index": np.array(idx, dtype=np.int64),
                    "lengths": np.array([len(encoded[i]) for i in idx], dtype=np.int64),
                    "src_ids": np.concatenate([np.array(encoded[i], dtype=np.int64) for i in idx]),
                }
            )
    return rows


class BatchTranslator:
    """Ray Data actor: loads the checkpoints (one model, or an ensemble) once, then decodes whole
    planned batches."""

    def __init__(self, checkpoints: list[str], opts: dict, device: str, num_threads: int):
        self.engine = load_engine(checkpoints, "raymt", device, threads=num_threads)
        self.opts = DecodeOptions(**opts)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Planned batches in, one output row per sentence (set, index, hyp, score) out."""
        out: dict[str, list] = {"set": [], "index": [], "hyp": [], "score": []}
        for set_id, index, lengths, flat in zip(batch["set"], batch["index"], batch["lengths"], batch["src_ids"]):
            sources = [ids.tolist() for ids in np.split(np.asarray(flat), np.cumsum(lengths)[:-1])]
            hyps = self.engine.translate_ids(sources, self.opts, 1)
            for i, [(score, text)] in zip(index, hyps):
                out["set"].append(int(set_id))
                out["index"].append(int(i))
                out["hyp"].append(text)
                out["score"].append(score)
        return {
            "set": np.array(out["set"], dtype=np.int64),
            "index": np.array(out["index"], dtype=np.int64),
            "hyp": np.array(out["hyp"], dtype=object),
            "score": np.array(out["score"], dtype=np.float64),
        }


def translate_on_cluster(
    checkpoint: str | Sequence[str],
    sources: Sequence[Sequence[str]],
    opts: DecodeOptions,
    num_actors: int = CPU_ACTORS,
    batch_size: int = 64,
    use_gpu: bool = False,
    cpus_per_actor: Optional[float] = None,
    tgt_lang: Optional[str] = None,
    src_lang: Optional[str] = None,
) -> list[list[tuple[float, str]]]:
    """Decode several lists of sentences into `tgt_lang` on the running Ray cluster: (score, hyp) per
    sentence, input order; encoded by the model (`ModelInfo.encode`: a tagged model's tag before
    each source, an imported NLLB's `src_lang` code; None: the model's one target); several
    checkpoints decode as an ensemble, each actor building it from their locations."""
    import ray.data

    info = load_model_info(checkpoint)
    rows = plan_batches([info.encode(s, tgt_lang, src_lang) for s in sources], batch_size)
    if not rows:
        return [[] for _ in sources]
    actors = actor_plan(num_actors, use_gpu, cpus_per_actor)
    # One planned batch per block and per call, so batches stay whole and spread over actors.
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        BatchTranslator,
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=num_actors),  # `concurrency=N` is deprecated since Ray 2.51
        num_cpus=actors.cpus,
        num_gpus=actors.gpus,
        fn_constructor_kwargs={
            "checkpoints": info.checkpoints,  # normalized locations: each actor loads them
            "opts": dict(opts.__dict__),
            "device": "cuda" if use_gpu else "cpu",
            "num_threads": actors.num_threads,
        },
    )
    decoded = {(int(r["set"]), int(r["index"])): (float(r["score"]), str(r["hyp"])) for r in ds.take_all()}
    assert len(decoded) == sum(len(s) for s in sources), "every sentence is decoded exactly once"
    return [[decoded[(set_id, i)] for i in range(len(s))] for set_id, s in enumerate(sources)]


def print_table(report: dict) -> None:
    """Each test set's scores with the checkpoint, decoding and signatures; then the speed."""
    decode = report["decode"]
    for name, r in report["test_sets"].items():
        print(
            "\n".join(
                metrics.score_lines(
                    name,
                    r,
                    report["checkpoint_description"],
                    decode["beam"],
                    decode["length_penalty"],
                    r["num_sentences"],
                )
            )
        )
    print(
        f"{report['num_sentences']} sentences in {report['wall_time_s']:.1f} s "
        f"({report['sentences_per_s']:.1f}/s, {report['num_actors']} actors); "
        f"report: {report['report']}"
    )


def check_inputs(cfg: EvaluateConfig) -> Plan:
    """Everything that can be wrong with the command line, checked before Ray starts: the
    checkpoints, the languages, the test sets and the output directory."""
    info = load_model_info(cfg.checkpoint)  # several: an ensemble, checked (engines.check_ensemble)
    check(
        info.kind == "raymt",
        f"--checkpoint {info.location} is a CTranslate2 export; evaluate decodes with raymt's engine: "
        "pass the raymt checkpoint it came from",
    )
    src_lang, tgt_lang = cfg.src_lang, cfg.tgt_lang
    tag_lang = tag_src = None  # one-pair model: --src-lang/--tgt-lang name the files only
    if info.languages is not None:
        info.prefix(tgt_lang)  # --tgt-lang checked (`ModelInfo.tags`) before Ray starts
        tgt_lang = tgt_lang or info.languages["target_langs"][0]  # many-to-one: its one target
        src_lang = src_lang or default_src_lang(info.languages, tgt_lang)
        info.source_tag(src_lang)  # an imported NLLB's source code: checked too
        tag_lang, tag_src = tgt_lang, src_lang  # the tags (`ModelInfo.encode`)
    src_lang = src_lang or info.config.data.pair()[0]
    tgt_lang = tgt_lang or info.config.data.pair()[1]
    sets = read_test_sets(cfg.test, src_lang, tgt_lang)
    output_dir = storage.output_location(cfg.output_dir, "--output-dir")  # never into a job's package
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --output-dir {output_dir}: {err.strerror}") from None
    resolved = replace(cfg, src_lang=src_lang, tgt_lang=tgt_lang, output_dir=output_dir)
    return Plan(resolved, sets, tag_lang, tag_src)


def write_report(plan: Plan, results: list, num_actors: int, wall_time_s: float) -> dict:
    """Hypothesis and score files per test set, and report.json with every number."""
    cfg = plan.cfg
    out_dir = Path(cfg.output_dir)
    num_sentences = sum(len(pairs[0]) for pairs in plan.sets.values())
    checkpoints = [storage.normalize(c) for c in cfg.checkpoint]
    report = {
        "checkpoint": checkpoints[0],
        "checkpoints": checkpoints,  # several: an ensemble
        "checkpoint_description": describe_checkpoints(checkpoints),  # each one's step, or what it averages
        "src_lang": cfg.src_lang,
        "tgt_lang": cfg.tgt_lang,
        "decode": {**cfg.decode.__dict__, "batch_size": cfg.batch_size},
        "num_actors": num_actors,
        "device": "gpu" if cfg.gpu else "cpu",
        "num_sentences": num_sentences,
        "wall_time_s": round(wall_time_s, 2),
        "sentences_per_s": round(num_sentences / max(wall_time_s, 1e-9), 2),
        "report": str(out_dir / REPORT_FILE),
        "test_sets": {},
    }
    for (name, (_, refs)), scored in zip(plan.sets.items(), results):
        hyps = [hyp for _, hyp in scored]
        hyp_path = out_dir / f"{name}.{cfg.tgt_lang}.hyp"
        hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        (out_dir / f"{name}.{cfg.tgt_lang}.scores").write_text("".join(f"{s:.6f}\n" for s, _ in scored))
        report["test_sets"][name] = {
            "num_sentences": len(hyps),
            "hypotheses": str(hyp_path),
            **metrics.score(hyps, refs, extra=True, lang=cfg.tgt_lang),
        }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def run(cfg: EvaluateConfig) -> dict:
    """Decode cfg's test sets on the Ray cluster (started here unless RAY_ADDRESS names one) and
    score them; writes each set's hypotheses and scores and report.json, and returns the report
    (its "test_sets": each set's BLEU, chrF, TER and signatures). A ValueError is one line."""
    plan = check_inputs(cfg)
    started = init_ray(cfg.num_cpus, verbose=cfg.verbose)
    planned = None
    try:
        num_actors = cfg.num_actors or default_actors(cfg.gpu)
        # one line if they cannot all be placed (an autoscaling cluster grows first, as for training)
        planned = actor_plan(num_actors, cfg.gpu, cfg.cpus_per_actor, grow_timeout_s=cfg.autoscale_timeout_s)
        t0 = time.time()
        results = translate_on_cluster(
            cfg.checkpoint,
            [pairs[0] for pairs in plan.sets.values()],
            cfg.decode,
            num_actors,
            cfg.batch_size,
            cfg.gpu,
            cfg.cpus_per_actor,
            plan.tag_lang,
            src_lang=plan.tag_src,
        )
        return write_report(plan, results, num_actors, time.time() - t0)
    finally:
        if planned is not None and planned.grew:
            release_request()  # nodes the plan asked for may go when idle
        if started:
            import ray

            ray.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: prints each test set's scores; returns the exit status."""
    try:
        print_table(run(parse(EvaluateConfig, argv, PROG, description=__doc__.split("\n\n")[0])))
    except ValueError as err:
        return cli_error("raymt.evaluate", err)
    return 0


# ---------------------------------------------------------------- a training run's test sets


def score_test_sets(checkpoint: str | Path, tests: dict[str, Pairs], cfg: Config, shown: str) -> dict[str, dict]:
    """Each pair's test set ("en-de" -> (sources, references)) beam-searched with a run's best
    checkpoint into the pair's target language (the engine puts a tagged model's tag before each
    source) and scored in it; a run on one pair has one. Decoded on the run's GPUs
    (`decode_on_cluster`) when its workers had them, else on the driver's CPUs
    (`decode_on_driver`: no actor start-up, faster for small CPU runs)."""
    decode = decode_on_cluster if cfg.train.use_gpu else decode_on_driver
    scored = {}
    for pair, (sources, refs) in tests.items():
        src_lang, tgt_lang = pair.split("-", 1)
        hyps = decode(checkpoint, sources, cfg, shown, tgt_lang, src_lang)
        scored[pair] = scored_test_set(hyps, refs, cfg, checkpoint, shown, tgt_lang)
    return scored


def decode_on_driver(
    checkpoint: str | Path,
    sources: list[str],
    cfg: Config,
    shown: Optional[str] = None,
    tgt_lang: Optional[str] = None,
    src_lang: Optional[str] = None,
) -> list[str]:
    """Beam-search `src_lang` sentences into `tgt_lang` on the driver's CPU with raymt's engine, as
    the run's config.decode says."""
    engine = load_engine(str(checkpoint), "raymt")
    return [hyps[0][1] for hyps in engine.translate(sources, cfg.decode, tgt_lang, src_lang=src_lang)]


def decode_on_cluster(
    checkpoint: str | Path,
    sources: list[str],
    cfg: Config,
    shown: str,
    tgt_lang: Optional[str] = None,
    src_lang: Optional[str] = None,
) -> list[str]:
    """Beam-search sentences on the actor pool with the run's resources (one GPU per actor, as many
    actors as training workers), not on the driver. `shown` (the checkpoint's storage path or URI)
    is what the actors load: every node reads it. An elastic run that lost nodes decodes on the
    GPUs left."""
    num_actors = max(1, min(cfg.train.num_workers, int(RayCluster().resources().get("GPU", 0))))
    [scored] = translate_on_cluster(
        shown,
        [sources],
        cfg.decode,
        num_actors=num_actors,
        batch_size=cfg.data.eval_batch_size,
        use_gpu=True,
        tgt_lang=tgt_lang,
        src_lang=src_lang,
    )
    return [hyp for _, hyp in scored]


def scored_test_set(
    hyps: list[str], refs: list[str], cfg: Config, checkpoint: str | Path, shown: Optional[str], lang: str
) -> dict:
    """A test set's scores in its target language `lang`, which checkpoint (`shown`) and how it was decoded."""
    scores = metrics.score(hyps, refs, extra=True, lang=lang)
    return {
        **scores,
        "checkpoint": describe_checkpoint(checkpoint, shown),
        "num_sentences": len(refs),
        "beam": cfg.decode.beam,
        "length_penalty": cfg.decode.length_penalty,
    }


if __name__ == "__main__":
    sys.exit(main())
