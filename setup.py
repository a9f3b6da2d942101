import os
import runpy
from glob import glob

from setuptools import find_packages, setup

package_name = "sps_driving"

# One executable per node, listed in sps_driving/ros/executables.py: read here as a file, since the
# package (and its dependencies) need not be importable at build time.
NODES = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sps_driving", "ros", "executables.py"))["NODES"]

setup(
    name=package_name,
    version="0.1.0",
    packages=find_packages(exclude=["test", "test.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + package_name]),
        ("share/" + package_name, ["package.xml"]),
        ("share/" + package_name + "/launch", glob("launch/*.xml") + glob("launch/*.py")),
        ("share/" + package_name + "/config", glob("config/*.yaml") + glob("config/*.xml")),
        ("share/" + package_name + "/security", glob("security/*.xml")),
        ("share/" + package_name + "/security/common", glob("security/common/*.xml")),
        # PACMod 3 message definitions for sps_driving.ros.bagio (one source with interfaces/pacmod3_msgs).
        ("share/" + package_name + "/interfaces/pacmod3_msgs/msg", glob("interfaces/pacmod3_msgs/msg/*.msg")),
    ]
    # Shipped policies and the bundled drive keep their folder layout under share/.
    + [
        (os.path.join("share", package_name, folder.rstrip("/")), [f for f in glob(os.path.join(folder, "*")) if os.path.isfile(f)])
        for folder in sorted(glob("models/*/") + glob("models/*/*/") + glob("data/*/"))
    ],
    install_requires=["setuptools"],
    zip_safe=False,
    maintainer="sps_driving maintainers",
    maintainer_email="sps-driving@example.com",
    description="End-to-end driving from foundation-model patch descriptors with Stochastic Patch Selection.",
    license="MIT",
    tests_require=["pytest"],
    python_requires=">=3.10",
    entry_points={
        "console_scripts": [f"{name} = {package_name}.ros.nodes.{name}:main" for name in NODES]
        + ["sps-driving = sps_driving.cli:main", "respawn = sps_driving.ros.respawn:main"],
    },
)
