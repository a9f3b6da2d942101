"""docs/results/bench_cpu.md from the JSON of the benchmark runs, with the commands that made them.

    sps-driving bench --blip2 none --rates 1.0 0.5 0.3 --repeats 20 --json --out runs/bench/dinov2.json
    python -m sps_driving.tools.op_profile --frames 20 --out runs/bench/ops.json
    sps-driving bench --graph --tokens all kept --precisions fp32 int8 --repeats 3 --json --out runs/bench/graph.json
    sps-driving bench --eval --episodes 2 --repeats 2 --json --out runs/bench/eval.json
    python -m sps_driving.tools.bench_report --dinov2 runs/bench/dinov2.json --graph runs/bench/graph.json \\
        --eval runs/bench/eval.json --ops runs/bench/ops.json --out docs/results/bench_cpu.md

The training section takes runs of `bench --train` alternated between the trainer before a
change (a checkout of it) and after, each as often:

    for n in 1 2 3; do (cd BEFORE && sps-driving bench --train --repeats 1 --train-cases PT-50 MLP-50 \
        --json --out runs/bench/train_before_$n.json); sps-driving bench --train --repeats 1 \
        --train-cases PT-50 MLP-50 --json --out runs/bench/train_after_$n.json; done
    python -m sps_driving.tools.bench_report ... --train-before runs/bench/train_before_* \
        --train-after runs/bench/train_after_* --out docs/results/bench_cpu.md

`--dinov2` takes further runs of the same command after the first: the first is the table, and
every run goes into a run-to-run table of its dense fp32 time, efficiency and speed-ups, so a
reader sees how much the machine moved between runs.

Only tables of what the runs measured, each with its revision, machine load and command; the
reading (where the fp32 backbone stands against the peak and why, what becomes the default) is
written by whoever ran them, under the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sps_driving.tools.bench_train import PHASES as TRAIN_PHASES

COMMANDS = {
    "dinov2": "sps-driving bench --blip2 none --rates 1.0 0.5 0.3 --repeats 20 --json --out runs/bench/dinov2.json",
    "graph": "sps-driving bench --graph --tokens all kept --precisions fp32 int8 --repeats 3 --json --out runs/bench/graph.json",
    "eval": "sps-driving bench --eval --episodes 2 --repeats 2 --json --out runs/bench/eval.json",
    "ops": "python -m sps_driving.tools.op_profile --frames 20 --out runs/bench/ops.json",
    "train": "sps-driving bench --train --repeats 1 --train-cases PT-50 MLP-50 --json --out runs/bench/train_N.json",
}


def _load(result: dict) -> str:
    return f"revision {result.get('revision', 'unknown')}, load average {' / '.join(f'{v:.2f}' for v in result['load_average'])}"


def _peak(peak: dict) -> str:
    from sps_driving.tools.peak import format_peak

    return "Measured in the same run: " + " ".join(format_peak(peak).split())


def dinov2_section(result: dict) -> list[str]:
    bench = result["dinov2"]
    lines = ["## The extractor alone, by path and rate", "",
             f"`{COMMANDS['dinov2']}` ({_load(result)}; median of {result['repeats']} frames, the shipped policy's road "
             f"band, {bench['grid'][0]}x{bench['grid'][1]} patches). {_peak(result['peak'])}", "",
             "| path | rate | k | encode ms | descriptors ms | extractor ms | speed-up | GFLOP (encode + descriptors) | "
             "GFLOP/s | % of peak (encode / descriptors / extractor) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in bench["rows"]:
        fraction = row["peak_fraction"]
        shares = " / ".join(f"{100 * (fraction[part] or 0):.0f}" for part in ("encode", "descriptors", "extractor"))
        lines.append(f"| {row['path']} | {row['rate']:g} | {row['k']} | {row['encode_ms']:.1f} | {row['descriptors_ms']:.1f} | "
                     f"{row['extractor_ms']:.1f} | {row['extractor_speedup']:.2f}x | {row['gflop']['encode']:.2f} + "
                     f"{row['gflop']['descriptors']:.2f} | {row['gflops_per_s']['extractor'] or 0:.1f} | {shares} |")
    lines += ["", "Speed-up: the extractor time of dense fp32 onnxruntime at the same rate over the row's. % of peak: "
              "each stage's FLOP/s over the measured peak of its precision (int8 quantizes the graph with the ViT's layers: "
              "encode when dense, descriptors with token dropping)."]
    return lines


# (path, rate) of the speed-ups compared run to run: int8, token dropping and both
RUN_TO_RUN = (("onnxruntime-int8", 1.0), ("onnxruntime-kept", 0.5), ("onnxruntime-kept", 0.3),
              ("onnxruntime-kept-int8", 0.5), ("onnxruntime-kept-int8", 0.3))


def run_to_run_section(results: list[dict]) -> list[str]:
    """One row per run of the same command: what moves with the machine (times) and what should not (ratios)."""
    lines = ["### Run to run", "",
             f"The same command run {len(results)} times; the table above is the first run. Speed-ups are side by side "
             "within each run.", "",
             "| revision | load average | fp32 peak GFLOP/s | dense fp32 extractor ms (rate 1) | % of peak | "
             + " | ".join(f"{path.removeprefix('onnxruntime-')} {rate:g} speed-up" for path, rate in RUN_TO_RUN) + " |",
             "|---" * (5 + len(RUN_TO_RUN)) + "|"]
    for result in results:
        rows = {(row["path"], row["rate"]): row for row in result["dinov2"]["rows"]}
        dense = rows[("onnxruntime", 1.0)]
        speedups = [f"{rows[key]['extractor_speedup']:.2f}x" if key in rows else "" for key in RUN_TO_RUN]
        lines.append(f"| {result.get('revision', 'unknown')} | {result['load_average'][0]:.2f} | "
                     f"{result['peak']['fp32']['peak_gflops']:.0f} | {dense['extractor_ms']:.1f} | "
                     f"{100 * dense['peak_fraction']['extractor']:.0f} | " + " | ".join(speedups) + " |")
    return lines


def graph_section(result: dict) -> list[str]:
    episode = result.get("eval_worker_episode")
    worker = "" if not episode else (f" The evaluation worker drives {episode['scenario']}, layout {episode['layout']}, "
                                     f"{episode['episode_s']:g} s, in a spawned process on the extractor's threads.")
    lines = ["## The extractor alone, in the live graph and in an evaluation worker, side by side", "",
             f"`{COMMANDS['graph']}` ({_load(result)}; the bundled drive's {result['frames']} frames alone and through the "
             f"live graph in lockstep, {result['repeats']} repeat(s) each, medians).{worker} {_peak(result['peak'])} "
             "Rows other than the shipped policy's own rate and tokens run a timing "
             "copy of it (its weights at that rate and tokens): their times, not their commands, mean something.", "",
             "| rate | tokens | precision | standalone ms | in the graph ms | graph / standalone | in an eval worker ms | "
             "eval worker / standalone | lockstep frames/s | camera->command p50 ms | p99 ms | GFLOP | "
             "% of peak (standalone / graph / eval worker) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["configurations"]:
        summary, efficiency = c["summary"], c["efficiency"] or {}

        def median(key, summary=summary):
            return "" if not summary.get(key) else f"{summary[key]['median']:.1f}"

        shares = " / ".join("" if efficiency.get(f"{key}_peak_fraction") is None else f"{100 * efficiency[f'{key}_peak_fraction']:.0f}"
                            for key in ("standalone", "graph_extractor", "eval_worker_extractor"))
        gflop = "" if c["flops"]["extractor"] is None else f"{c['flops']['extractor'] / 1e9:.2f}"

        def ratio(key, summary=summary):
            return "" if not summary.get(key) else f"{summary[key]['median']:.2f}"

        lines.append(f"| {c['rate']:g} | {c['tokens']} | {c['precision']} | {median('standalone_ms')} | {median('graph_extractor_ms')} | "
                     f"{ratio('graph_over_standalone')} | {median('eval_worker_extractor_ms')} | "
                     f"{ratio('eval_worker_over_standalone')} | {median('graph_fps')} | {median('camera_to_command_p50_ms')} | "
                     f"{median('camera_to_command_p99_ms')} | {gflop} | {shares} |")
    return lines


def ops_section(result: dict) -> list[str]:
    from sps_driving.tools.op_profile import calibration_rate

    profile = result["profile"]
    lines = ["## Where the dense fp32 backbone's time goes, by operator", "",
             f"`{COMMANDS['ops']}` ({_load(result)}; {profile['frames']} profiled frames of the encode graph on "
             f"{result['threads']} thread(s), {result['tokens']} tokens, onnxruntime's profiler). A profiled frame took "
             f"{profile['frame_ms']:.1f} ms (median); {100 * profile['product_share']:.0f}% of the kernel time is in "
             "matrix products.", "",
             "| operator | ms a frame | share of kernel time |", "|---|---|---|"]
    lines += [f"| {entry['op']} | {entry['ms']:.2f} | {100 * entry['share']:.1f}% |" for entry in profile["ops"]]
    lines += ["", "| product | batch x M x K x N | nodes a frame | ms a frame | GFLOP a frame | GFLOP/s in the model | "
              "calibration GFLOP/s at this shape | model / calibration |", "|---|---|---|---|---|---|---|---|"]
    for entry in profile["products"]:
        calibrated = calibration_rate(result["peak"], entry)
        ratio = f"{entry['gflops'] / calibrated:.2f}" if calibrated else ""
        lines.append(f"| {entry['op']} | {entry['batch']}x{entry['m']}x{entry['k']}x{entry['n']} | {entry['nodes_per_frame']} | "
                     f"{entry['ms']:.1f} | {entry['gflop']:.2f} | {entry['gflops']:.0f} | "
                     f"{f'{calibrated:.0f}' if calibrated else ''} | {ratio} |")
    lines += ["", "Calibration: onnxruntime's MatMul alone at the same (M, K, N), the best of repeated runs, measured in "
              "the same run (sps_driving/tools/peak.py)."]
    return lines


def eval_section(result: dict) -> list[str]:
    from sps_driving.sim.throughput import STAGES

    lines = ["## Evaluation throughput", "",
             f"`{COMMANDS['eval']}` ({_load(result)}; {len(result['tasks'])} episodes of {result['episode_s']:g} s per "
             f"configuration and round, {result['repeats']} round(s), {result['cores']} cores). Same results: every "
             "episode's score, failures, dropped frames and smallest gap equal the default's.", "",
             "| configuration | workers x threads | episodes per hour | speed-up | same results | ms per frame | "
             + " | ".join(STAGES) + " |", "|---|---|---|---|---|---|" + "---|" * len(STAGES)]
    for c in result["configurations"]:
        split = c["ms_per_frame"]
        lines.append(f"| {c['name']} | {c['workers']} x {c['threads_per_worker']} | {c['episodes_per_hour']:.0f} | "
                     f"{c['speedup']:.2f}x | {'yes' if c['same_results'] else 'no'} | {c['frame_ms']:.1f} | "
                     + " | ".join(f"{split[stage]:.1f} ({100 * split[stage] / c['frame_ms']:.0f}%)" for stage in STAGES) + " |")
    return lines


def best_train_entries(results: list[dict]) -> dict:
    """{(case, threads): entry} of `bench --train` runs of one trainer: each case's fastest epoch on the
    bound's clock over the runs, with the highest bound any run measured (the strictest fraction)."""
    best: dict = {}
    for result in results:
        for case in result["cases"]:
            for threads, entry in case["by_threads"].items():
                key = (case["label"], threads)
                bound = max(entry["bound_frames_per_s"], best.get(key, {}).get("bound_frames_per_s", 0.0))
                if key not in best or entry["clock_frames_per_s"] > best[key]["clock_frames_per_s"]:
                    best[key] = {**entry, "case": case}
                best[key]["bound_frames_per_s"] = bound
    return best


