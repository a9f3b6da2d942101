"""`sps-driving dagger --out DIR --init-cache CACHE`: on-policy data by DAgger (Ross, Gordon and
Bagnell 2011): roll out the policy, label every state it visits with the expert's command,
aggregate, retrain.

    sps-driving dagger --out runs/dagger --init-cache runs/cache30 --init-policy models/sps50_dinov2 \\
        --rounds 6 --episodes-per-round 20 --dev-first-seed 0 --dev-episodes 10

The initial policy (--init-policy, or one trained on the initial cache alone) is evaluated on the
development layouts first (DIR/initial). Round r (DIR/round_RR) then

1. rolls out the latest policy on --episodes-per-round fresh layouts of the in-distribution
   scenario (config/sim.yaml collect.scenario), collection seed --seed + r
   (sps_driving.sim.collect.episode_seed: disjoint from evaluation seeds and from every other
   round), with the expert mixed in: the expert's clean command drives with probability
   beta_r = beta0 * decay^r, drawn at every step (--mixing step) or once per episode (--mixing
   episode), the policy's command otherwise;
2. labels every visited frame with the expert's clean command for its state and writes the
   frame's descriptors of ALL patches, computed once by the policy's own extractor (the policy
   drives on its selected subset of those same descriptors), straight into a feature cache
   (DIR/round_RR/cache_seed_S, S its collection seed; the format and metadata of `sps-driving
   extract`, so the trainer reads it unchanged); --keep-bags also writes each drive as a rosbag2
   on the car's topics (DIR/round_RR/bags) for provenance and replay;
3. trains a policy (DIR/round_RR/policy) on the initial cache plus every round's cache so far,
   from scratch, or from the previous round's policy with --warm-start;
4. evaluates it on the development layouts (--dev-first-seed, --dev-episodes: evaluation
   seeds, which no round collects on), in process (sps_driving.sim.episodes.run_episodes).

A round is better when its mean development score is higher, or equal with a larger mean of the
episodes' smallest gap to any actor. The run stops after --rounds rounds or after --patience
rounds in a row without a better one. The best policy so far is always DIR/policy; its
config.json carries the run's provenance under "dagger", as does DIR/dagger.json.

Resumable: a round is done when DIR/round_RR/round.json exists, and rerunning the same command
continues with the first round that is not. A round cut short redoes only the rollouts its cache
lacks (each episode is a unit of the cache), resumes its training from the last finished epoch,
and runs only the development episodes missing from its results.jsonl. Under torchrun
(docs/distributed.md) the processes share the rollouts and development episodes and train with
DistributedDataParallel; process 0 writes the records. An argument that would make the rounds
inconsistent (anything but --rounds, --patience, --workers, --device, --keep-bags) cannot
change in a rerun: the error names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import yaml
from tqdm import tqdm

from sps_driving.core.resources import portable_path, source_revision
from sps_driving.ros import bagio
from sps_driving.sim.collect import COLLECTION_EPISODES, BagSink, episode_seed
from sps_driving.sim.config import command_sim_config
from sps_driving.sim.episodes import Frame, PolicyDriver, drive_episode, driving_state, run_episodes
from sps_driving.sim.expert import Command, Expert
from sps_driving.sim.results import RESULTS_FILE, EvalSettings, Recorder, read_results
from sps_driving.sim.scenarios import get_scenario
from sps_driving.sim.world import World, make_episode, rng_for
from sps_driving.train.distributed import Processes, digest, file_digest, start_processes

FORMAT = "sps_driving.dagger/1"
RECORD_FILE = "dagger.json"
DONE_FILE = "round.json"  # a round's (or the initial policy's) completion marker and summary
TRAINED_FILE = "trained.json"  # the round's training finished (its summary)
BEST_POLICY = "policy"
MIXINGS = ("step", "episode")
# TrainConfig fields that say where and on what, not how a round trains (the run sets them).
TRAIN_RUNTIME = {"cache", "out", "resume", "device"}


def round_dir(out: Path, index: int) -> Path:
    return out / f"round_{index:02d}"


def round_cache(out: Path, settings: dict, index: int) -> Path:
    # Named by its collection seed: several caches train as one only with distinct folder names,
    # also when a run continues from an earlier run's round caches.
    return round_dir(out, index) / f"cache_seed_{int(settings['seed']) + index}"


def run_path(out: Path, path) -> str:
    """How the run's records name `path`: relative to the run folder when inside it, else as
    result files do (resources.portable_path)."""
    path = Path(path).resolve()
    return path.relative_to(out.resolve()).as_posix() if path.is_relative_to(out.resolve()) else portable_path(path)


def beta(settings: dict, index: int) -> float:
    """The probability that the expert's command drives in round `index`."""
    return float(settings["beta0"]) * float(settings["decay"]) ** index


