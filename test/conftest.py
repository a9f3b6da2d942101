import atexit
import os
import shutil
import tempfile

import pytest

from sps_driving.ros.graph import isolate_ros

# Node tests talk over DDS on this machine only (UDP on 127.0.0.1, the car graph's settings
# otherwise: config/fastdds_loopback.xml), in a domain of the test run's own (or
# SPS_DRIVING_ROS_DOMAIN_ID), like the tools: two runs on one machine never hear each other, and
# the tools the tests call share the test run's domain.
isolate_ros()
# Node processes and the test process share two cores: busy-waiting OpenMP threads would make
# every torch process several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Exports made on first use (backend auto) go to a cache of the test run's own, which its node
# processes share: the tests neither read nor fill the user's cache.
if "SPS_DRIVING_CACHE_DIR" not in os.environ:
    os.environ["SPS_DRIVING_CACHE_DIR"] = tempfile.mkdtemp(prefix="sps_test_cache_")
    atexit.register(shutil.rmtree, os.environ["SPS_DRIVING_CACHE_DIR"], True)


@pytest.fixture(scope="session")
def model():
    """The embedded DINOv2 ViT-S/14, rebuilt once per test run."""
    from sps_driving.core.backbones.dinov2 import load_dinov2

    return load_dinov2()


@pytest.fixture(scope="session")
def extractor(model):
    from sps_driving.core.backbones.dinov2 import DinoV2Extractor

    return DinoV2Extractor(model)
