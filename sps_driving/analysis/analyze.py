"""`sps-driving analyze INPUT... --out DIR`: redundancy analysis of patch descriptors.

Each INPUT is a feature cache directory (descriptors of every patch, written by `sps-driving
extract`) or a bag (a rosbag2 folder, or a bare .mcap or .db3 file: sps_driving.ros.bagio), whose
camera frames are run through a backbone here; several inputs of one backbone are analysed as one
stream of frames. The output folder receives PNG figures (Figure 3a,
3b, similarity overlays as in Figure 6, the lemma sweep) and summary.json.

With --orbital, the patch state families of sps_driving.analysis.orbital instead (bag inputs:
their frames are shifted); with --orbital --appearance, the same layouts rendered by the
world under other scenarios (sps_driving.analysis.appearance), without inputs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from sps_driving.analysis.redundancy import AnalysisSettings, run_redundancy
from sps_driving.core.resources import config_path

CONFIG_NAME = "analysis.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", type=Path, metavar="INPUT",
                        help="feature cache directories and/or bags (rosbag2 folders, .mcap or .db3 files), analysed as one stream")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the figures and summary.json")
    parser.add_argument("--config", type=Path, default=None, help=f"analysis settings (default: the shipped {CONFIG_NAME})")
    parser.add_argument("--extractor-config", help="for bag inputs: YAML extractor config passed to the backbone loader")
    parser.add_argument("--backbone", help="for bag inputs: backbone name (overrides the extractor config)")
    parser.add_argument("--model-path", help="for bag inputs: local weights for the backbone (overrides the extractor config)")
    parser.add_argument("--device", help="for bag inputs: cpu, cuda, ... (overrides the extractor config)")
    parser.add_argument("--precision", choices=("fp32", "int8"),
                        help="for bag inputs: int8 runs onnxruntime's int8 graph (overrides the extractor config)")
    parser.add_argument("--image-topic", default=None, help="camera topic of bag inputs (default: the standard one)")
    parser.add_argument("--max-frames", type=int, default=None, help="analyse at most this many frames in all")
    parser.add_argument("--stride", type=int, default=1, help="analyse every this-many-th frame of each input (default 1)")
    parser.add_argument("--rank", type=int, default=None,
                        help="principal rank r for the lemma sweep (default: per frame, components to the 90%% level)")
    parser.add_argument("--overlay-image", type=Path, default=None,
                        help="when the overlay frame comes from a feature cache: its camera image (bags carry their frames)")
    orbital = parser.add_argument_group("patch state families (PMTT; docs/analysis.md)")
    orbital.add_argument("--orbital", action="store_true",
                         help="orbital views of every patch of bag frames: Center, Observed and Manifold coverage of "
                              "hidden states, effective rank, random / donor / shared controls (settings: the config's orbital:)")
    orbital.add_argument("--appearance", nargs="*", metavar="SCENARIO", default=None,
                         help="with --orbital and no INPUT: render the same layouts and poses under these scenarios "
                              "(default: the config's orbital.appearance.targets) and measure whether each patch's "
                              "shifted token stays inside the base frame's Manifold")
    orbital.add_argument("--first-seed", type=int, default=None, help="--appearance: first layout (episode seed)")
    orbital.add_argument("--episodes", type=int, default=None, help="--appearance: number of layouts")
    orbital.add_argument("--sim-config", default=None, help="--appearance: simulator YAML (default config/sim.yaml)")


def run(args: argparse.Namespace) -> int:
    if args.stride < 1 or (args.max_frames is not None and args.max_frames < 1):
        print("error: --stride and --max-frames must be at least 1", file=sys.stderr)
        return 2
    if args.appearance is not None and not args.orbital:
        print("error: --appearance is part of the orbital analysis: add --orbital", file=sys.stderr)
        return 2
    if bool(args.inputs) == (args.appearance is not None):
        print("error: give INPUT... (or, with --orbital --appearance, no INPUT: the world renders the frames)", file=sys.stderr)
        return 2
    if args.orbital:
        return _run_orbital(args)
    try:
        settings = AnalysisSettings.from_yaml(args.config or config_path(CONFIG_NAME))
        if args.rank is not None:
            settings = replace(settings, lemma_rank=args.rank)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_redundancy(args, settings)


def _run_orbital(args: argparse.Namespace) -> int:
    from sps_driving.analysis.orbital import OrbitalSettings, run_orbital

    try:
        settings = OrbitalSettings.from_yaml(args.config or config_path(CONFIG_NAME))
    except (OSError, ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.appearance is not None:
        from sps_driving.analysis.appearance import run_appearance

        return run_appearance(args, settings)
    return run_orbital(args, settings)
