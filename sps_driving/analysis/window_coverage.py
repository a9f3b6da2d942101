"""How much of the image a window of frames reveals at a keep-rate: the mean fraction of the grid's
patch positions kept in at least one frame of a patch policy's window (sps_driving.core.history).

    python -m sps_driving.analysis.window_coverage [--policy DIR] [--rates 1.0 0.7 0.5 0.3] [--window-frames 1 2 4 8]

One frame keeps k = ceil(rate * N) of N positions; T frames that each draw their own subset (SPS)
reveal 1 - (1 - k / N)^T on average (0.94 of the image at rate 0.5 and T = 4), so a window may
undo the regularization SPS gets from hiding half of each frame; a selection shared across the
window reveals one or two subsets per window. Measured with the selector the car runs, over
consecutive stamps at the stride (the grid, seed and stride of --policy, else config/train.yaml's
and the shipped policy's grid).
"""

from __future__ import annotations

import argparse
import json

from sps_driving.core.grid import PatchGrid
from sps_driving.core.history import HistorySettings, SharedWindowSelector, window_coverage
from sps_driving.core.selection import PatchSelector, SelectionConfig, kept_count

RATES = (1.0, 0.7, 0.5, 0.3)
WINDOW_FRAMES = (1, 2, 4, 8)


def coverage_table(grid: PatchGrid, rates, window_frames, stride_s: float, seed: int = 0, windows: int = 500) -> list[dict]:
    """One row per (rate, T): the fraction revealed by independent selections (measured, and its
    expectation) and by a selection shared across the window (measured)."""
    rows = []
    for rate in rates:
        selection = SelectionConfig("sps", rate, seed)
        for frames in window_frames:
            settings = HistorySettings(frames, stride_s, 0.0, max(1.0, frames * stride_s))
            rows.append({
                "rate": rate, "window_frames": frames,
                "independent": window_coverage(PatchSelector(selection, grid), settings, windows),
                "independent_expected": 1 - (1 - kept_count(rate, grid.n) / grid.n) ** frames,
                "shared": window_coverage(SharedWindowSelector(selection, grid, settings.block_ns), settings, windows),
            })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", help="checkpoint whose grid, selection seed and stride are used")
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--window-frames", type=int, nargs="+", default=list(WINDOW_FRAMES))
    parser.add_argument("--windows", type=int, default=500, help="consecutive windows measured per row")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    import yaml

    from sps_driving.core.history import history_settings
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.core.resources import config_path, shipped_policy

    config = read_policy_config(args.policy or shipped_policy())
    window = history_settings(config)
    stride_s = window.frame_stride_s if window else yaml.safe_load(config_path("train.yaml").read_text())["train"]["frame_stride_s"]
    grid = PatchGrid(int(config["grid"]["rows"]), int(config["grid"]["cols"]))
    rows = coverage_table(grid, args.rates, args.window_frames, stride_s, int(config["selection"]["seed"]), args.windows)
    if args.json:
        print(json.dumps({"grid": [grid.rows, grid.cols], "frame_stride_s": stride_s, "rows": rows}))
        return 0
    print(f"fraction of the {grid.rows}x{grid.cols} patch positions a window of T frames {stride_s:g} s apart reveals")
    print(f"{'rate':>6}{'T':>4}{'independent':>13}{'expected':>10}{'shared':>9}")
    for row in rows:
        print(f"{row['rate']:>6.2f}{row['window_frames']:>4d}{row['independent']:>13.3f}{row['independent_expected']:>10.3f}"
              f"{row['shared']:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