def _ms_per_frame(entry: dict, phase: str) -> float:
    frames = entry["case"]["validation_frames"] if phase == "validation" else entry["best"]["frames"]
    return 1e3 * entry["best"][entry["timed_by"]][phase] / frames


def train_section(before: list[dict], after: list[dict]) -> list[str]:
    """Training throughput of the trainer before and after, from runs of `bench --train` alternated
    between the two (`before`, `after`), against the highest bound any of them measured."""
    old, new = best_train_entries(before), best_train_entries(after)
    bounds = {key: max(old[key]["bound_frames_per_s"], new[key]["bound_frames_per_s"]) for key in new if key in old}
    loads = [result["load_average"][0] for result in (*before, *after)]
    first = after[0]
    lines = ["## Training throughput against the bound of the model's own products", "",
             f"`{COMMANDS['train']}`, run {len(before)} times with the trainer before and {len(after)} times after, "
             f"alternated ({first['data']}, batch {first['batch_size']}, {first['grid'][0]}x{first['grid'][1]} patches of "
             f"{first['descriptor_dim']}-d descriptors, both state inputs; revisions {before[0].get('revision', 'unknown')} "
             f"and {first.get('revision', 'unknown')}; load average {min(loads):.1f}-{max(loads):.1f}). Each row: the "
             "fastest epoch of any run, against the highest bound of any run. One thread: epoch and bound in CPU time; two: "
             "wall time.", "",
             "| case | threads | GFLOP/frame | bound frames/s (GFLOP/s) | before frames/s | after frames/s | speed-up | "
             "before % of bound | after % of bound |", "|---|---|---|---|---|---|---|---|---|"]
    for key, entry in new.items():
        if key not in old:
            continue
        case, bound = entry["case"], bounds[key]
        gflop = case["flops_per_frame"] / 1e9
        was, now = old[key]["clock_frames_per_s"], entry["clock_frames_per_s"]
        lines.append(f"| {key[0]} | {key[1]} | {gflop:.3f} | {bound:.0f} ({bound * gflop:.0f}) | {was:.0f} | {now:.0f} | "
                     f"{now / was:.2f}x | {100 * was / bound:.0f} | {100 * now / bound:.0f} |")
    lines += ["", "Where the fastest epoch's time went, on the same clock, ms per training frame (validation: per "
              "validation frame), before / after:", "", "| case | threads | " + " | ".join(TRAIN_PHASES) + " |",
              "|---|---|" + "---|" * len(TRAIN_PHASES)]
    for key, entry in new.items():
        if key not in old:
            continue
        cells = [f"{_ms_per_frame(old[key], phase):.2f} / {_ms_per_frame(entry, phase):.2f}" for phase in TRAIN_PHASES]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return lines


