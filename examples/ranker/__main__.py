"""python -m examples.ranker {train,serve,bench,report} --preset tiny|small --out DIR

  train   train (resuming from DIR's checkpoints), evaluate; writes DIR/metrics.json
  serve   serving on long histories from DIR's last checkpoint: cached = full,
          isolation, Quest AUC per budget; writes DIR/serving.json
  bench   train step against jax.nn with a dense mask, serving latency; DIR/bench.json
  report  rewrite the results block of examples/ranker/README.md from DIR/*.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax

from examples.ranker import bench, serve, train
from examples.ranker.config import ACTIONS, PRESETS
from examples.ranker.world import World

README = os.path.join(os.path.dirname(__file__), "README.md")
BEGIN, END = "<!-- ranker results: begin -->", "<!-- ranker results: end -->"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m examples.ranker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("train", "serve", "bench", "report"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="run directory (checkpoints, metrics)")
    parser.add_argument("--steps", type=int, help="train: total steps (default: the preset's)")
    parser.add_argument("--repeats", type=int, default=7, help="bench: interleaved rounds")
    parser.add_argument("--no-progress", action="store_true", help="train: no progress bar")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    if args.command == "train":
        result = train.train(preset, args.out, args.steps, progress=not args.no_progress)
        main_action = result["main_action"]
        print(f"{main_action}: auc {result['auc'][main_action]:.4f}, oracle "
              f"{result['oracle_auc'][main_action]:.4f}; cached vs full max |diff| "
              f"{result['cached_vs_full_max_abs_diff']:.2e}")
    elif args.command == "serve":
        _, graphdef, params, _ = train.restore(preset, train.checkpoints(preset, args.out))
        result = serve.report(graphdef, params, World(preset.world), preset)
    elif args.command == "bench":
        result = dict(train_step=bench.train_step(preset, args.repeats),
                      serving=bench.serving(preset, args.repeats))
    else:
        write_readme(args.out, args.preset)
        return
    result = dict(result, preset=args.preset, seconds=time.perf_counter() - start, meta=meta())
    name = {"train": "metrics", "serve": "serving"}.get(args.command, args.command)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.command != "train":
        print(json.dumps(result, indent=1))


def meta() -> dict:
    return dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, backend=jax.default_backend(),
                cpus=os.cpu_count(), machine=platform.machine(), python=sys.version.split()[0])


def write_readme(out: str, preset: str):
    """The README's results block, from DIR/metrics.json, serving.json and bench.json."""
    load = lambda name: json.load(open(os.path.join(out, name)))  # noqa: E731
    metrics, serving, timing = load("metrics.json"), load("serving.json"), load("bench.json")
    m = metrics["meta"]
    lines = [BEGIN, "", f"Preset `{preset}`, measured {m['date']} on {m['cpus']} CPU cores "
             f"({m['machine']}, jax {m['jax']}, {m['backend']}) by the commands above.", "",
             f"**Training**: {metrics['steps']} steps in {metrics['seconds']:.0f} s "
             "(including compilation and evaluation). Held-out sessions:", "",
             "| head | AUC | oracle AUC | gap | no-taste AUC | log-loss | calibration |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a in ACTIONS:
        lines.append(f"| {a} | {metrics['auc'][a]:.4f} | {metrics['oracle_auc'][a]:.4f} | "
                     f"{metrics['oracle_auc'][a] - metrics['auc'][a]:.4f} | "
                     f"{metrics['impersonal_auc'][a]:.4f} | {metrics['log_loss'][a]:.4f} | "
                     f"{metrics['calibration'][a]:.3f} |")
    lines += ["", f"Correlation of the weighted final score with the true one: "
              f"{metrics['final_score_corr']:.3f}. Cached against full-forward logits: largest "
              f"difference {metrics['cached_vs_full_max_abs_diff']:.1e}.", "",
              f"**Serving** ({serving['sessions']} sessions, mean history "
              f"{serving['mean_history']:.0f} events): cached vs full max |diff| "
              f"{serving['cached_vs_full_max_abs_diff']:.1e}; candidate 0 bit-identical when the "
              f"other candidates change: {serving['isolation_bit_identical']}. Quest (main head, "
              f"oracle AUC {serving['oracle_auc']:.4f}):", "",
              "| budget (tokens) | pages kept | AUC |", "|---|---:|---:|"]
    for q in serving["quest"]:
        lines.append(f"| {q['budget'] or 'exact'} | {q['pages_kept']:.2f} | {q['auc']:.4f} |")
    step, srv = timing["train_step"], timing["serving"]
    shape = step.pop("shape")
    lines += ["", f"**Train step** ({shape['rows']} rows of {shape['row_tokens']} tokens, "
              f"{shape['sessions_per_row']:.1f} sessions per row; ratio = its time / rankattn's, "
              "median over interleaved rounds):", "", "| attention | ms | ratio |", "|---|---:|---:|"]
    lines += [f"| {name} | {r['ms']:.1f} | {r['ratio']:.2f} |" for name, r in step.items()]
    shape = srv.pop("shape")
    lines += ["", f"**Serving latency** (one request: {shape['history']} history events, "
              f"{shape['candidates']} candidates; ratio = its time / cached scoring's):", "",
              "| path | ms | ratio |", "|---|---:|---:|"]
    lines += [f"| {name} | {r['ms']:.2f} | {r['ratio']:.2f} |" for name, r in srv.items()]
    lines += ["", END]
    text = open(README).read()
    head, rest = text.split(BEGIN)
    open(README, "w").write(head + "\n".join(lines) + rest.split(END)[1])
    print(f"rewrote the results block of {README}")


if __name__ == "__main__":
    main()
