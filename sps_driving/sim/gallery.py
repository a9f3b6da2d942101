"""Scenario gallery: one camera frame per Table 1 scenario in one PNG.

    python -m sps_driving.sim.gallery --out docs/results/gallery.png

Every tile shows the same road layout (episode seed) driven by the expert up to the moment a
road-side actor is close ahead, so the tiles differ only by the scenario axes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from sps_driving.sim.config import load_sim_config, set_render_width
from sps_driving.sim.expert import Expert
from sps_driving.sim.scenarios import SCENARIOS
from sps_driving.sim.world import World, make_episode


def frame_with_actor_ahead(config: dict, scenario, seed: int, ahead_m: tuple[float, float] = (6.0, 10.0),
                           max_steps: int = 400) -> np.ndarray:
    from sps_driving.sim.render import get_renderer

    world, expert = World(config, make_episode(config, scenario, seed)), Expert(config)
    for _ in range(max_steps):
        gaps = [p.s - world.lane.s for p in world.actor_poses() if not p.spec.oncoming]
        if any(ahead_m[0] <= g <= ahead_m[1] for g in gaps):
            break
        c = expert.command(world)
        world.step(c.steering, c.throttle)
    return get_renderer(config).render(world)


def make_gallery(out: Path, seed: int = 1, width: int = 320, columns: int = 5, config: dict | None = None) -> Path:
    config = config or load_sim_config()
    set_render_width(config, width)
    tiles = []
    for scenario in tqdm(SCENARIOS, desc="gallery", unit="scenario"):
        tile = frame_with_actor_ahead(config, scenario, seed)[:, :, ::-1].copy()
        # OpenCV's fonts have no dagger: unseen car types are spelled out.
        text = scenario.label.replace("Car†", "Car (unseen type)") + (" - ID" if scenario.in_distribution else "")
        scale = width / 700.0
        banner = int(26 * scale) + 6
        tile[:banner] = (0.35 * tile[:banner]).astype(np.uint8)
        cv2.putText(tile, text, (5, banner - 6), cv2.FONT_HERSHEY_SIMPLEX, scale, (255, 255, 255), 1, cv2.LINE_AA)
        tiles.append(tile)
    blank = np.zeros_like(tiles[0])
    tiles += [blank] * (-len(tiles) % columns)
    rows = [np.concatenate(tiles[i : i + columns], axis=1) for i in range(0, len(tiles), columns)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(out), np.concatenate(rows, axis=0)):
        raise OSError(f"could not write {out}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results/gallery.png")
    parser.add_argument("--seed", type=int, default=1, help="episode seed (road layout) shown in every tile")
    parser.add_argument("--width", type=int, default=320, help="tile width in px")
    args = parser.parse_args(argv)
    print(make_gallery(Path(args.out), args.seed, args.width))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
