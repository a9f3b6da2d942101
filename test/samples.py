"""Real photographs for backbone tests: matplotlib ships them as sample data."""

import cv2
import numpy as np
from matplotlib import cbook


def sample_photo(name: str) -> np.ndarray:
    """uint8 RGB [H, W, 3] of one of matplotlib's sample images."""
    bgr = cv2.imread(str(cbook.get_sample_data(name, asfileobj=False)), cv2.IMREAD_COLOR)
    assert bgr is not None, name
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
