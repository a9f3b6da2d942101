"""Shipped files name no folder of the machine that made them."""

from sps_driving.core.resources import SOURCE_ROOT, portable_record


def test_portable_record_rewrites_absolute_paths_alone_and_inside_commands():
    inside = str(SOURCE_ROOT / "runs" / "sps50")
    record = {
        "training": {"cache": ["/data/x/cache_rb20", f"{inside}/cache"], "frames": 16000, "rate": 0.5},
        "provenance": {"command": "sps-driving train --cache /data/x/cache_rb20 --out /tmp/q/sps50 --rate 0.5"},
        "units": {"steering": "front road-wheel angle, rad, left positive", "throttle": "[-1, 1], negative = brake"},
        "roi": [0.4, 0.65], "note": None,
    }
    portable = portable_record(record)
    assert portable["training"] == {"cache": ["cache_rb20", "runs/sps50/cache"], "frames": 16000, "rate": 0.5}
    assert portable["provenance"]["command"] == "sps-driving train --cache cache_rb20 --out sps50 --rate 0.5"
    assert portable["units"] == record["units"] and portable["roi"] == [0.4, 0.65] and portable["note"] is None
    assert "/data/" not in str(portable) and "/tmp/" not in str(portable)
