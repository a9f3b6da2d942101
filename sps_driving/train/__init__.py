"""Recorded drives -> feature cache (extract.py) -> trained policy (trainer.py)."""