# ---- rollouts ----------------------------------------------------------------------------------


class MixedDriver:
    """The rollout driver: the expert's clean command (the frame's label) with probability beta,
    drawn each step or once per episode, else the policy's. The policy runs on every frame either
    way, since its extractor computes the descriptors the cache stores."""

    def __init__(self, policy: PolicyDriver, beta: float, mixing: str, rng: np.random.Generator):
        self.policy, self.beta, self.mixing, self.rng = policy, beta, mixing, rng
        self.episode_expert = mixing == "episode" and bool(rng.random() < beta)
        self.steps = 0
        self.expert_steps = 0

    def __call__(self, frame: Frame) -> Command:
        command = self.policy.drive(frame)
        expert = self.episode_expert if self.mixing == "episode" else bool(self.rng.random() < self.beta)
        self.steps += 1
        self.expert_steps += expert
        return frame.label if expert else command


def cache_row(frame: Frame) -> dict:
    """What the feature cache stores of a rollout frame besides its descriptors: the one place
    that says it (the label is the expert's clean command for the frame's state; the state inputs
    are what the policy read)."""
    return {"steering": frame.label.steering, "throttle": frame.label.throttle, "stamp_ns": frame.stamp_ns,
            "state": driving_state(frame.world)}


class CacheSink:
    """An episode loop sink that adds every frame's descriptors of all patches, with cache_row's
    labels, to a feature cache; frames that cannot be stored are counted by reason as extract does."""

    def __init__(self, writer, source: str):
        self.writer, self.source = writer, source
        self.counts: Counter = Counter()

    def __call__(self, frame: Frame, applied: Command) -> None:
        if frame.descriptors is None:  # the driver dropped the frame
            self.counts["undecodable_image"] += 1
            return
        try:
            self.writer.add(frame.descriptors, source=self.source, **cache_row(frame))
        except ValueError:
            self.counts["invalid_descriptors_or_label"] += 1
            return
        self.counts["written"] += 1


def rollout_episode(config: dict, scenario: str, seed: int, episode_index: int, policy: PolicyDriver, beta: float,
                    mixing: str, renderer, sinks) -> dict:
    """One rollout on the layout of `seed` (unperturbed start: at beta 1 this is `collect
    --no-disturbance`'s drive of that seed); returns its result with frames and expert_steps."""
    world = World(config, make_episode(config, get_scenario(scenario), seed))
    policy.reset()
    drops_before = policy.drops
    driver = MixedDriver(policy, beta, mixing, rng_for(seed, "dagger mixing"))
    result = drive_episode(config, world, episode_index, driver, expert=Expert(config), renderer=renderer, sinks=sinks)
    result.update(episode=episode_index, frames=driver.steps, expert_steps=driver.expert_steps,
                  dropped_frames=policy.drops - drops_before)
    return result


