"""DecodeMask: the running batch's attention mask, grown in place, equals the mask rebuilt from its rows' lengths."""

import numpy as np
import pytest

from fxllm.runtime.decode_mask import ROOM, DecodeMask


def rebuilt(lengths: list[int], width: int, right_padded: bool) -> np.ndarray:
    """The mask as a fresh batch of rows of these lengths would have it."""
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for row, length in enumerate(lengths):
        mask[row, slice(0, length) if right_padded else slice(width - length, width)] = 1
    return mask


@pytest.mark.parametrize("right_padded", [True, False])
def test_growing_past_the_room_and_losing_rows_keeps_the_mask_exact(right_padded):
    lengths = [3, 9, 5]
    width = max(lengths)
    mask = DecodeMask(rebuilt(lengths, width, right_padded), right_padded)
    for step in range(ROOM + 40):  # past the buffer's first allocation
        grown = mask.grow()
        lengths = [length + 1 for length in lengths]
        width += 1
        if step == 10:  # the longest row leaves: right-padded rows drop its trailing columns
            mask.select_rows([2, 0])
            lengths = [lengths[2], lengths[0]]
            width = max(lengths) if right_padded else width
            grown = mask.array
        assert grown.dtype == np.int64 and np.array_equal(grown, rebuilt(lengths, width, right_padded)), step


def test_one_row_hands_out_a_contiguous_view():
    mask = DecodeMask(np.ones((1, 4), dtype=np.int64), right_padded=True)
    for _ in range(3):
        grown = mask.grow()
    assert grown.flags.c_contiguous and grown.shape == (1, 7) and grown.all()


def test_dropping_leading_padding_columns():
    mask = DecodeMask(rebuilt([2, 4], 4, right_padded=False), right_padded=False)
    mask.select_rows([1])
    mask.drop_leading(0)
    assert np.array_equal(mask.grow(), np.ones((1, 5), dtype=np.int64))
    mask = DecodeMask(rebuilt([2, 4], 4, right_padded=False), right_padded=False)
    mask.select_rows([0])
    mask.drop_leading(2)
    assert np.array_equal(mask.grow(), np.ones((1, 3), dtype=np.int64))
