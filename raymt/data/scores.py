"""Dual conditional cross-entropy scores of a parallel corpus: the formula, the score directory
`raymt data score` writes (raymt.data.score_job) and what prepare reads of it.

Junczys-Dowmunt (2018), "Dual conditional cross-entropy filtering of noisy parallel corpora":
for a pair (x, y), a forward model A (src->tgt) and a backward model B (tgt->src),
H_A(y|x) = -(1/|y|) sum_t log P_A(y_t | y_<t, x) (the target's tokens and EOS, |y| of them) and
H_B(x|y) likewise; the pair's score is

    score(x, y) = exp(-(|H_A(y|x) - H_B(x|y)| + (H_A(y|x) + H_B(x|y)) / 2))

in (0, 1], higher is better: both models find the pair likely, and alike likely. prepare keeps a
pair whose score is at least `min_score`, or the best `keep_best` fraction of a corpus's pairs, or
a pair that scores at least the `calibrate_valid` quantile of the validation pairs' scores (the
same models' scores of the corpus's validation set, in the score directory's `valid/`: a
threshold set without labels, the validation pairs taken as clean). Without a forward model (the
cross-entropy filter of distilled pairs, as mozilla/translations filters them with a backward
model) the score is exp(-H_B(x|y)).

A score directory (default: beside the corpus, `SPEC.scores`) holds `score.json` (the models,
the languages, the corpus and a fingerprint of its files, the line count, `done`) and
`part-<first line id>.parquet` shards (line_id, score, h_fwd, h_bwd; NaN for an empty or invalid
line), one row per corpus line (`raymt.shard_job`), and with `--valid` the validation set's
scores in `valid/`, a score directory of its own.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raymt import storage
from raymt.data.text import resolve
from raymt.errors import InputError
from raymt.shard_job import shard_name

INFO_FILE = "score.json"
INFO_FORMAT = "raymt-scores/1"
SUFFIX = ".scores"  # SPEC.scores: a corpus's score directory beside it
VALID_DIR = "valid"  # in a score directory: the same models' scores of the validation set (--valid)
META_KEY = b"raymt.scores"  # Parquet schema metadata of a shard: its counts
COUNTS = ("scored", "empty", "invalid")
OUT_SCHEMA = pa.schema(
    [("line_id", pa.int64()), ("score", pa.float64()), ("h_fwd", pa.float64()), ("h_bwd", pa.float64())]
)
EDGE_BYTES = 1 << 20  # a file's fingerprint hashes its first and last MiB (and its size)


def dual_score(h_fwd: float, h_bwd: float) -> float:
    """exp(-(|H_fwd - H_bwd| + (H_fwd + H_bwd) / 2)): Junczys-Dowmunt (2018)'s score, higher is better."""
    return math.exp(-(abs(h_fwd - h_bwd) + 0.5 * (h_fwd + h_bwd)))


def backward_score(h_bwd: float) -> float:
    """exp(-H_bwd): the score without a forward model (the cross-entropy filter of distilled pairs)."""
    return math.exp(-h_bwd)


def cross_entropy(log_probs: Sequence[float]) -> float:
    """H(y|x) of one target: minus the mean of its tokens' and EOS's log-probabilities."""
    return -sum(log_probs) / len(log_probs)


def file_fingerprint(location: str) -> dict:
    """A file's size and the sha256 of its first and last EDGE_BYTES as stored: what a score
    directory records of each corpus file, cheap to check before prepare reads the corpus."""
    fs, path = storage.filesystem(location)
    with fs.open_input_file(path) as fh:
        size = fh.size()
        digest = hashlib.sha256(fh.read(min(size, EDGE_BYTES)))
        if size > EDGE_BYTES:
            fh.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(fh.read())
    return {"size": size, "sha256_edges": digest.hexdigest()}


def default_location(spec: str) -> str:
    """Where a corpus SPEC's scores are by default: SPEC.scores beside it."""
    return spec.rstrip("/") + SUFFIX


def valid_location(location: str) -> str:
    """Where a score directory holds its validation set's scores (`raymt data score --valid`)."""
    return storage.join(location, VALID_DIR)


def read_info(location: str, where: str) -> dict:
    """A complete score directory's score.json; a one-line error when it is missing, not one, or
    not finished."""
    raw = storage.optional_bytes(storage.join(location, INFO_FILE))
    if raw is None:
        raise ValueError(f"{where}: no scores at {location}: run `raymt data score` first, or name them with --scores")
    try:
        info = json.loads(raw)
        assert isinstance(info, dict) and info.get("format") == INFO_FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError, AssertionError):
        raise ValueError(f"{where}: {storage.join(location, INFO_FILE)} is not a raymt score record") from None
    if not info.get("done"):
        raise ValueError(f"{where}: the scoring at {location} is not finished: run the same raymt data score again")
    return info


