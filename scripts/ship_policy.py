"""Copy a trained policy into models/ for shipping: its weights as they are, its config.json
with every machine path made portable (sps_driving.core.resources.portable_record). The model
folder's README.md (what it is, how it was made, what it scores) is written by hand.

    python scripts/ship_policy.py runs/dagger/policy models/sps50_dinov2
"""

import argparse
import json
import shutil
from pathlib import Path

from sps_driving.core.policies.checkpoint import read_policy_config
from sps_driving.core.resources import portable_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", type=Path, help="trained policy folder (config.json + policy.safetensors)")
    parser.add_argument("out", type=Path, help="model folder to write, e.g. models/sps50_dinov2")
    args = parser.parse_args()
    config = read_policy_config(args.policy)  # refuses a folder that is not a policy
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.policy / "policy.safetensors", args.out / "policy.safetensors")
    (args.out / "config.json").write_text(json.dumps(portable_record(config), indent=1) + "\n")


if __name__ == "__main__":
    main()
