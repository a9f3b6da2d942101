"""selection: which patches each frame computes (SPS sections 3.3-3.4).

Follows the small CameraInfo published with each frame (the decision needs only the stamp) and
publishes a mono8 H' x W' mask (255 = computed) with that frame's stamp, viewable in RViz. With a
`checkpoint`, the policy's recorded selection and grid win over the parameters, so the car always
selects the way the policy was trained.
"""

from __future__ import annotations

import time

from rclpy.node import Node
from sensor_msgs.msg import CameraInfo, Image

from sps_driving.core import topics
from sps_driving.core.grid import PatchGrid
from sps_driving.core.selection import VARIANTS
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import Param, StageTimer, declare, run

PARAMETERS = {
    "checkpoint": Param("",
                        "policy folder; when set, its recorded selection and grid win over variant, rate, seed, grid_rows and grid_cols"),
    "variant": Param("sps", "selection variant (config/selection.yaml explains them)", choices=VARIANTS),
    "rate": Param(0.5, "keep-rate, the fraction of patches kept per frame; 0.5 = SPS-50%, the paper's best", "fraction", above=0.0,
                  max=1.0),
    "seed": Param(0, "with each frame's stamp (ns) it decides the subset", min=0),
    "grid_rows": Param(16, "H' of the backbone grid (DINOv2 ViT-S/14 at 224 px: 16)", "patches", min=1),
    "grid_cols": Param(16, "W' of the backbone grid", "patches", min=1),
}


class SelectionNode(Node):
    NODE_NAME = "selection"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        from sps_driving.core.selection import PatchSelector, SelectionConfig

        if p["checkpoint"]:
            from sps_driving.core.history import policy_selector
            from sps_driving.core.policies.checkpoint import read_policy_config

            policy = read_policy_config(p["checkpoint"])
            config = SelectionConfig.from_dict(policy["selection"])
            grid = PatchGrid(int(policy["grid"]["rows"]), int(policy["grid"]["cols"]))
            source = f"checkpoint {p['checkpoint']}"
            self.selector = policy_selector(policy, grid)  # a patch policy's may be shared across its window
        else:
            config = SelectionConfig(variant=p["variant"], rate=p["rate"], seed=p["seed"])
            grid = PatchGrid(p["grid_rows"], p["grid_cols"])
            source = "parameters"
            self.selector = PatchSelector(config, grid)
        self.grid = grid
        self.frames = 0
        self.publisher = self.create_publisher(Image, topics.SELECTION, msgs.qos("selection"))
        self.stage_timer = StageTimer(self, self.NODE_NAME)
        self.create_subscription(CameraInfo, topics.CAMERA_INFO, self._on_frame, msgs.qos("sensor"))
        self.get_logger().info(f"{config.variant} rate {config.rate} seed {config.seed} on {grid.rows}x{grid.cols} ({source})")

    def _on_frame(self, info: CameraInfo) -> None:
        started = time.perf_counter()
        stamp = msgs.stamp_ns(info.header)
        indices = self.selector.select(stamp)
        message = msgs.selection_message(indices, self.grid.rows, self.grid.cols, stamp, info.header.frame_id)
        ready = time.perf_counter()
        self.publisher.publish(message)
        self.frames += 1
        self.stage_timer.publish(stamp, started, ready, {"frames": self.frames, "kept": len(indices)})


def main(args=None) -> int:
    return run(SelectionNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
