"""python -m examples.ranker COMMAND --preset tiny|small ...

  train        train (resuming from DIR's checkpoints), evaluate; writes DIR/metrics.json
  serve        serving on long histories from DIR's last checkpoint: cached = full,
               isolation, Quest AUC per budget; writes DIR/serving.json
  bench        train step against jax.nn with a dense mask, serving latency; DIR/bench.json
               (--smoke: the smallest shapes, 1 round, to check it end to end)
  report       rewrite the results block of examples/ranker/README.md from DIR/*.json
               (and the bench.json of each --also DIR)
  server       the ranking server on HOST:PORT (POST /v1/rank, /livez, /readyz, /metrics,
               the Open Inference Protocol under /v2)
  cluster      N servers behind HAProxy on HOST:PORT, routed by X-User-Id (consistent
               hashing), health-checked on /readyz (needs haproxy: apt-get install haproxy)
  loadtest     an open-loop load generator for the server; writes --report FILE
  serverbench  latency against offered load, store against --no-cache and batch 8 against
               1; writes benchmarks/SERVER.md (--smoke: tiny, into DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax

from examples.ranker import bench, cluster, loadtest, serve, server, serverbench, train
from examples.ranker.config import ACTIONS, PRESETS
from examples.ranker.world import World

README = os.path.join(os.path.dirname(__file__), "README.md")
SERVING = f"{bench.SERVING_HISTORY} history events and {bench.SERVING_CANDIDATES} candidates"
BEGIN, END = "<!-- ranker results: begin -->", "<!-- ranker results: end -->"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m examples.ranker",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)  # train, serve, bench, report
    common.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    common.add_argument("--out", required=True, help="run directory (checkpoints, metrics)")
    common.add_argument("--steps", type=int, help="train: total steps (default: the preset's)")
    common.add_argument("--repeats", type=int, default=7, help="bench: interleaved rounds")
    common.add_argument("--smoke", action="store_true",
                        help="bench: the smallest shapes (bench.smoke_preset), 1 round")
    common.add_argument("--no-progress", action="store_true", help="train: no progress bar")
    common.add_argument("--also", nargs="*", default=[],
                        help="report: more run directories whose bench.json to include")
    for name in ("train", "serve", "bench", "report"):
        commands.add_parser(name, parents=[common])
    tools = {"server": server, "cluster": cluster, "loadtest": loadtest,
             "serverbench": serverbench}
    for name, tool in tools.items():
        tool.add_arguments(commands.add_parser(name, description=tool.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    if args.command in tools:
        return tools[args.command].main(args, parser)
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
        if args.smoke:
            preset, args.repeats = bench.smoke_preset(preset), 1
        serving_shape = bench.SMOKE_SERVING if args.smoke else {}
        result = dict(train_step=bench.train_step(preset, args.repeats),
                      serving=bench.serving(preset, args.repeats, **serving_shape))
    else:
        write_readme(args.out, args.preset, args.also)
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


def load_json(directory: str, name: str) -> dict:
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def targets(metrics: dict, benches: list[dict]):
    """(target, measured, met) rows: training quality and time, cached = full, speed-ups."""
    a = metrics["main_action"]
    gap = metrics["oracle_auc"][a] - metrics["auc"][a]
    rows = [(f"{metrics['preset']} trains in under 3 min to within 0.03 of the oracle AUC ({a})",
             f"{metrics['seconds']:.0f} s, gap {gap:.4f}", metrics["seconds"] < 180 and gap <= 0.03),
            ("cached = full forward within 1e-5", f"{metrics['cached_vs_full_max_abs_diff']:.1e}",
             metrics["cached_vs_full_max_abs_diff"] <= 1e-5)]
    for b in benches:
        serve_ratio = b["serving"]["full forward"]["ratio"]
        step_ratio = b["train_step"]["jax.nn dense mask"]["ratio"]
        rows += [(f"{b['preset']}: cached serving >= 5x the full forward pass",
                  f"{serve_ratio:.2f}x", serve_ratio >= 5),
                 (f"{b['preset']}: train step >= 1.5x the jax.nn dense-mask model",
                  f"{step_ratio:.2f}x", step_ratio >= 1.5)]
    return rows


def write_readme(out: str, preset: str, also: list[str]):
    """The README's results block, from DIR/metrics.json, serving.json and bench.json."""
    metrics, serving, timing = (load_json(out, n) for n in ("metrics.json", "serving.json",
                                                             "bench.json"))
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
    benches = [timing] + [load_json(d, "bench.json") for d in also]
    lines += ["", "**Train step**: ratio = the jax.nn model's time / rankattn's, median over "
              "interleaved rounds (soft cap off in both).", "",
              "| preset | rows x tokens | sessions per row | rankattn ms | jax.nn dense mask ms "
              "| ratio |", "|---|---|---:|---:|---:|---:|"]
    for b in benches:
        step, shape = b["train_step"], b["train_step"]["shape"]
        lines.append(f"| {b['preset']} | {shape['rows']} x {shape['row_tokens']} | "
                     f"{shape['sessions_per_row']:.1f} | {step['rankattn']['ms']:.1f} | "
                     f"{step['jax.nn dense mask']['ms']:.1f} | "
                     f"{step['jax.nn dense mask']['ratio']:.2f} |")
    lines += ["", f"**Serving latency**, one request of {SERVING} (ratio = its time / cached "
              "scoring's):", "", "| preset | cached ms | full forward ms | ratio | history "
              "forward ms (once per user and history) |", "|---|---:|---:|---:|---:|"]
    for b in benches:
        srv = b["serving"]
        lines.append(f"| {b['preset']} | {srv['cached']['ms']:.2f} | "
                     f"{srv['full forward']['ms']:.2f} | {srv['full forward']['ratio']:.2f} | "
                     f"{srv['history forward (once per user)']['ms']:.2f} |")
    lines += ["", "Targets of the issue that asked for this example:", "",
              "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {'yes' if ok else 'no'} |"
              for t, m, ok in targets(metrics, benches)]
    lines += ["", END]
    text = open(README).read()
    head, rest = text.split(BEGIN)
    open(README, "w").write(head + "\n".join(lines) + rest.split(END)[1])
    print(f"rewrote the results block of {README}")


if __name__ == "__main__":
    sys.exit(main())