def render(dinov2: dict | None, graph: dict | None, throughput: dict | None, repeats: list[dict] = (),
           ops: dict | None = None, train: tuple[list[dict], list[dict]] | None = None) -> str:
    """The report; `repeats` are further runs of the dinov2 command, shown beside `dinov2` run to run."""
    lines = ["# CPU timing of the extractor the car runs", "",
             "What the road-band extractor costs on this machine's CPU: alone by path (fp32 and int8, dense and token "
             "dropping) and rate, in the live graph, and in evaluation. Made by `python -m sps_driving.tools.bench_report` "
             "from the runs below (sps_driving/tools/bench_report.py)."]
    if dinov2 is not None:
        lines += [""] + dinov2_section(dinov2)
        if repeats:
            lines += [""] + run_to_run_section([dinov2, *repeats])
    for section, result in ((ops_section, ops), (graph_section, graph), (eval_section, throughput)):
        if result is not None:
            lines += [""] + section(result)
    if train is not None:
        lines += [""] + train_section(*train)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dinov2", type=Path, nargs="+",
                        help="JSON of `sps-driving bench` (its dinov2 rows); further runs of it go run to run")
    parser.add_argument("--graph", type=Path, help="JSON of `sps-driving bench --graph`")
    parser.add_argument("--eval", type=Path, help="JSON of `sps-driving bench --eval`")
    parser.add_argument("--ops", type=Path, help="JSON of `python -m sps_driving.tools.op_profile`")
    parser.add_argument("--train-before", type=Path, nargs="+", help="JSON of `sps-driving bench --train` runs of the trainer before")
    parser.add_argument("--train-after", type=Path, nargs="+", help="... and after, alternated with them")
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    args = parser.parse_args(argv)
    dinov2_runs = [json.loads(path.read_text()) for path in args.dinov2 or ()]
    graph, throughput, ops = (json.loads(path.read_text()) if path else None for path in (args.graph, args.eval, args.ops))
    train = None if not (args.train_before and args.train_after) else tuple(
        [json.loads(path.read_text()) for path in paths] for paths in (args.train_before, args.train_after))
    args.out.write_text(render(dinov2_runs[0] if dinov2_runs else None, graph, throughput, dinov2_runs[1:], ops, train))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
