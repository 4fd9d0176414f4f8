"""The printed test score (raymt.train's summary, raymt.evaluate's report) names the checkpoint
(its step, or the checkpoints it averages), the beam and length penalty, every sacreBLEU
signature, and the papers' tokenized lowercased BLEU beside sacreBLEU's."""

import json
import math
import sys
from collections import Counter

import pytest
from tiny_checkpoint import make_checkpoint, one_thread  # noqa: F401 (autouse fixture)

from raymt import average, evaluate, provenance, train
from raymt.metrics import moses_tokenized, papers_bleu, score, score_lines

HYPS = ["Ein Mann fährt Fahrrad .", "Zwei Hunde spielen im Schnee."]
REFS = ["Ein Mann fährt ein Fahrrad.", "zwei Hunde spielen im Schnee."]


def test_score_lines_state_scores_checkpoint_decoding_and_signatures():
    scores = score(HYPS, REFS, extra=True)
    lines = score_lines("test_2016_flickr", scores, "runs/r/checkpoint_1 (step 40, not averaged)", 5, 0.6, 2)
    assert lines[0] == (
        f"test_2016_flickr BLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.2f}, "
        f"TER {scores['ter']:.2f} (sacreBLEU, 2 sentences); tokenized lowercased BLEU "
        f"{scores['bleu_tok']:.2f} (Moses tokenizer, lowercase, multi-bleu; papers' form)"
    )
    assert scores["bleu_lc"] > scores["bleu"]  # "zwei" matches "Zwei" once lowercased
    assert lines[1] == "  checkpoint runs/r/checkpoint_1 (step 40, not averaged); beam 5, length penalty 0.6"
    signatures = dict(line.split(None, 1) for line in lines[2:])
    assert signatures == {
        "BLEU:": scores["bleu_signature"],
        "chrF:": scores["chrf_signature"],
        "TER:": scores["ter_signature"],
        "BLEU-lc:": scores["bleu_lc_signature"],
        "BLEU-tok:": scores["bleu_tok_signature"],
    }
    assert "case:mixed" in signatures["BLEU:"] and "tok:13a" in signatures["BLEU:"]
    assert "case:lc" in signatures["BLEU-lc:"] and "tok:13a" in signatures["BLEU-lc:"]
    assert "tok:moses-en" in signatures["BLEU-tok:"] and "smooth:none" in signatures["BLEU-tok:"]