def collect_round(config: dict, settings: dict, index: int, policy_dir: Path, out: Path, extractor_record: dict,
                  keep_bags: bool, processes: Processes) -> dict:
    """Round `index`'s rollouts into its feature cache (and bags); returns their summary. Each
    episode is a unit of the cache (sps_driving.train.cache.UnitCacheWriter): a cut-short round
    redoes only the episodes it had not finished, and under torchrun the episodes go round the
    processes, each rolling out on its own device."""
    from sps_driving.sim.render import get_renderer

    procs = processes
    policy = _round_policy(settings, policy_dir, extractor_record, procs)
    b = beta(settings, index)
    seeds = [episode_seed(settings["seed"] + index, i) for i in range(settings["episodes_per_round"])]
    units = [f"{i:05d}" for i in range(len(seeds))]
    writer = _round_writer(config, settings, index, policy, policy_dir, out, extractor_record, seeds, units, procs)
    bags, renderer = round_dir(out, index) / "bags", get_renderer(config)

    def rollout(i: int, sinks: list) -> dict:
        return rollout_episode(config, settings["scenario"], seeds[i], i, policy, b, settings["mixing"], renderer, sinks)

    bar = tqdm(total=len(seeds), desc=f"dagger round {index} rollouts", unit="episode", disable=not procs.main)
    for first in range(0, len(seeds), procs.world_size):  # rounds of one episode per process
        i, ran = first + procs.rank, 0
        if i < len(seeds) and writer.done(units[i]) is None:
            shards = writer.unit(units[i], f"shard_{i:05d}")
            sink = CacheSink(shards, _source(i))
            if keep_bags:
                shutil.rmtree(bags / _source(i), ignore_errors=True)  # a cut-short episode's
                with bagio.BagWriter(bags / _source(i), storage=config["collect"]["storage"]) as bag:
                    result = rollout(i, [sink, BagSink(bag, config)])
            else:
                result = rollout(i, [sink])
            shards.finish({"counts": dict(sink.counts), "episode": _finite({**result, "seed": seeds[i]}), "bag": keep_bags})
            ran = 1
        bar.update(int(procs.all_sum(ran)[0]))
    bar.close()
    records = writer.records([units[i] for i in range(procs.rank, len(seeds), procs.world_size)])
    episodes = [record["episode"] for record in records]
    writer.close(records, {
        "inputs": [str(bags / _source(i)) for i, record in enumerate(records) if record["bag"]],
        "counts": {_source(i): record["counts"] for i, record in enumerate(records)},
        "dagger": {"round": index, "beta": b, "mixing": settings["mixing"], "policy": run_path(out, policy_dir),
                   "scenario": settings["scenario"], "seeds": seeds, "extraction_runtime": policy.extraction.facts}})
    frames = sum(e["frames"] for e in episodes)
    return {"beta": b, "seeds": seeds, "frames": frames, "written": sum(record["frames"] for record in records),
            "expert_share": sum(e["expert_steps"] for e in episodes) / max(frames, 1), "episodes": episodes}


def _round_policy(settings: dict, policy_dir: Path, extractor_record: dict, procs: Processes) -> PolicyDriver:
    """The policy that drives a round's rollouts, checked to compute the initial cache's kind of descriptors."""
    policy = PolicyDriver(str(policy_dir), str(procs.device), backbone_config=settings["backbone_config"], all_patches=True)
    differ = descriptor_differences(policy.extraction.settings.config, extractor_record)
    if differ:
        raise ValueError(f"policy {policy_dir} computes other descriptors than the initial cache ({differ}): "
                         f"their data cannot train one policy")
    return policy


def _round_writer(config: dict, settings: dict, index: int, policy: PolicyDriver, policy_dir: Path, out: Path,
                  extractor_record: dict, seeds: list[int], units: list[str], procs: Processes):
    """The round cache's writer, one unit per episode; its plan names what the rollouts depend on, so
    that a rerun with another plan starts the cache anew and one with the same plan resumes it."""
    from sps_driving.core.policies.checkpoint import CONFIG_FILE, WEIGHTS_FILE
    from sps_driving.train.cache import META_FILE, UnitCacheWriter
    from sps_driving.train.extract import ExtractSettings

    extractor, cache = policy.extractor, round_cache(out, settings, index)
    meta = {
        "backbone": extractor.name,
        "extractor": extractor_record,  # the initial cache's record: the descriptors are checked to be the same kind
        "grid": {"rows": extractor.grid.rows, "cols": extractor.grid.cols},
        "descriptor_dim": int(extractor.dim),
    }
    plan = {**meta, "policy": file_digest(policy_dir / CONFIG_FILE, policy_dir / WEIGHTS_FILE), "beta": beta(settings, index),
            "mixing": settings["mixing"], "scenario": settings["scenario"], "seeds": seeds, "sim_config": digest(config)}
    complete = procs.first(lambda: (cache / META_FILE).is_file())  # without its rollouts.json: made anew
    return UnitCacheWriter(cache, meta, plan, units, [_source(i) for i in range(len(seeds))], extractor.position_table(),
                           ExtractSettings.from_yaml().shard_size, overwrite=complete, processes=procs)


def descriptor_differences(record: dict, other: dict) -> list[str]:
    """The descriptor settings (core.backbones.DESCRIPTOR_KEYS) in which two extractor records
    differ, each completed with the defaults; runtime settings (backend, threads, ...) do not count."""
    from sps_driving.core.backbones import DESCRIPTOR_KEYS, resolve_config
    from sps_driving.export.extractors import policy_extraction

    a, b = (resolve_config(policy_extraction({"extractor": r})) for r in (record, other))
    return [key for key in DESCRIPTOR_KEYS if _json(a.get(key)) != _json(b.get(key))]


def _source(index: int) -> str:
    return f"episode_{index:05d}"  # as a bag of `collect` names it, so `extract` of the bag names it the same


