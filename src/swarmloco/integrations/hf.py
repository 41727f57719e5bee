"""Hugging Face ``transformers``: train a ``Trainer`` as a peer of a swarm.

``pip install swarmloco[hf]``, then add one callback::

    from swarmloco.integrations.hf import SwarmCallback

    callback = SwarmCallback(spec=swarmloco.RunSpec(sync_every=100), data_dir="peer0")
    # or SwarmCallback(swarm_id=SWARM_ID, peers=["HOST:PORT"], data_dir="peer1")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()          # the swarm is entered when training begins, left when it ends

The Trainer keeps its own optimizer, scheduler, gradient accumulation and clipping. The
callback runs the swarm's work after every optimizer step (``on_step_end``), makes the
Trainer's learning-rate schedule follow the swarm's global step instead of the Trainer's
own (so give ``max_steps`` the run's length: it is the schedule's horizon), stops
training when the swarm stops (the run's end, ``max_rounds``, Ctrl-C) and not before
(a peer's own steps may outrun ``max_steps`` while it waits for others; training still
ends when the data's epochs run out), and records the model's config in the manifest so
that ``swarmloco export`` writes a directory ``from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

import swarmloco
from swarmloco.core.runspec import RunSpec
from swarmloco.errors import Stopped
from swarmloco.runtime.api import peer_config
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.swarm import EventSink, Swarm

logger = logging.getLogger(__name__)


class SwarmCallback(TrainerCallback):  # type: ignore[misc]
    """Make a ``transformers.Trainer`` a peer of a swarm (see the module docstring).

    Give ``spec`` to create a swarm (its id is ``callback.swarm.swarm_id`` once training
    began, and in the ``ready`` event) or ``swarm_id`` to join one. ``tokens_per_step``:
    what one optimizer step trains on (default: the samples of a step, all processes and
    accumulation included). ``wait_for_peers``: before the first step, wait until this
    many peers (this one included) are online, so that a creator does not train its first
    rounds alone (:meth:`Swarm.wait_for_peers`; ``wait_timeout_s`` bounds it). After
    ``train()`` returns, ``callback.swarm`` is the swarm it trained with (left, so its
    ``summary`` and ids stay readable). The other arguments are those of
    :func:`swarmloco.create`.
    """

    def __init__(
        self,
        *,
        spec: RunSpec | None = None,
        swarm_id: str | None = None,
        data_dir: str | Path | None = None,
        peers: Sequence[str] = (),
        tokens_per_step: int | None = None,
        host: str | None = None,
        port: int | None = None,
        config: PeerConfig | None = None,
        on_event: EventSink | None = None,
        identity_work: int | None = None,
        wait_for_peers: int = 0,
        wait_timeout_s: float = 600.0,
    ) -> None:
        if (spec is None) == (swarm_id is None):
            raise ValueError("give spec (to create a swarm) or swarm_id (to join one)")
        if config is None and data_dir is None:
            raise ValueError("give data_dir (where the peer keeps its key and checkpoints)")
        self.spec = spec
        self.swarm_id = swarm_id
        self.options: dict[str, Any] = {
            "data_dir": data_dir,
            "peers": tuple(peers),
            "tokens_per_step": tokens_per_step,
            "host": host,
            "port": port,
        }
        self.config = config
        self.on_event = on_event
        self.identity_work = identity_work
        self.wait_for_peers = wait_for_peers
        self.wait_timeout_s = wait_timeout_s
        self.swarm: Swarm | None = None
        self._active = False  # between on_train_begin and on_train_end

    def on_train_begin(
        self, args: Any, state: Any, control: Any, *, model: Any = None, **kwargs: Any
    ) -> None:
        optimizer = kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise RuntimeError("SwarmCallback needs the Trainer's model and optimizer")
        options = dict(self.options)
        if options["tokens_per_step"] is None:
            options["tokens_per_step"] = (
                args.per_device_train_batch_size
                * args.gradient_accumulation_steps
                * args.world_size
            )
        config = peer_config(self.config, **options)
        # The callback calls swarm.step() itself: after the Trainer's whole optimizer step
        # (accumulation, clipping, scheduler), where it can stop training cleanly.
        config = dataclasses.replace(config, hook=False)
        if self.spec is not None:
            # Through JSON: the manifest takes string keys only (id2label's are ints).
            info = (
                {"config": json.loads(model.config.to_json_string())}
                if hasattr(model, "config")
                else None
            )
            swarm = swarmloco.create(
                self.spec,
                model,
                optimizer,
                model_info=info,
                config=config,
                on_event=self.on_event,
                identity_work=self.identity_work,
            )
            logger.info("created swarm %s", swarm.swarm_id)
        else:
            assert self.swarm_id is not None
            swarm = swarmloco.join(
                self.swarm_id, model, optimizer, config=config, on_event=self.on_event
            )
        assert isinstance(swarm, Swarm)  # one process: no box
        scheduler = kwargs.get("lr_scheduler")
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if scheduler is not None and lambdas is not None:
            # The Trainer's LambdaLR counts its own steps: let it read the swarm's instead.
            scheduler.lr_lambdas = [swarm.lr_lambda(f) for f in lambdas]
            swarm.register("lr_scheduler", scheduler)
        swarm.__enter__()
        self.swarm, self._active = swarm, True
        if self.wait_for_peers > 1:
            try:
                swarm.wait_for_peers(self.wait_for_peers, timeout_s=self.wait_timeout_s)
            except Stopped:  # Ctrl-C while waiting: no step runs
                control.should_training_stop = True
            except BaseException:
                self._active = False
                swarm.__exit__(*sys.exc_info())
                raise

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        swarm = self.swarm
        if swarm is None or not self._active:
            return
        try:
            swarm.step()
        except Stopped:
            control.should_training_stop = True
            return
        # The swarm decides when training ends (the run's length is in global steps; this
        # peer's own step count, which the Trainer's max_steps bounds, may run ahead).
        control.should_training_stop = swarm.stopping

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        if self.swarm is not None and self._active and logs and "loss" in logs:
            self.swarm.log(loss=float(logs["loss"]))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.swarm is not None and self._active:
            self._active = False
            self.swarm.__exit__(None, None, None)
