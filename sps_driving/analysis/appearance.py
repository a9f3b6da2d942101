"""`sps-driving analyze --orbital --appearance [SCENARIO...] --out DIR`: does an appearance shift
stay inside the base frame's per-patch Manifold?

The world drives the expert on a layout (episode seed) in the base scenario and stops at fixed
control steps. Each pose is rendered in the base scenario, where every patch's state family
(canonical, visible, hidden) is read, and in each target scenario, where the patch's canonical
token s is read: the same place, seen in another appearance. Per patch, with c the base token and
M the Manifold fitted to the base frame's visible states:

- coverage of the shift by M: 1 - sum ||s - M(s)||^2 / sum ||s - c||^2 (M(s): s's bounded
  projection), pooled over patches; the same for Observed (the nearest visible state), for the
  visible mean alone, and for the controls' bounded spaces (random, donor, shared directions
  around the same mean and caps): what M covers beyond them is what its own directions explain;
- the shift's size in orbital units: sum ||s - c||^2 / sum mean_h ||h - c||^2, the squared
  shift over the mean squared distance of a hidden view to c.

Coverage near 1 would say the new appearance moves a token along directions (and within bounds)
that sub-patch shifts already explore; near 0, that it leaves them.

Each target is rendered twice: "own" as the world renders that scenario (its own scenery and
actor draws, which depend on the scenario's name: trees and fields placed anew), and "same" with
the base scenario's scenery draws and actors, so only what the scenario axes change differs.
"same" keeps the geometry exactly for a change of time of day or weather and of summer to fall;
spring and winter build other vegetation, whose draws then place later scenery anew.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from sps_driving.analysis.orbital import (
    FAMILIES,
    Family,
    FamilyTotals,
    OrbitalSettings,
    coverage,
    extractor_record,
    family_errors,
    nearest_point_errors,
    rounded,
    torch_extractor,
)
from sps_driving.core.orbital import Manifold, orbital_offsets

SUMMARY_FILE = "summary.json"
SCENERY_MODES = ("own", "same")
PREDICTIONS = ("manifold", "observed", "mean", "random", "donor", "shared")


def appearance_errors(family: Family, fits: dict[str, Manifold], shifted: np.ndarray) -> dict[str, np.ndarray]:
    """Per anchor [A]: the squared distance of the shifted token s [A, D] to the base token c
    ("center"), to its bounded projection on each of the base family's `fits` (the Manifold and
    the controls, by name), to the nearest visible state ("observed") and to the visible mean
    ("mean"); and the base family's mean squared hidden variation mean_h ||h - c||^2 ("orbit")."""
    shifted = np.asarray(shifted, dtype=np.float64)[:, None]
    return {
        "center": ((shifted - family.canonical[:, None]) ** 2).sum(axis=(1, 2)),
        **{name: ((shifted - fit.predict(shifted)) ** 2).sum(axis=(1, 2)) for name, fit in fits.items()},
        "observed": nearest_point_errors(shifted, family.visible)[:, 0],
        "mean": ((shifted[:, 0] - family.visible.mean(axis=1)) ** 2).sum(axis=1),
        "orbit": ((family.hidden - family.canonical[:, None]) ** 2).sum(axis=2).mean(axis=1),
    }


class ShiftTotals:
    """Running sums of appearance_errors for one target, scenery mode and family."""

    def __init__(self) -> None:
        self.sums = {name: 0.0 for name in ("center", "orbit", *PREDICTIONS)}
        self.anchors = 0
        self.inside = 0  # anchors whose shift the Manifold covers more than half of

    def add(self, errors: dict[str, np.ndarray]) -> None:
        for name in self.sums:
            self.sums[name] += float(np.sum(errors[name]))
        self.anchors += len(errors["center"])
        self.inside += int(np.sum(errors["manifold"] < 0.5 * errors["center"]))

    def summary(self) -> dict:
        s = self.sums
        return {
            "anchors": self.anchors,
            "coverage": {name: rounded(coverage(s[name], s["center"])) for name in PREDICTIONS},
            "shift_over_orbit": rounded(s["center"] / s["orbit"]) if s["orbit"] > 0 else None,
            "anchors_half_covered": rounded(self.inside / max(self.anchors, 1)),
        }


def render_poses(config: dict, base, targets, seed: int, steps) -> tuple[list[np.ndarray], dict]:
    """The base scenario's frames at control `steps` of an expert drive on layout `seed`, and
    {(target name, mode): frames at the same poses}."""
    from sps_driving.sim.expert import Expert
    from sps_driving.sim.render import get_renderer
    from sps_driving.sim.world import World, make_episode

    base_episode = make_episode(config, base, seed)
    world, expert = World(config, base_episode), Expert(config)
    poses = []
    for step in range(max(steps) + 1):
        if step in steps:
            poses.append(copy.copy(world))  # step() assigns a new state; the copy keeps this one
        command = expert.command(world)
        world.step(command.steering, command.throttle)
    episodes = {}
    for target in targets:
        own = make_episode(config, target, seed)
        episodes[(target.name, "own")] = own
        episodes[(target.name, "same")] = replace(own, actors=base_episode.actors, scenery=base.name)
    renderer = get_renderer(config)

    def frames(episode) -> list[np.ndarray]:
        images = []
        for pose in poses:
            view = copy.copy(pose)
            view.episode = episode
            images.append(renderer.render(view))
        return images

    return frames(base_episode), {key: frames(episode) for key, episode in episodes.items()}


