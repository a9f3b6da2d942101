import os
from pathlib import Path

import pytest

# Node tests talk over DDS on loopback only, and each test run gets its own domain so two
# runs on one machine never hear each other (ROS_DOMAIN_ID 1..101 are safe on every OS).
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ.setdefault("ROS_DOMAIN_ID", str(1 + os.getpid() % 101))
# A killed node's endpoints are forgotten after 2 s, as on the car (config/fastdds.xml).
os.environ.setdefault("FASTDDS_DEFAULT_PROFILES_FILE", str(Path(__file__).resolve().parent.parent / "config" / "fastdds.xml"))
# Node processes and the test process share two cores: busy-waiting OpenMP threads would make
# every torch process several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def model():
    """The embedded DINOv2 ViT-S/14, rebuilt once per test run."""
    from sps_driving.core.backbones.dinov2 import load_dinov2

    return load_dinov2()


@pytest.fixture(scope="session")
def extractor(model):
    from sps_driving.core.backbones.dinov2 import DinoV2Extractor

    return DinoV2Extractor(model)
