"""How one peer runs: its own choices, none of which enters the manifest.

The command line takes its defaults from these fields (``cli/`` reads them), so a
default is written once. This module imports no torch (the configs of the layers that do
are built on first use), so the command line's ``--help`` and the bootstrap node stay
light.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from swarmloco.core.config import require, require_int, require_non_negative, require_positive
from swarmloco.net.node import NodeConfig

if TYPE_CHECKING:
    from swarmloco.core.codec import Backend
    from swarmloco.net.averaging import AveragingConfig, BandwidthConfig, MatchmakingConfig
    from swarmloco.net.state import DonorConfig
    from swarmloco.runtime.catchup import CatchUpConfig


def _matchmaking() -> MatchmakingConfig:
    from swarmloco.net.averaging import MatchmakingConfig

    return MatchmakingConfig()


def _averaging() -> AveragingConfig:
    from swarmloco.net.averaging import AveragingConfig

    return AveragingConfig()


def _donor() -> DonorConfig:
    from swarmloco.net.state import DonorConfig

    return DonorConfig()


def _catchup() -> CatchUpConfig:
    from swarmloco.runtime.catchup import CatchUpConfig

    return CatchUpConfig()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """How one peer runs (its own choices: nothing here enters the manifest)."""

    data_dir: Path | None = None
    """The peer's key, and per swarm its manifest copy and checkpoints (None here: given
    to ``create``/``join`` as ``data_dir=``, which fill it in)."""
    node: NodeConfig = dataclasses.field(default_factory=NodeConfig)
    """Where to serve and which peers to join through."""
    tokens_per_step: int = 1
    """Samples or tokens one optimizer step trains on: the averaging weight counts them."""
    max_rounds: int | None = None
    """Leave after the swarm's state reached this round (None: until stopped), once peers
    still working towards it were served (``linger_s``)."""
    ends_at_run_total: bool = True
    """Whether the run's total steps (its rounds times H) or tokens end this peer: False
    for a pipelined run's later stages, whose steps count the micro-batches of however
    many drivers reach them and whose rounds land their tokens at a pace of their own
    (stage 0 ends the run; they leave once their drivers are gone)."""
    round_timeout_s: float = 120.0
    """Matchmaking plus all-reduce of one round."""
    matchmaking: MatchmakingConfig = dataclasses.field(default_factory=_matchmaking)
    averaging: AveragingConfig = dataclasses.field(default_factory=_averaging)
    """Timeouts of the all-reduce (its codec and aggregator come from the run spec)."""
    catchup: CatchUpConfig = dataclasses.field(default_factory=_catchup)
    """Which states to download from whom, on what evidence, and how long it may take."""
    donor: DonorConfig = dataclasses.field(default_factory=_donor)
    """How this peer serves its state: slots, minimum read rate, byte budget per network."""
    checkpoint_every: int = 1
    """Rounds between checkpoints (0: only when the peer stops)."""
    keep_checkpoints: int = 3
    """Checkpoints kept on disk, newest first."""
    checkpoint_retry_s: float = 30.0
    """After a checkpoint write failed (a full disk), how long until the next try."""
    eval_every: int = 1
    """Evaluate the global model every this many rounds, when there is an evaluator (0:
    never)."""
    progress_interval_s: float = 2.0
    """How often the peer publishes its progress record."""
    linger_s: float = 60.0
    """When the peer applied its last round (the run's total steps or tokens, or its own
    ``max_rounds``), how long it may stay to serve that state to peers still working
    towards a round it applied (it leaves as soon as none is; 0: at once)."""
    name: str = ""
    """How the dashboard names this peer (default: the host name and the start of its id)."""
    membership: str = ""
    """A private swarm's membership certificate for this peer, as ``swarmloco admit``
    prints it (it is kept in the data directory, so a restart needs it no more). Empty:
    the one kept, if any. Public swarms need none."""
    bandwidth: BandwidthConfig | None = None
    """Cap this peer's upload and download (averaging and state transfer together)."""
    dashboard_port: int | None = None
    """Serve the swarm's dashboard on 127.0.0.1 at this port (0: a free one; None: not)."""
    codec_backend: Backend | None = None
    """Override the codec's backend (auto, compiled, eager); the wire format is the same."""
    hook: bool = True
    """Run the swarm's work after every ``optimizer.step()`` (a post hook). False: the
    training loop calls ``swarm.step()`` itself after each optimizer step."""
    handle_signals: bool = True
    """Inside ``with swarm`` (main thread only), the first SIGINT/SIGTERM asks the peer to
    stop at the next step (the round in flight lands, a checkpoint is written); a second
    one stops at once."""

    @property
    def directory(self) -> Path:
        """:attr:`data_dir`, which a running peer must have."""
        if self.data_dir is None:
            raise ValueError("give data_dir (where the peer keeps its key and checkpoints)")
        return self.data_dir

    def swarm_directory(self, swarm_id: str) -> Path:
        """Where this peer keeps what is its own in swarm ``swarm_id``: the manifest's copy,
        the checkpoints, the unnamed files of the states it serves and downloads."""
        return self.directory / "swarms" / swarm_id

    def __post_init__(self) -> None:
        require(
            self.data_dir is None or isinstance(self.data_dir, Path),
            "data_dir must be a pathlib.Path",
        )
        require_int("tokens_per_step", self.tokens_per_step, minimum=1)
        if self.max_rounds is not None:
            require_int("max_rounds", self.max_rounds, minimum=1)
        require_positive("round_timeout_s", self.round_timeout_s)
        require_int("checkpoint_every", self.checkpoint_every, minimum=0)
        require_int("keep_checkpoints", self.keep_checkpoints, minimum=1)
        require_int("eval_every", self.eval_every, minimum=0)
        require_positive("progress_interval_s", self.progress_interval_s)
        require_non_negative("linger_s", self.linger_s)
        require_positive("checkpoint_retry_s", self.checkpoint_retry_s)
        require(len(self.name) <= 64, f"a peer name has at most 64 characters, got {self.name!r}")
        require(
            self.dashboard_port is None or 0 <= self.dashboard_port < 65536,
            f"dashboard port must be in [0, 65535], got {self.dashboard_port!r}",
        )
        require(
            self.codec_backend in (None, "auto", "compiled", "eager"),
            f"codec backend must be auto, compiled or eager, got {self.codec_backend!r}",
        )


def default(config: type, field: str) -> object:
    """The default of a config dataclass field (for command-line defaults)."""
    for f in dataclasses.fields(config):
        if f.name == field:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(f"{config.__name__} has no field {field!r} with a default")