def run_appearance(args, settings: OrbitalSettings) -> int:
    """The --orbital --appearance measurement on layouts the world renders."""
    from sps_driving.analysis.orbital_plot import APPEARANCE_FIGURE, plot_appearance
    from sps_driving.sim.config import load_sim_config
    from sps_driving.sim.scenarios import get_scenario

    first_seed = settings.appearance_first_seed if args.first_seed is None else args.first_seed
    episodes = settings.appearance_episodes if args.episodes is None else args.episodes
    try:
        base = get_scenario(settings.appearance_base)
        targets = [get_scenario(name) for name in (args.appearance or settings.appearance_targets)]
        if episodes < 1 or first_seed < 0:
            raise ValueError(f"--episodes must be at least 1 and --first-seed at least 0, got {episodes}, {first_seed}")
        config = load_sim_config(args.sim_config)
        extractor, extraction = torch_extractor(args)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    seeds = range(first_seed, first_seed + episodes)
    steps = tuple(int(s) for s in settings.appearance_steps)
    orbit, results = _measure_appearance(config, extractor, settings, base, targets, seeds, steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_appearance(results, out / APPEARANCE_FIGURE)
    summary = {
        "command": "sps-driving " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["analyze"] else None,
        "base": base.name,
        "targets": [t.name for t in targets],
        "layouts": list(seeds),
        "steps": list(steps),
        "render_size": [config["camera"]["render_width"], config["camera"]["render_height"]],
        "extractor": extractor_record(extraction),
        "settings": {"rank": settings.rank, "cap": settings.cap},
        "base_orbit": {family: totals.summary() for family, totals in orbit.items()},
        "shifts": results,
        "figures": [APPEARANCE_FIGURE],
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    _print_coverage(results)
    print(f"written to {out}")
    return 0


def _measure_appearance(config: dict, extractor, settings: OrbitalSettings, base, targets, seeds, steps) -> tuple[dict, dict]:
    """Each family's orbit on the base scenario's poses, and how much of each target's appearance
    shift at the same poses it covers: (orbit totals by family, {"target (mode)": {family: summary}})."""
    from tqdm import tqdm

    from sps_driving.core.orbital import OrbitalReader

    families = ("raw",) if extractor.unmasked else FAMILIES
    patch_px = extractor.input_size[0] // extractor.grid.rows
    visible, hidden = orbital_offsets(patch_px)
    family_reader = OrbitalReader(extractor, np.concatenate([np.zeros((1, 2), np.int64), visible, hidden]), families)
    token_reader = OrbitalReader(extractor, np.zeros((1, 2), np.int64), families)
    orbit = {family: FamilyTotals(extractor.grid.n, settings) for family in families}
    shifts = {(t.name, mode): {family: ShiftTotals() for family in families} for t in targets for mode in SCENERY_MODES}
    rng = np.random.default_rng(settings.seed)
    with tqdm(total=len(seeds) * len(steps), desc="appearance", unit="pose") as progress:
        for seed in seeds:
            base_frames, target_frames = render_poses(config, base, targets, seed, steps)
            for pose, image in enumerate(base_frames):
                states = family_reader.read(image)
                tokens = {key: token_reader.read(frames[pose]) for key, frames in target_frames.items()}
                for family in families:
                    day = Family.from_views(states[family], len(visible))
                    errors = family_errors(day, settings, rng)
                    orbit[family].add(errors)
                    for key, shifted in tokens.items():
                        shifts[key][family].add(appearance_errors(day, errors["fits"], shifted[family][0]))
                progress.update()
    results = {f"{name} ({mode})": {family: totals.summary() for family, totals in by_family.items()}
               for (name, mode), by_family in shifts.items()}
    return orbit, results


def _print_coverage(results: dict) -> None:
    for key, by_family in results.items():
        print(f"{key}: " + "; ".join(
            f"{family} Manifold covers {100 * (r['coverage']['manifold'] or 0):.1f}% of the shift "
            f"(Observed {100 * (r['coverage']['observed'] or 0):.1f}%, visible mean {100 * (r['coverage']['mean'] or 0):.1f}%, "
            f"random {100 * (r['coverage']['random'] or 0):.1f}%), shift = {r['shift_over_orbit']:.1f} x orbit"
            for family, r in by_family.items()))
