"""The policy's view drawn on a frame: dropped patches dimmed, kept ones outlined, tinted by
attribution; a strip of captioned frames."""

import numpy as np
import pytest

from sps_driving.core.overlay import (
    CAPTION_LINE_PX,
    DROPPED_DIM,
    KEPT_OUTLINE_RGB,
    FrameOverlay,
    draw_selection,
    frame_strip,
)

# a 2x2 grid over the lower 20x20 px of a 30x20 frame (the rows above are outside the region)
RECTANGLES = np.array([[0, 10, 10, 20], [10, 10, 20, 20], [0, 20, 10, 30], [10, 20, 20, 30]], float)
FRAME = np.full((30, 20, 3), 200, np.uint8)


def test_dropped_patches_are_dimmed_kept_ones_outlined_and_outside_the_region_untouched():
    out = draw_selection(FRAME, RECTANGLES, kept=np.array([0, 3]))
    assert out[15, 15].tolist() == [round(200 * DROPPED_DIM)] * 3  # patch 1, dropped
    assert out[25, 5].tolist() == [round(200 * DROPPED_DIM)] * 3  # patch 2, dropped
    assert out[15, 5].tolist() == [200] * 3  # inside kept patch 0
    assert out[10, 0].tolist() == list(KEPT_OUTLINE_RGB) and out[29, 19].tolist() == list(KEPT_OUTLINE_RGB)
    assert (out[:10] == 200).all()  # above the region of interest
    assert (FRAME == 200).all()  # the input is not drawn on


def test_attribution_tints_in_proportion_to_its_magnitude():
    out = draw_selection(FRAME, RECTANGLES, kept=np.array([0, 3]), attribution=np.array([-0.2, 0.05]))
    strong, weak = out[15, 5].astype(int), out[25, 15].astype(int)
    assert strong[0] > weak[0] >= 200 and strong[2] < weak[2] < 200  # redder where the command moved more
    flat = draw_selection(FRAME, RECTANGLES, kept=np.array([0, 3]), attribution=np.zeros(2))
    assert flat[15, 5].tolist() == [200] * 3


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="attributions for"):
        draw_selection(FRAME, RECTANGLES, kept=np.array([0, 3]), attribution=np.ones(3))
    with pytest.raises(ValueError, match="kept patch indices"):
        draw_selection(FRAME, RECTANGLES, kept=np.array([4]))
    with pytest.raises(ValueError, match="uint8"):
        draw_selection(FRAME.astype(np.float32), RECTANGLES, kept=np.array([0]))
    with pytest.raises(ValueError, match="one caption per frame"):
        frame_strip([FRAME], [])


def test_frame_strip_puts_scaled_frames_side_by_side():
    strip = frame_strip([FRAME, np.zeros((60, 40, 3), np.uint8)], ["t -0.2 s", "t 0.0 s"], height=60)
    assert strip.shape == (60, 40 + 40, 3) and strip.dtype == np.uint8
    assert (strip[40:, 5] == 200).all() and (strip[40:, 45] == 0).all()  # below the captions


def test_a_caption_of_two_lines_is_written_on_two_lines():
    one = frame_strip([np.zeros((60, 80, 3), np.uint8)], ["-0.3 s"], height=60)
    two = frame_strip([np.zeros((60, 80, 3), np.uint8)], ["-0.3 s\ncollision"], height=60)
    band = slice(4 + CAPTION_LINE_PX, 20 + CAPTION_LINE_PX)  # rows of the second line
    assert not one[band].any() and two[band].any()
    assert (one[:20] == two[:20]).all()  # the first line as before


def test_frame_overlay_caches_rectangles_per_frame_size_and_refuses_a_grid_that_does_not_tile():
    overlay = FrameOverlay([0.5, 1.0, 0.0, 1.0], (28, 56), (2, 4))
    out = overlay.draw(np.full((40, 80, 3), 200, np.uint8), kept=np.array([0]))
    assert (out[:20] == 200).all() and out[25, 35].tolist() == [round(200 * DROPPED_DIM)] * 3
    assert overlay.rectangles((40, 80)) is overlay.rectangles((40, 80))
    np.testing.assert_array_equal(overlay.rectangles((40, 80))[0], [0, 20, 20, 30])
    with pytest.raises(ValueError, match="does not tile"):
        FrameOverlay(None, (28, 56), (3, 4))