def multi_bleu(hyps: list[str], refs: list[str]) -> float:
    """multi-bleu.perl's corpus BLEU on whitespace tokens, written out: clipped 1-4-gram
    precisions, their geometric mean, the brevity penalty; no smoothing."""
    matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hyps, refs):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hyp_grams, ref_grams = (Counter(tuple(w[i : i + n]) for i in range(len(w) - n + 1)) for w in (h, r))
            matches[n - 1] += sum(min(c, ref_grams[g]) for g, c in hyp_grams.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = min(0.0, 1 - ref_len / hyp_len)
    return 100 * math.exp(log_precision + brevity)


def test_papers_bleu_is_multi_bleu_on_moses_tokenized_lowercased_text():
    hyps = [
        "Ein Mann, der auf einem Fahrrad fährt.",
        'Zwei Hunde spielen im "Schnee"!',
        "Eine Frau mit rotem Hut sitzt am Tisch.",
    ]
    refs = [
        "Ein Mann fährt auf einem Fahrrad.",
        "zwei Hunde spielen im Schnee!",
        "Eine Frau mit einem roten Hut sitzt an einem Tisch.",
    ]
    value, signature = papers_bleu(hyps, refs, "de")
    tokenized = moses_tokenized(hyps, "de")
    # The Moses rules split punctuation and quotes off words, and everything is lowercased.
    assert tokenized[1] == 'zwei hunde spielen im " schnee " !'
    assert value == pytest.approx(multi_bleu(tokenized, moses_tokenized(refs, "de")), abs=1e-9)
    assert value != pytest.approx(score(hyps, refs)["bleu"])  # not sacreBLEU's detokenized form
    assert "tok:moses-de" in signature


def test_a_checkpoint_is_described_by_its_step_or_by_what_it_averages(tmp_path):
    run = tmp_path / "run"
    first = make_checkpoint(run / "checkpoint_a", seed=0, step=100)
    second = make_checkpoint(run / "checkpoint_b", seed=1, step=200)
    assert provenance.describe_checkpoint(first) == f"{first} (step 100, not averaged)"
    # Ray's snapshot beside the checkpoints wins over train_state.pt (and is cheaper to read).
    (run / average.RAY_SNAPSHOT_FILE).write_text(
        json.dumps(
            {
                "checkpoint_results": [
                    {"checkpoint_dir_name": "checkpoint_b", "metrics": {"step": 250, "valid_bleu": 1.0}}
                ]
            }
        )
    )
    assert (
        provenance.describe_checkpoint(second, "s3://b/run/checkpoint_b")
        == "s3://b/run/checkpoint_b (step 250, not averaged)"
    )
    averaged = average.average_checkpoints([second, first], tmp_path / "avg")
    assert (
        provenance.describe_checkpoint(averaged)
        == f"{averaged} (average of 2: checkpoint_b step 250, checkpoint_a step 100)"
    )
    exported = tmp_path / "exported"
    exported.mkdir()
    for name in ("model.pt", "config.json", "spm.model"):
        (exported / name).write_bytes((first / name).read_bytes())
    assert provenance.describe_checkpoint(exported) == f"{exported} (no step recorded, not averaged)"


def test_train_and_evaluate_print_the_same_lines(tmp_path, capsys):
    scores = score(HYPS, REFS, extra=True)
    ckpt = make_checkpoint(tmp_path / "checkpoint_x", step=7)
    described = provenance.describe_checkpoint(ckpt)
    expected = score_lines("test", scores, described, 4, 1.0, 2)
    train.print_summary(
        {
            "test": {**scores, "checkpoint": described, "beam": 4, "length_penalty": 1.0, "num_sentences": 2},
            "metrics_csv": "m.csv",
            "run_dir": "r",
            "best_checkpoint": str(ckpt),
            "wall_time_s": 60,
        }
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["", "=== raymt training finished ==="]
    assert printed[2 : 2 + len(expected)] == expected
    evaluate.print_table(
        {
            "checkpoint_description": described,
            "decode": {"beam": 4, "length_penalty": 1.0},
            "test_sets": {"test": {**scores, "num_sentences": 2}},
            "num_sentences": 2,
            "wall_time_s": 1.0,
            "sentences_per_s": 2.0,
            "num_actors": 1,
            "report": "r.json",
        }
    )
    assert capsys.readouterr().out.splitlines()[: len(expected)] == expected


def test_without_sacremoses_the_test_scores_keep_sacrebleu_and_say_what_is_missing(monkeypatch):
    # The GPU image of an earlier run lacked sacremoses: the papers' form then failed after
    # training and took sacreBLEU's test scores with it.
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # `import sacremoses` raises ImportError
    scores = score(HYPS, REFS, extra=True)
    assert scores["bleu"] == score(HYPS, REFS)["bleu"] and "ter" in scores
    assert "bleu_tok" not in scores and "bleu_tok_signature" not in scores
    lines = score_lines("test", scores, "runs/r/checkpoint_1", 5, 0.6)
    assert lines[0].endswith("(papers' form): sacremoses is not installed; pip install sacremoses")
    assert not any(line.lstrip().startswith("BLEU-tok:") for line in lines)


def test_bleu_is_tokenized_for_the_target_language():
    """13a splits on spaces and punctuation: Chinese, written without spaces, needs sacreBLEU's zh
    tokenizer (ja and ko theirs, or characters where sacrebleu[ja]/[ko] is missing)."""
    hyps, refs = ["我喜欢猫。", "他们在公园里。"], ["我喜欢狗。", "他们在公园里玩。"]
    zh, plain = score(hyps, refs, extra=True, lang="zh"), score(hyps, refs)
    assert plain["bleu"] < 1.0 < zh["bleu"] and "tok:zh" in zh["bleu_signature"]
    assert "asian:yes" in zh["ter_signature"]
    ja = score(hyps, refs, lang="ja")["bleu_signature"]
    assert "tok:ja-mecab" in ja or "tok:char" in ja
    assert score(["a house ."], ["a house ."], lang="de")["bleu_signature"] == plain["bleu_signature"]
