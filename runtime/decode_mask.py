"""The attention mask of a running contiguous batch, one column longer after every decode step without being rebuilt.

A decode step's Python runs right after a model call has flushed the caches, so every array it allocates costs
several times its warm price: building each step's mask anew (a scan for its last column, a column of ones, a
concatenation) was ~13% of a SmolLM2 int4 step's Python. Here the mask lives in a buffer with room to spare; a
step writes one 1 per row and hands out a view.
"""

from __future__ import annotations

import numpy as np

# Columns allocated past the current width, and added whenever the buffer fills up (then at least doubled).
ROOM = 256


class DecodeMask:
    """attention_mask [rows, width] int64 of a contiguous batch. Left-padded rows end in the last column, so a
    step adds a column of ones. Right-padded rows (ModelIO.right_padded) are 1 on exactly their first n_b columns;
    a step sets each row's next column, and the width is the longest row's length (a longest row that left takes
    its trailing columns with it)."""

    def __init__(self, mask: np.ndarray, right_padded: bool):
        rows, width = mask.shape
        self._buffer = np.zeros((rows, width + ROOM), dtype=np.int64)
        self._buffer[:, :width] = mask
        self._width = width
        self._lengths = mask.sum(axis=1).tolist() if right_padded else None  # right-padded rows' lengths

    @property
    def array(self) -> np.ndarray:
        """The mask now: a view of the buffer, valid until the next grow()."""
        return self._buffer[:, :self._width]

    def grow(self) -> np.ndarray:
        """Every row one token longer; the mask after it."""
        if self._lengths is None:
            self._make_room(self._width + 1)
            self._buffer[:, self._width] = 1
            self._width += 1
        elif len(self._lengths) == 1:
            length = self._lengths[0]
            self._make_room(length + 1)
            self._buffer[0, length] = 1
            self._lengths[0] = self._width = length + 1
        else:
            self._make_room(max(self._lengths) + 1)
            self._buffer[np.arange(len(self._lengths)), self._lengths] = 1
            self._lengths = [length + 1 for length in self._lengths]
            self._width = max(self._lengths)
        return self.array

    def select_rows(self, keep: list[int]) -> None:
        """Keep only these rows, in this order."""
        self._buffer = self._buffer[keep]
        if self._lengths is not None:
            self._lengths = [self._lengths[row] for row in keep]
            self._width = max(self._lengths)

    def drop_leading(self, columns: int) -> None:
        """Drop the first `columns` columns (padding in every row of a left-padded batch)."""
        self._buffer = self._buffer[:, columns:]
        self._width -= columns

    def _make_room(self, width: int) -> None:
        if width > self._buffer.shape[1]:
            grown = np.zeros((len(self._buffer), max(2 * self._buffer.shape[1], width + ROOM)), dtype=np.int64)
            grown[:, :self._width] = self.array
            self._buffer = grown
