"""``data.share_prefixes``: SFT rows that start alike train with that start once, to the same losses."""

from __future__ import annotations

import pytest

from slipstream.train.config import ConfigError, load_config
from slipstream.train.loop import train
from tests.bench.test_ab_shared_prefixes import chat_file
from tests.train.test_train import TINY, losses, write_config


def config(tmp_path, mode: str, name: str, response_only: bool = True, **speedups):
    out = tmp_path / name
    out.mkdir()
    data = {
        **TINY,
        # every row fits one bin either way: each step trains the very same rows, shared or not
        "data": {
            "path": str(chat_file(tmp_path / "chats.jsonl", rows=12, system_words=60, longest=10)),
            "response_only": response_only,
            "max_seq_len": 4096,
            "share_prefixes": mode,
        },
        "training": {"steps": 3, "checkpoint_every": 0},
        **({"speedups": speedups} if speedups else {}),
    }
    return load_config(write_config(out, data))


@pytest.mark.parametrize("response_only", [True, False])
def test_shared_start_trains_to_the_losses_of_the_rows_whole(tmp_path, response_only):
    _, shared = train(config(tmp_path, "on", "shared", response_only), progress=False)
    _, whole = train(config(tmp_path, "off", "whole", response_only), progress=False)
    found = shared["shared_prefixes"]
    assert found["rows_in_groups"] == 12 and found["saved_fraction"] > 0.4, found
    assert "shared prefixes on" in found["policy"]
    assert "shared prefixes off" in whole["shared_prefixes"]["policy"]
    # fp32: the same rows, the same loss and (steps 2 and 3 follow the gradients) the same updates;
    # without response_only the start is labelled, each of its tokens counted once per row
    assert losses(tmp_path / "shared" / "out") == pytest.approx(losses(tmp_path / "whole" / "out"), rel=1e-5)


def test_auto_shares_where_it_saves_tokens_and_says_why_not_elsewhere(tmp_path):
    _, summary = train(config(tmp_path, "auto", "auto"), progress=False)
    assert summary["shared_prefixes"]["policy"].startswith("shared prefixes on (auto: saves")
    _, summary = train(config(tmp_path, "auto", "no-chunked", chunked_loss=False), progress=False)
    assert "speedups.chunked_loss is off" in summary["shared_prefixes"]["policy"]


def test_on_without_what_it_needs_is_refused_by_key(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.yaml:\d+: data.share_prefixes on needs the chunked loss"):
        config(tmp_path, "on", "refused", chunked_loss=False)