def _json(value):
    """`value` as JSON reads it back (tuples become lists): what a stored record is compared with."""
    return json.loads(json.dumps(value))


# ---- training and development evaluation -------------------------------------------------------


def train_policy(train_settings: dict, caches: list[Path], out: Path, init_checkpoint: Path | None, device: str,
                 run: Path, processes: Processes) -> dict:
    """Train on `caches` into `out` (resuming a cut-short run there); the summary is kept in
    out/trained.json, and a finished training is not repeated. `run`: the run folder. Under
    torchrun every process trains (DistributedDataParallel: sps_driving.train.trainer)."""
    from sps_driving.train.trainer import TrainConfig, has_last_epoch, train

    done = out / TRAINED_FILE
    finished, resume = processes.first(lambda: (json.loads(done.read_text()) if done.is_file() else None,
                                                has_last_epoch(out)))
    if finished is not None:
        return finished
    cfg = TrainConfig(**train_settings, cache=[str(c) for c in caches], out=str(out), device=device, resume=resume)
    start = time.perf_counter()
    summary = train(cfg, init_checkpoint=init_checkpoint)
    summary = {key: summary[key] for key in ("best_validation_loss", "best_epoch", "epochs_run", "stopped_early",
                                             "train_frames", "validation_frames")}
    summary.update(seconds=time.perf_counter() - start, warm_start_from=None if init_checkpoint is None else
                   run_path(run, init_checkpoint), caches=[run_path(run, c) for c in caches])
    processes.first(lambda: done.write_text(json.dumps(summary, indent=1) + "\n"))
    return summary


def dev_evaluate(config: dict, settings: dict, policy_dir: Path, out: Path, workers: int, processes: Processes) -> dict:
    """Run the development episodes missing from out/results.jsonl (under torchrun: shared by
    the processes, as `eval` shares them); returns their summary."""
    import torch

    procs = processes
    path = out / RESULTS_FILE
    wanted = range(settings["dev_first_seed"], settings["dev_first_seed"] + settings["dev_episodes"])
    scenario = settings["scenario"]

    def missing():
        done = {r["episode"] for r in read_results(path) if r["scenario"] == scenario}
        return [(scenario, e) for e in wanted if e not in done]

    tasks = procs.first(missing)
    if tasks:
        out.mkdir(parents=True, exist_ok=True)
        cam = config["camera"]
        eval_settings = EvalSettings("dagger-dev", str(policy_dir), "dev", len(wanted), float(config["episode_s"]),
                                     int(cam["render_width"]), int(cam["render_height"]), settings["dev_first_seed"])
        record = Recorder(eval_settings, path, len(tasks)) if procs.main else None
        threads = torch.get_num_threads()  # one worker runs in this process and sets its own
        try:
            run_episodes(config, str(policy_dir), tasks, workers, str(procs.device), record, settings["backbone_config"],
                         processes=procs)
        finally:
            if record is not None:
                record.close()
            torch.set_num_threads(threads)
    return procs.first(lambda: _dev_summary(path, scenario, wanted))


def _dev_summary(path: Path, scenario: str, wanted: range) -> dict:
    rows = {r["episode"]: r for r in read_results(path) if r["scenario"] == scenario}
    rows = [rows[e] for e in wanted]
    gaps = [float(r["min_gap_m"]) for r in rows]
    return {"score": float(np.mean([r["score"] for r in rows])), "min_gap_m": min(gaps),
            "mean_min_gap_m": float(np.mean(gaps)), "interventions": int(sum(r["interventions"] for r in rows)),
            "episodes": [{key: r[key] for key in ("episode", "seed", "score", "interventions", "min_gap_m")} for r in rows]}


def better(dev: dict, best: dict) -> bool:
    """A higher mean score, or the same with a larger mean smallest gap (null: no actor ever near)."""
    def key(d):
        return d["score"], math.inf if d["mean_min_gap_m"] is None else d["mean_min_gap_m"]
    return key(dev) > key(best)


# ---- settings, provenance and the run ----------------------------------------------------------


