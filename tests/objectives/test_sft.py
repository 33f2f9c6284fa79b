"""SFT's own checks on its rows (the model-side ones are ``train.preflight``'s)."""

from __future__ import annotations

import pytest

from slipstream.errors import TrainError
from slipstream.objectives.sft import check_labels_left
from slipstream.train.config import TrainConfig


def test_samples_left_without_labels_are_refused_unless_bad_rows_are_skipped():
    config = TrainConfig()
    check_labels_left(0, config)
    with pytest.raises(TrainError, match="data.max_seq_len 1024: 3 sample"):
        check_labels_left(3, config)
    config.data.skip_bad_rows = True
    check_labels_left(3, config)
