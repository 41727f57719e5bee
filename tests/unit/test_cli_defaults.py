"""The command line's defaults are the config dataclasses' (they must never drift)."""

import dataclasses

from swarmloco import cli
from swarmloco.cli.common import _MATCHMAKING_DEFAULTS
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.runtime.config import PeerConfig, default

# option dest -> (config class, field)
OPTIONS = {
    "round_timeout": (PeerConfig, "round_timeout_s"),
    "progress_interval": (PeerConfig, "progress_interval_s"),
    "checkpoint_every": (PeerConfig, "checkpoint_every"),
    "eval_every": (PeerConfig, "eval_every"),
    "gather": (MatchmakingConfig, "gather_s"),
    "min_group": (MatchmakingConfig, "min_group_size"),
}


def test_create_and_join_take_their_defaults_from_the_configs():
    parser = cli.build_parser()
    for command in (["create"], ["join", "ab" * 20, "--peer", "127.0.0.1:1"]):
        args = parser.parse_args(command)
        for dest, (config, field) in OPTIONS.items():
            assert getattr(args, dest) == default(config, field), (command[0], dest)


def test_the_torch_free_copy_of_the_matchmaking_defaults_is_exact():
    fields = {f.name: f.default for f in dataclasses.fields(MatchmakingConfig)}
    for field, value in _MATCHMAKING_DEFAULTS.items():
        assert fields[field] == value, field


def test_a_peer_config_needs_no_data_dir_when_create_or_join_gets_one(tmp_path):
    from pathlib import Path

    import pytest

    from swarmloco.runtime.api import peer_config

    def given(config, data_dir):
        return peer_config(
            config, data_dir=data_dir, peers=(), tokens_per_step=None, host=None, port=None
        )

    assert given(PeerConfig(), tmp_path).directory == tmp_path
    assert given(PeerConfig(data_dir=tmp_path), None).directory == tmp_path
    assert given(PeerConfig(data_dir=tmp_path), tmp_path).directory == tmp_path
    with pytest.raises(ValueError, match="two data directories"):
        given(PeerConfig(data_dir=tmp_path), Path("elsewhere"))
    with pytest.raises(ValueError, match="give data_dir"):
        given(PeerConfig(), None)