def run_settings(args, config: dict, train_settings: dict) -> dict:
    """Every setting a rerun must keep (by option name, dashes as underscores)."""
    backbone_config = args.backbone_config and str(Path(args.backbone_config).resolve())
    return _json({
        "init_cache": [str(Path(c).resolve()) for c in args.init_cache],
        "init_policy": args.init_policy and str(Path(args.init_policy).resolve()),
        "episodes_per_round": args.episodes_per_round,
        "beta0": args.beta0,
        "decay": args.decay,
        "mixing": args.mixing,
        "seed": args.seed,
        "scenario": config["collect"]["scenario"],
        "dev_first_seed": args.dev_first_seed,
        "dev_episodes": args.dev_episodes,
        "warm_start": args.warm_start,
        "backbone_config": backbone_config,
        "backbone_config_contents": backbone_config and yaml.safe_load(Path(backbone_config).read_text()),
        "train_config": train_settings,
        "sim_config": config,  # with --episode-s and --width applied
    })


PATH_SETTINGS = ("init_cache", "init_policy", "backbone_config")


def recorded_settings(settings: dict, out: Path) -> dict:
    """`settings` as dagger.json records them: paths relative to the run folder, so that a run moved
    with what it reads (a checkout at another path, another machine) resumes; a path an older record
    holds absolute is read the same way."""
    def relative(path):
        return os.path.relpath(out.resolve() / path, out.resolve())

    recorded = dict(settings)
    for key in PATH_SETTINGS:
        value = recorded.get(key)
        if value:
            recorded[key] = [relative(v) for v in value] if isinstance(value, list) else relative(value)
    return recorded


def changed_settings(stored: dict, current: dict) -> list[str]:
    """The settings that differ, named by their option (with the differing keys of a config file)."""
    changes = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key), current.get(key)
        if old == new:
            continue
        if key == "sim_config":
            changes.append("--sim-config, --episode-s or --width (the simulator settings differ)")
        elif key == "train_config":
            keys = sorted(k for k in set(old or {}) | set(new or {}) if (old or {}).get(k) != (new or {}).get(k))
            changes.append(f"--train-config or --init-policy (training settings {', '.join(keys)})")
        elif key == "backbone_config_contents":
            changes.append("--backbone-config (its contents)")
        else:
            changes.append(f"--{key.replace('_', '-')} (was {old!r}, now {new!r})")
    return changes


def training_settings(path: str, init_policy: str | None) -> dict:
    """TrainConfig's settings from `path`'s train: section; the initial policy's own selection,
    architecture and output bound over them, so every round trains the kind of policy it started from."""
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.core.policies.registry import architecture_of
    from sps_driving.train.trainer import TrainConfig

    overrides = {}
    if init_policy:
        policy = read_policy_config(init_policy)
        selection = policy["selection"]
        overrides = {"variant": selection["variant"], "rate": selection["rate"], "seed": selection["seed"],
                     "keep_probability": selection.get("keep_probability"), "architecture": architecture_of(policy),
                     "max_steering_rad": policy["output"]["max_steering_rad"], **policy["policy"]}
    cfg = TrainConfig.from_yaml(path, cache="", out="", **overrides)
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in TRAIN_RUNTIME}


def colliding_collections(init_caches: list[str], seed: int, rounds: int) -> list[str]:
    """Initial-cache inputs collected (`collect`, its collect.json) on a seed a round would use."""
    from sps_driving.train.cache import META_FILE

    found = []
    for cache in init_caches:
        meta = json.loads((Path(cache) / META_FILE).read_text())
        for source in meta.get("inputs", []):
            for manifest in (Path(source) / "collect.json", Path(source).parent / "collect.json"):
                if manifest.is_file() and seed <= int(json.loads(manifest.read_text())["seed"]) < seed + rounds:
                    found.append(str(manifest))
    return sorted(set(found))


