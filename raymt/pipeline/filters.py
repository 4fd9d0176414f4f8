"""The score filters' step kinds (docs/pipeline.md, "The filters"): with [score_filter] on, the
training pairs are prepared without it (prepare-unscored, a `prepare` kind), the scorers trained
(scorer-fwd on them, scorer-bwd on them reversed: prepare-reverse) unless [scorers] names
checkpoints, the pairs and the validation set scored (score: `raymt data score --valid`), and
`prepare` is the corpus prepared again with the score rule (keep_best or calibrate_valid). With
[ce_filter] on, the teachers' translations are scored by a backward model (ce-filter: `raymt data
score` without a forward model; funnel.json: pairs in, pairs kept) and the student's corpus keeps
the best keep_best of them (its own prepare's score rule: `steps.ce_filtered`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from raymt.config import ScoreConfig, ShardJobOptions
from raymt.data import __main__ as data_command
from raymt.data import score_job, scores
from raymt.data.format import MANIFEST_FILE
from raymt.flags import TrainFlags
from raymt.pipeline.keys import Step, read_json
from raymt.pipeline.steps import (
    KINDS,
    SUMMARY,
    Context,
    Kind,
    has,
    prepare_config,
    train_request,
    train_run,
)

FUNNEL_FILE = "funnel.json"  # the ce-filter step's end marker: pairs in, pairs kept
SCORER_STEPS = {"forward": "scorer-fwd", "backward": "scorer-bwd"}  # the steps that train them


def prepare_reverse_config(ctx: Context, step: Step) -> data_command.PrepareCommand:
    """`raymt data prepare` of the training and validation pairs read tgt->src with [prepare]'s
    options: the backward scorer's corpus (a prepared corpus holds one direction)."""
    cmd = prepare_config(ctx, step)
    return dataclasses.replace(
        cmd, options=dataclasses.replace(cmd.options, src_lang=ctx.cfg.tgt, tgt_lang=ctx.cfg.src)
    )


def prepare_reverse_run(ctx: Context, step: Step) -> None:
    """The reversed prepared corpus (`raymt.data.__main__.run`)."""
    ctx.dir(step.name).parent.mkdir(parents=True, exist_ok=True)
    data_command.run(prepare_reverse_config(ctx, step))


def scorer_flags(ctx: Context, step: Step) -> TrainFlags:
    """`raymt train` of a scorer ([scorers]' stage) on the corpus it uses: scorer-fwd src->tgt on
    the pairs prepared without the score rule, scorer-bwd tgt->src on them reversed."""
    stage, where = ctx.cfg.scorers, ctx.dir(step.name)
    src, tgt = ctx.cfg.pair if step.name == SCORER_STEPS["forward"] else ctx.cfg.pair[::-1]
    max_steps, sized = stage.length()
    return TrainFlags(
        preset=stage.preset,
        config=stage.config,
        set=[*sized, *stage.set],
        max_steps=max_steps,
        max_minutes=stage.max_minutes,
        corpus=str(ctx.dir(step.uses[0])),
        src_lang=src,
        tgt_lang=tgt,
        storage_path=str(where.parent),
        name=where.name,
        verbose=ctx.verbose,
    )


def scorer(ctx: Context, side: str) -> str:
    """The `side` ("forward" or "backward") scorer's checkpoint: [scorers]' given one, else the best
    of the step that trains it."""
    given = getattr(ctx.cfg.scorers, side)
    return given if given is not None else ctx.best(SCORER_STEPS[side])


def score_config(ctx: Context, step: Step) -> ScoreConfig:
    """`raymt data score --valid`: the training pairs and the validation set by both scorers."""
    return ScoreConfig(
        forward=scorer(ctx, "forward"),
        backward=scorer(ctx, "backward"),
        corpus=ctx.prefix("train"),
        valid=ctx.prefix("valid"),
        output=str(ctx.dir(step.name)),
        src_lang=ctx.cfg.src,
        tgt_lang=ctx.cfg.tgt,
        shards=ShardJobOptions(verbose=ctx.verbose),
    )


def score_run(ctx: Context, step: Step) -> None:
    """The scores (`raymt.data.score_job.run`; `raymt.shard_job.Unfinished` when shards are left)."""
    score_job.run(score_config(ctx, step))


def scored(where: Path) -> bool:
    """Whether a scoring finished (score.json says done)."""
    info = read_json(where / scores.INFO_FILE)
    return bool(info and info.get("done"))


def ce_backward(ctx: Context) -> str:
    """The CE filter's model: [scorers] backward given, else the back-translation's backward model
    (as mozilla/translations scores with it), else the backward scorer trained."""
    if ctx.cfg.scorers.backward is None and ctx.cfg.back_translates:
        return ctx.backward()
    return scorer(ctx, "backward")


def ce_config(ctx: Context, step: Step) -> ScoreConfig:
    """`raymt data score` without a forward model: the teachers' translations by the backward
    model (exp(-H(src | translation)), mozilla/translations' cross-entropy filter: `ce_backward`)."""
    return ScoreConfig(
        backward=ce_backward(ctx),
        corpus=str(ctx.dir("distill") / "text"),
        output=str(ctx.dir(step.name)),
        src_lang=ctx.cfg.src,
        tgt_lang=ctx.cfg.tgt,
        shards=ShardJobOptions(shard_lines=ctx.cfg.distill.shard_lines, verbose=ctx.verbose),
    )


def ce_run(ctx: Context, step: Step) -> None:
    """The distilled pairs scored, then funnel.json: the pairs in, scored, and kept (the best
    [ce_filter] keep_best at the threshold the student's prepare draws: `scores.best_threshold`)."""
    where, keep_best = ctx.dir(step.name), ctx.cfg.ce_filter.keep_best
    score_job.run(ce_config(ctx, step))
    values = scores.all_scores(scores.read_info(str(where), step.name), str(where))
    threshold = scores.best_threshold(values, keep_best)
    funnel = {
        "pairs": len(values),
        "scored": int((~np.isnan(values)).sum()),
        "kept": int((values >= threshold).sum()),
        "keep_best": keep_best,
        "threshold": threshold,
    }
    (where / FUNNEL_FILE).write_text(json.dumps(funnel, indent=2))
    print(f"ce-filter: {funnel['kept']:,} of {funnel['pairs']:,} distilled pairs kept (score >= {threshold:.4g})")


def ce_funnel(where: Path) -> list[tuple[str, int]]:
    """The distilled pairs the CE filter scored and kept (funnel.json)."""
    funnel = read_json(where / FUNNEL_FILE) or {}
    return [("distilled pairs scored", funnel["scored"]), ("kept by the CE filter", funnel["kept"])] if funnel else []


KINDS.update(
    {
        "prepare-reverse": Kind(1, "data prepare", has(MANIFEST_FILE), prepare_reverse_config, prepare_reverse_run),
        "scorer": Kind(1, "train", has(SUMMARY), scorer_flags, train_run, request=train_request),
        "score": Kind(1, "data score", lambda w: scored(w) and scored(w / scores.VALID_DIR), score_config, score_run),
        "ce-filter": Kind(
            1,
            "data score",
            has(FUNNEL_FILE),
            ce_config,
            ce_run,
            "then funnel.json: the best ce_filter.keep_best kept",
            funnel=ce_funnel,
        ),
    }
)
