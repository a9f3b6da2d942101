"""Recorded drives -> feature cache (extract.py) -> trained policy (trainer.py)."""

import sys
from pathlib import Path


def train_config_path() -> Path:
    """config/train.yaml of the source tree (editable install), else the installed share/ copy."""
    source = Path(__file__).resolve().parents[2] / "config" / "train.yaml"
    return source if source.is_file() else Path(sys.prefix) / "share" / "sps_driving" / "config" / "train.yaml"