def _finite(value):
    """JSON-safe: infinite gaps (no actor near) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(record), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def _read_done(directory: Path) -> dict | None:
    path = directory / DONE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _finish(directory: Path, summary: dict) -> dict:
    """Write the completion marker; the summary as it reads back (as a rerun will see it)."""
    _write_json(directory / DONE_FILE, summary)
    return _read_done(directory)


def _summary_line(name: str, record: dict, best_name: str) -> str:
    dev = record["dev"]
    gap = "none near" if dev["min_gap_m"] is None else f"{dev['min_gap_m']:.2f} m"
    rollout = (f"beta {record['beta']:.3g}, {record['frames']} frames, expert share {record['expert_share']:.2f}, "
               if "frames" in record else "")
    return (f"{name}: {rollout}dev score {dev['score']:.3f}, min gap {gap}, interventions {dev['interventions']}, "
            f"{sum(record['seconds'].values()):.0f} s" + (" (best)" if name == best_name else f" (best: {best_name})"))


class Run:
    """A DAgger run folder: its settings and provenance record (dagger.json) and the best policy (policy/)."""

    def __init__(self, out: Path, settings: dict, command: str):
        self.out, self.settings, self.command = out, settings, command
        self.path = out / RECORD_FILE
        self.record = json.loads(self.path.read_text()) if self.path.is_file() else None

    def start(self) -> None:
        """Refuse changed settings; record this invocation's command and the code revision."""
        if self.record is not None:
            changes = changed_settings(recorded_settings(self.record["settings"], self.out),
                                       recorded_settings(self.settings, self.out))
            if changes:
                raise ValueError(f"{self.out} was started with other settings: changed {'; '.join(changes)}. Its rounds "
                                 f"would be inconsistent: rerun with the original values or choose another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        self.record = self.record or {"format": FORMAT, "settings": recorded_settings(self.settings, self.out),
                                      "commands": []}
        if self.command not in self.record["commands"]:
            self.record["commands"].append(self.command)
        revision = source_revision()
        if revision != "unknown":
            self.record["revision"] = revision
        _write_json(self.path, self.record)

    def publish(self, initial: dict, rounds: list[dict], caches: list[Path], best_name: str, stopped: str | None) -> dict:
        """Write the provenance to dagger.json, and the best policy with it to policy/."""
        from sps_driving.core.policies.checkpoint import load_policy, read_policy_config, save_policy

        best = initial if best_name == "initial" else rounds[int(best_name.split()[-1])]
        s, recorded = self.settings, recorded_settings(self.settings, self.out)
        provenance = {
            **{k: v for k, v in self.record.items() if k in ("format", "commands", "revision")},
            "settings": {k: v for k, v in recorded.items() if k != "sim_config"},
            "beta_schedule": {"beta0": s["beta0"], "decay": s["decay"], "mixing": s["mixing"],
                              "betas": [r["beta"] for r in rounds]},
            "initial": {"policy": run_path(self.out, initial["policy"]), "trained": initial["train"] is not None,
                        "dev": initial["dev"]},
            "rounds": [{key: r[key] for key in ("round", "beta", "seeds", "frames", "written", "expert_share", "cache",
                                                "policy", "train", "dev", "seconds")} for r in rounds],
            "caches": [run_path(self.out, c) for c in caches],
            "dev_scores": {"initial": initial["dev"]["score"], **{f"round {r['round']}": r["dev"]["score"] for r in rounds}},
            "best": {"name": best_name, "policy": run_path(self.out, self._policy_dir(best)), "dev": best["dev"]},
            "stopped": stopped,
        }
        self.record = {**self.record, **provenance, "settings": recorded}
        _write_json(self.path, self.record)
        policy_dir = self._policy_dir(best)
        config = {**read_policy_config(policy_dir), "dagger": provenance}
        save_policy(load_policy(policy_dir).module, _finite(config), self.out / BEST_POLICY)
        return provenance

    def _policy_dir(self, summary: dict) -> Path:
        return self.out / summary["policy"]


def command_line(args) -> str:
    """The command with every option's value, defaults included: it reruns this run."""
    words = ["sps-driving", "dagger"]
    for key, value in vars(args).items():
        if key in ("command", "run") or value is None or value is False:
            continue
        words.append(f"--{key.replace('_', '-')}")
        if value is not True:
            words += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return shlex.join(words)


def run_dagger(args, processes: Processes | None = None) -> dict:
    """The run of `args`; under torchrun (`processes`) every process takes part in every step:
    its share of the rollouts and development episodes, training by DistributedDataParallel;
    process 0 writes the records."""
    out, config = Path(args.out), _sim_config(args)
    train_settings = training_settings(args.train_config, args.init_policy)
    settings = run_settings(args, config, train_settings)
    procs = processes or Processes()
    procs.agree("the DAgger settings (simulator, training and extraction settings included)", settings)
    run = Run(out, settings, command_line(args))
    extractor_record = _checked_extractor_record(args, settings, out)
    procs.first(run.start)

    initial = _initial(args, config, settings, train_settings, out, procs)
    best_name, best, rounds, since_best, stopped = "initial", initial, [], 0, None
    caches, latest = [Path(c) for c in settings["init_cache"]], out / initial["policy"]
    procs.first(run.publish, initial, rounds, caches, best_name, None)
    if procs.main:
        tqdm.write(_summary_line("initial", initial, best_name))
    for index in range(args.rounds):
        name, directory = f"round {index}", round_dir(out, index)
        summary = procs.first(_read_done, directory)
        if summary is None:
            finished = run_round(config, settings, train_settings, index, latest, caches, out, extractor_record, args, procs)
            summary = procs.first(_finish, directory, finished)
        caches.append(round_cache(out, settings, index))
        latest = out / summary["policy"]
        rounds.append(summary)
        if better(summary["dev"], best["dev"]):
            best_name, best, since_best = name, summary, 0
        else:
            since_best += 1
        procs.first(run.publish, initial, rounds, caches, best_name, None)
        if procs.main:
            tqdm.write(_summary_line(name, summary, best_name))
        if since_best >= args.patience:
            stopped = f"no better development score in {args.patience} round(s)"
            break
    else:
        stopped = f"{args.rounds} round(s) run"
    provenance = procs.first(run.publish, initial, rounds, caches, best_name, stopped)
    if procs.main:
        tqdm.write(f"dagger: {stopped}; best: {best_name} (dev score {best['dev']['score']:.3f}), now {out / BEST_POLICY}")
    return provenance


