"""Fine-tuning a pretrained model on a new domain, three ways, at one budget (issue 57).

No OPUS-MT weights can be fetched here, so a Multi30k model stands in for one: it is exported to
Hugging Face Marian (the format OPUS-MT ships) and imported back with `raymt import` (checked
identical), then fine-tuned for --steps updates on the second domain, the built-in corpus's en-de
(dates, times, quantities, money: nothing like Multi30k's image captions), in three arms:

- domain:  `raymt train --init` on the domain corpus alone;
- mix:     `raymt train --init` on two labeled corpora of the pair, domain and Multi30k, 50/50;
- scratch: the same model shape trained from nothing on the domain corpus.

Each arm's best checkpoint (and the starting model) is scored with `raymt evaluate` on both
domains' test sets (test_2016_flickr, and the built-in corpus's held-out test). Prints the table
of docs/training.md and writes OUT/finetune.json (keys: start, scratch, and each fine-tuning arm
with its peak lr, domain-lr0.001).

    python benchmarks/finetune.py --base runs/m30k-post/checkpoint_... --m30k ../shared/data/multi30k \
        --out /tmp/ft --steps 300
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ARMS = "domain,mix,scratch"  # --arms' default


def raymt(*args: str) -> float:
    """Run `python -m raymt ARGS` (its output to this one's); the seconds it took."""
    t0 = time.time()
    print("+ raymt " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "raymt", *args], check=True, cwd=ROOT)
    return time.time() - t0


def domain_files(out: Path, eval_size: int) -> Path:
    """The built-in corpus's en-de as text files: DIR/{train,valid,builtin_test}.{en,de}."""
    from raymt.data.builtin import builtin_splits

    directory = out / "domain"
    directory.mkdir(parents=True, exist_ok=True)
    splits = builtin_splits("en", "de", 24000, eval_size, seed=7)
    for split, (src, tgt) in splits.items():
        name = "builtin_test" if split == "test" else split
        for lang, lines in (("en", src), ("de", tgt)):
            (directory / f"{name}.{lang}").write_text("".join(f"{line}\n" for line in lines))
    return directory


def stand_in(base: Path, out: Path) -> Path:
    """The base model through HF Marian and back: what `raymt import opus-mt-...` would give."""
    from raymt.checkpoint import load_weights

    hf, imported = out / "hf-marian", out / "imported"
    if not imported.is_dir():
        raymt("export", "--checkpoint", str(base), "--output", str(hf), "--format", "marian")
        raymt("import", str(hf), "--output", str(imported))
    before, after = load_weights(base), load_weights(imported)
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert same, "the import of the Marian export differs from the base model"
    return imported


def evaluate(checkpoint: Path, tests: list[str], out: Path) -> dict:
    """test BLEU/chrF of `checkpoint` on each test set (raymt evaluate, beam 5; a report of this
    checkpoint already in `out` is read again)."""
    flags = [f for t in tests for f in ("--test", t)]
    langs = ["--src-lang", "en", "--tgt-lang", "de"]
    done = out / "report.json"
    if not done.is_file() or json.loads(done.read_text()).get("checkpoint") != str(checkpoint):
        raymt("evaluate", "--checkpoint", str(checkpoint), *flags, *langs, "--output-dir", str(out))
    report = json.loads((out / "report.json").read_text())
    return {name: {k: r[k] for k in ("bleu", "chrf")} for name, r in report["test_sets"].items()}


def mix_config(recipe: str, out: Path, m30k: Path, domain: Path) -> Path:
    """The recipe with two labeled corpora of en-de at 50/50 (weights against their sizes) and
    the domain's validation set, as a JSON config."""
    import tomllib

    config = tomllib.loads(Path(recipe).read_text())
    general_rows, domain_rows = 29000, sum(1 for _ in (domain / "train.en").open())
    pair = {"src_lang": "en", "tgt_lang": "de"}
    config.setdefault("data", {})["corpora"] = [
        {"label": "domain", **pair, "train": f"{domain}/train", "valid": f"{domain}/valid"},
        {"label": "general", **pair, "train": f"{m30k}/train", "weight": domain_rows / general_rows},
    ]
    path = out / "mix.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def recipe_lr(recipe: str) -> float:
    """The recipe's peak lr (optim.lr)."""
    import tomllib

    return float(tomllib.loads(Path(recipe).read_text())["optim"]["lr"])