def check_match(info: dict, location: str, paths: Sequence[str], langs: tuple[str, str], where: str) -> None:
    """One-line errors unless the scores are of this corpus: its languages, its files (sizes and
    edges) and a row per line in the shards."""
    if (info.get("src_lang"), info.get("tgt_lang")) != langs:
        raise ValueError(
            f"{where}: {location} scores {info.get('src_lang')}-{info.get('tgt_lang')} pairs, not "
            f"{langs[0]}-{langs[1]}: score this corpus with `raymt data score`"
        )
    files = info.get("files") or []
    now = [file_fingerprint(p) for p in paths]
    if len(files) != len(now) or any(
        (f.get("size"), f.get("sha256_edges")) != (n["size"], n["sha256_edges"]) for f, n in zip(files, now)
    ):
        sizes = ", ".join(f"{n['size']:,}" for n in now)
        scored = ", ".join(f"{f.get('size', 0):,}" for f in files)
        raise ValueError(
            f"{where}: {location} does not match the corpus: it scored files of {scored} bytes, the corpus's "
            f"are {sizes} bytes or differ in content; score the corpus again (raymt data score)"
        )
    rows = sum(_rows(f) for f in shard_files(info, location))
    if rows != info.get("num_lines"):
        raise ValueError(
            f"{where}: {location} holds {rows:,} scores for {info.get('num_lines'):,} corpus lines: "
            "score the corpus again (raymt data score)"
        )


def _rows(location: str) -> int:
    """The rows of a score shard (0 when it is missing or unreadable)."""
    fs, path = storage.filesystem(location)
    try:
        with fs.open_input_file(path) as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    except (OSError, pa.ArrowException):
        return 0


def shard_files(info: dict, location: str) -> list[str]:
    """The score shards of a score directory, in line order."""
    return [storage.join(location, shard_name(s * info["shard_lines"])) for s in range(info["num_shards"])]


def all_scores(info: dict, location: str) -> np.ndarray:
    """Every line's score (NaN unscored), in line order: what keep_best's threshold is drawn from."""
    parts = [pq.read_table(storage.filesystem(f)[1], columns=["score"]).column(0) for f in shard_files(info, location)]
    return np.concatenate([p.to_numpy() for p in parts]) if parts else np.zeros(0)


def write_given(prefix: str, values: Sequence[float], langs: tuple[str, str]) -> str:
    """PREFIX.scores holding `values` line by line, as `raymt data score` writes it (one shard):
    scores made elsewhere (another scorer, a test); its location."""
    out = default_location(prefix)
    storage.filesystem(out)[0].create_dir(storage.filesystem(out)[1])
    table = pa.table({"line_id": range(len(values)), "score": values, "h_fwd": values, "h_bwd": values})
    pq.write_table(table.cast(OUT_SCHEMA), storage.filesystem(storage.join(out, shard_name(0)))[1])
    info = {"format": INFO_FORMAT, "src_lang": langs[0], "tgt_lang": langs[1], "done": True}
    info.update(files=[file_fingerprint(resolve(prefix, lang)) for lang in langs])
    info.update(num_lines=len(values), shard_lines=len(values), num_shards=1)
    storage.write_bytes(storage.join(out, INFO_FILE), json.dumps(info).encode())
    return out


def best_threshold(scores: np.ndarray, keep_best: float) -> float:
    """The score at which the best `keep_best` of the scored pairs are kept (ties at it kept too)."""
    scored = np.sort(scores[~np.isnan(scores)])[::-1]
    if not len(scored):
        return math.inf
    return float(scored[max(1, round(keep_best * len(scored))) - 1])


def calibrated_threshold(valid_scores: np.ndarray, quantile: float) -> float:
    """The score that `quantile` of the scored validation pairs fall under (numpy's "lower"
    quantile: a score one of them has), so a pair as clean as they are is dropped with about that
    probability: calibrate_valid's threshold, set without labels."""
    scored = valid_scores[~np.isnan(valid_scores)]
    if not len(scored):
        return math.inf
    return float(np.quantile(scored, quantile, method="lower"))


class ScoreReader:
    """A score directory read in line order, one shard at a time (a prepare task's memory stays
    flat in the corpus's size)."""

    def __init__(self, entry: dict, where: str) -> None:
        self.location, self.info, self.where = entry["location"], entry, where  # `score_entries`' entry
        self.shard, self.values = -1, np.zeros(0)

    def scores(self, line_numbers: Sequence[int]) -> list[float]:
        """The scores of 1-based corpus lines, in ascending order; a one-line error for a line
        beyond the scored ones (the corpus grew since it was scored)."""
        out = []
        per = self.info["shard_lines"]
        for n in line_numbers:
            line_id = n - 1
            if line_id >= self.info["num_lines"]:
                raise InputError(
                    f"{self.where}: the corpus has more than the {self.info['num_lines']:,} lines "
                    f"{self.location} scored: score it again (raymt data score)"
                )
            if line_id // per != self.shard:
                self.shard = line_id // per
                path = storage.filesystem(storage.join(self.location, shard_name(self.shard * per)))[1]
                self.values = pq.read_table(path, columns=["score"]).column(0).to_numpy()
            out.append(float(self.values[line_id - self.shard * per]))
        return out