def _sim_config(args) -> dict:
    """The simulator's settings with the run's --episode-s and --width, its scenario checked."""
    config = command_sim_config(args.sim_config, args.episode_s, args.width)
    get_scenario(config["collect"]["scenario"])
    return config


def _checked_extractor_record(args, settings: dict, out: Path) -> dict:
    """The initial cache's extractor record, after checking that the rounds' layouts and caches do
    not collide with the initial cache's and that --init-policy reads the same descriptors."""
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.train.cache import FeatureCache

    collisions = colliding_collections(settings["init_cache"], args.seed, args.rounds)
    if collisions:
        raise ValueError(f"--seed {args.seed}: rounds {args.seed}..{args.seed + args.rounds - 1} would collect on layouts "
                         f"of the initial cache ({', '.join(collisions)}): choose another --seed")
    init_cache = FeatureCache(settings["init_cache"])  # checks the caches, and that they train together
    repeated = sorted({round_cache(out, settings, i).name for i in range(args.rounds)}
                      & {Path(c).name for c in settings["init_cache"]})
    if repeated:
        raise ValueError(f"--init-cache already holds {', '.join(repeated)}, the name of a round's cache: "
                         f"choose another --seed")
    extractor_record = init_cache.meta.get("extractor") or {"backbone": init_cache.backbone}
    if args.init_policy:
        policy_config = read_policy_config(args.init_policy)
        differ = descriptor_differences(policy_config.get("extractor") or {"backbone": policy_config.get("backbone")},
                                        extractor_record)
        if differ:
            raise ValueError(f"--init-policy {args.init_policy} was trained on other descriptors than --init-cache "
                             f"{init_cache.name} ({differ})")
    return extractor_record


def _initial(args, config: dict, settings: dict, train_settings: dict, out: Path, procs: Processes) -> dict:
    """The initial policy's summary: --init-policy, or one trained on the initial cache; with its
    development evaluation. A rerun reads it from the run folder."""
    initial_dir = out / "initial"
    initial = procs.first(_read_done, initial_dir)
    if initial is not None:
        return initial
    start = time.perf_counter()
    if args.init_policy:
        policy_dir, trained = Path(args.init_policy).resolve(), None
    else:
        policy_dir = initial_dir / "policy"
        trained = train_policy(train_settings, [Path(c) for c in settings["init_cache"]], policy_dir, None, args.device,
                               out, procs)
    seconds = {"train": time.perf_counter() - start}
    start = time.perf_counter()
    dev = dev_evaluate(config, settings, policy_dir, initial_dir / "dev", args.workers, procs)
    seconds["dev"] = time.perf_counter() - start
    # The policy named relative to the run folder, or absolute (--init-policy): a rerun finds it either way.
    inside = policy_dir.resolve().is_relative_to(out.resolve())
    return procs.first(lambda: _finish(initial_dir, {
        "policy": run_path(out, policy_dir) if inside else str(policy_dir.resolve()), "train": trained, "dev": dev,
        "seconds": seconds}))