def arm_name(arm: str, lr: float) -> str:
    """An arm's key in finetune.json (and its run's name): a fine-tuning arm's with its peak lr,
    domain-lr0.001; scratch's (at its own schedule) alone."""
    return arm if arm == "scratch" else f"{arm}-lr{lr:g}"


def best(run: Path) -> Path:
    """The run's best checkpoint (summary.json)."""
    return Path(json.loads((run / "summary.json").read_text())["best_checkpoint"])


def main() -> int:
    """Run the three arms; print and save the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, type=Path, help="a post-norm raymt checkpoint trained on Multi30k en-de")
    p.add_argument("--m30k", required=True, type=Path, help="directory of Multi30k's train/val/test_2016_flickr files")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=300, help="updates per arm")
    p.add_argument("--recipe", default=str(ROOT / "recipes/finetune-multi30k.toml"))
    p.add_argument("--eval-size", type=int, default=500, help="the domain's validation and test sentences")
    p.add_argument("--arms", default=ARMS)
    p.add_argument("--lr", type=float, help="the fine-tuning arms' peak lr (default: the recipe's)")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    domain = domain_files(out, args.eval_size)
    tests = [str(args.m30k / "test_2016_flickr"), str(domain / "builtin_test")]
    imported = stand_in(args.base.resolve(), out)
    results = {"start": {"scores": evaluate(imported, tests, out / "eval-start"), "seconds": 0.0}}
    common = ["--set", f"train.max_steps={args.steps}", "--set", f"train.storage_path={out / 'runs'}"]
    on_domain = ["--train", f"{domain}/train", "--valid", f"{domain}/valid"]
    # The base model's schedule (lr 2e-3 post-norm), its warmup cut to a third of the budget.
    scratch = ["--config", str(ROOT / "recipes/multi30k-cpu.toml"), "--set", "model.pre_norm=false"]
    scratch += ["--set", "optim.lr=2e-3", "--set", f"optim.warmup_steps={max(1, args.steps // 3)}"]
    arms = {
        "domain": ["--init", str(imported), "--config", args.recipe, *on_domain],
        "mix": ["--init", str(imported), "--config", str(mix_config(args.recipe, out, args.m30k, domain))],
        "scratch": [*scratch, *on_domain],
    }
    lr = ["--set", f"optim.lr={args.lr}"] if args.lr else []
    # A fine-tuning arm's key says its peak lr (--lr, else the recipe's) whatever the recipe holds.
    peak = args.lr or recipe_lr(args.recipe)
    for arm in args.arms.split(","):
        name = arm_name(arm, peak)
        flags = [*arms[arm], *(lr if arm != "scratch" else []), *common]
        seconds = raymt("train", *flags, "--name", f"ft-{name}")
        scores = evaluate(best(out / "runs" / f"ft-{name}"), tests, out / f"eval-{name}")
        results[name] = {"scores": scores, "seconds": round(seconds, 1)}
        saved = out / "finetune.json"
        previous = json.loads(saved.read_text()) if saved.is_file() else {}
        saved.write_text(json.dumps({**previous, **results}, indent=2))
    print(f"\n{'arm':<8} {'Multi30k BLEU':>14} {'chrF':>6} {'domain BLEU':>12} {'chrF':>6} {'seconds':>8}")
    for name, r in results.items():
        m, d = r["scores"]["test_2016_flickr"], r["scores"]["builtin_test"]
        row = f"{m['bleu']:>14.2f} {m['chrf']:>6.2f} {d['bleu']:>12.2f} {d['chrf']:>6.2f}"
        print(f"{name:<8} {row} {r['seconds']:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