def filters(cfg: Any) -> bool:
    """Whether a corpus's cleaning options (a PrepareConfig) filter by score."""
    return any(getattr(cfg, k) is not None for k in ("min_score", "keep_best", "calibrate_valid"))


def locations(cfg: Any, train: Sequence[Any], where: str) -> list[str]:
    """Each training input's score directory: cfg.scores for a corpus of one input, else beside
    the SPEC it was read from (`Source.location`); one line when there is none to find."""
    if cfg.scores is not None:
        if len(train) != 1:
            raise ValueError(
                f"{where}: scores={cfg.scores} names one score directory for {len(train)} training inputs: "
                "leave it out to read each input's SPEC.scores"
            )
        return [cfg.scores]
    found = []
    for source in train:
        if source.location is None:
            raise ValueError(
                f"{where}: its pairs come from no --train SPEC (the built-in corpus, a --dataset or --src-file): "
                "score a --train corpus, or name its scores (clean = {scores = ...})"
            )
        found.append(default_location(source.location))
    return found


def check_scores(cfg: Any, corpus: Any, where: str) -> list[dict]:
    """Before Ray: each training input's scores, complete and of this corpus (`check_match`); their
    descriptions (location, score.json's sha256) for the corpus's inputs and fingerprint."""
    out = []
    langs = (corpus.spec.src_lang, corpus.spec.tgt_lang)
    for source, location in zip(corpus.train, locations(cfg, corpus.train, where)):
        info = read_info(location, where)
        check_match(info, location, source.paths, langs, where)
        digest = hashlib.sha256(storage.read_bytes(storage.join(location, INFO_FILE))).hexdigest()
        out.append({"location": location, "sha256": digest})
        if cfg.calibrate_valid is not None:
            out[-1]["valid_sha256"] = check_valid_scores(info, location, corpus, where)
    return out


def check_valid_scores(info: dict, location: str, corpus: Any, where: str) -> str:
    """calibrate_valid's check before Ray: the score directory holds scores of the corpus's
    validation set (`valid_location`), complete, matched to its files and made by the models that
    scored the training pairs; the sha256 of their score.json (in the corpus's fingerprint)."""
    if not corpus.valid:
        raise ValueError(
            f"{where}: calibrate_valid reads the validation set's scores, and this corpus has no validation "
            "set of its own: pass its --valid, or filter it with keep_best or min_score"
        )
    valid = valid_location(location)
    if storage.optional_bytes(storage.join(valid, INFO_FILE)) is None:
        raise ValueError(
            f"{where}: calibrate_valid: {location} holds no validation scores: score the corpus with "
            "`raymt data score --valid SPEC` (the validation set), or filter with keep_best"
        )
    vinfo = read_info(valid, where)
    check_match(vinfo, valid, [p for s in corpus.valid for p in s.paths], (info["src_lang"], info["tgt_lang"]), where)
    if (vinfo.get("forward"), vinfo.get("backward")) != (info.get("forward"), info.get("backward")):
        raise ValueError(
            f"{where}: calibrate_valid: {valid} was scored by other models than {location}: score both with "
            "the same `raymt data score --valid` command"
        )
    return hashlib.sha256(storage.read_bytes(storage.join(valid, INFO_FILE))).hexdigest()


def score_entries(cfg: Any, corpus: Any, where: str) -> list[dict]:
    """What each training input's prepare tasks need to filter it (its task spec's "scores"): the
    score directory, its shard and line counts, and the corpus's threshold (min_score, or the
    score of keep_best's last pair over all its inputs, or calibrate_valid's quantile of the
    validation scores of its first input's directory: `check_valid_scores` saw each one's)."""
    found = [(loc, read_info(loc, where)) for loc in locations(cfg, corpus.train, where)]
    threshold = cfg.min_score
    if cfg.calibrate_valid is not None:
        valid = valid_location(found[0][0])
        threshold = calibrated_threshold(all_scores(read_info(valid, where), valid), cfg.calibrate_valid)
    elif threshold is None:
        threshold = best_threshold(np.concatenate([all_scores(info, loc) for loc, info in found]), cfg.keep_best)
    return [
        {"location": loc, "shard_lines": info["shard_lines"], "num_lines": info["num_lines"], "threshold": threshold}
        for loc, info in found
    ]