def run_round(config: dict, settings: dict, train_settings: dict, index: int, latest: Path, caches: list[Path], out: Path,
              extractor_record: dict, args, processes: Processes) -> dict:
    """Round `index`: rollouts of `latest` into the round's cache (unless complete), training on
    every cache so far plus it, the development evaluation."""
    from sps_driving.train.cache import META_FILE

    directory = round_dir(out, index)
    directory.mkdir(parents=True, exist_ok=True)
    seconds = {}
    start = time.perf_counter()
    rollouts_file = directory / "rollouts.json"
    collected = processes.first(lambda: (round_cache(out, settings, index) / META_FILE).is_file() and rollouts_file.is_file())
    if not collected:
        summary = collect_round(config, settings, index, latest, out, extractor_record, args.keep_bags, processes)
        processes.first(lambda: _write_json(rollouts_file, summary))
    rollouts = processes.first(lambda: json.loads(rollouts_file.read_text()))
    seconds["rollouts"] = time.perf_counter() - start
    start = time.perf_counter()
    trained = train_policy(train_settings, [*caches, round_cache(out, settings, index)], directory / "policy",
                           latest if settings["warm_start"] else None, args.device, out, processes)
    seconds["train"] = time.perf_counter() - start
    start = time.perf_counter()
    dev = dev_evaluate(config, settings, directory / "policy", directory / "dev", args.workers, processes)
    seconds["dev"] = time.perf_counter() - start
    return {"round": index, **rollouts, "cache": run_path(out, round_cache(out, settings, index)),
            "policy": run_path(out, directory / "policy"), "train": trained, "dev": dev, "seconds": seconds}


# ---- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sps_driving.train.trainer import TRAIN_CONFIG

    parser.add_argument("--out", required=True, help="run folder: initial/, round_RR/, dagger.json, policy/ (the best)")
    parser.add_argument("--init-cache", required=True, nargs="+", metavar="CACHE",
                        help="feature cache(s) of the initial data (sps-driving extract of expert drives)")
    parser.add_argument("--init-policy", help="policy to start from (default: one trained on --init-cache)")
    parser.add_argument("--rounds", type=int, default=5, help="most rounds to run (may grow in a rerun)")
    parser.add_argument("--episodes-per-round", type=int, default=20, help="rollout episodes per round")
    parser.add_argument("--beta0", type=float, default=0.5,
                        help="round 0's probability that the expert's command drives (beta_r = beta0 * decay^r)")
    parser.add_argument("--decay", type=float, default=0.5, help="factor of beta from one round to the next")
    parser.add_argument("--mixing", choices=MIXINGS, default="step",
                        help="draw who drives at every step (default) or once per episode")
    parser.add_argument("--seed", type=int, default=1000,
                        help="round r collects on the layouts of collection seed SEED + r (keep clear of the initial data's)")
    parser.add_argument("--dev-first-seed", type=int, default=0, help="first evaluation seed of the development layouts")
    parser.add_argument("--dev-episodes", type=int, default=10, help="development episodes per round")
    parser.add_argument("--patience", type=int, default=2, help="stop after this many rounds without a better dev score")
    parser.add_argument("--warm-start", action="store_true",
                        help="train each round from the previous round's policy (default: from scratch)")
    parser.add_argument("--train-config", default=str(TRAIN_CONFIG),
                        help="YAML with a `train:` section (an --init-policy's selection and architecture win)")
    parser.add_argument("--keep-bags", action="store_true", help="also write every rollout as a rosbag2 (round_RR/bags)")
    parser.add_argument("--episode-s", type=float, help="episode length in s of rollouts and dev episodes (default config/sim.yaml)")
    parser.add_argument("--width", type=int, help="rendered image width in px (height follows the camera aspect)")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes of the development evaluation (under torchrun every process is one)")
    parser.add_argument("--device", default="cpu", help="torch device for extraction, policy and training")
    parser.add_argument("--backbone-config", help="extraction settings file under the policy's own (e.g. backend: torch)")
    parser.add_argument("--sim-config", help="simulator YAML (default config/sim.yaml)")


def run(args) -> int:
    for name in ("rounds", "episodes_per_round", "dev_episodes", "patience", "workers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"dagger: --{name.replace('_', '-')} must be at least 1")
    if not (0.0 <= args.beta0 <= 1.0 and 0.0 <= args.decay <= 1.0):
        raise SystemExit("dagger: --beta0 and --decay must lie in [0, 1]")
    if args.seed < 0 or args.dev_first_seed < 0:
        raise SystemExit("dagger: --seed and --dev-first-seed must be non-negative")
    if args.episodes_per_round > COLLECTION_EPISODES:
        raise SystemExit(f"dagger: --episodes-per-round is at most {COLLECTION_EPISODES}: "
                         f"one collection seed's layouts, beyond which rounds would share layouts")
    procs = start_processes(args.device)
    try:
        run_dagger(args, procs)
    except (OSError, ValueError) as error:  # changed settings, bad caches or checkpoints, disagreeing processes
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        procs.close()
    return 0
