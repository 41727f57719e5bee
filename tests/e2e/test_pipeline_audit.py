"""A stranger that serves a stage and poisons the gradients it returns, within every bound,
in a pipelined run through the CLI: three `swarmloco join --stage 1` peers, one of them a
modified client whose stage flips the gradient it sends back (what a stage-0 peer's
embedding would then climb), and one stage-0 peer that audits half of the answers
(`--audit-share 0.5`). The stage-0 peer finds the liar out by three answers, says so
(`replica-distrusted`, and its record for `swarmloco status`); the honest peers are never
struck (tests/net/test_pipeline.py shows that a distrusted replica is drawn no more)."""

from __future__ import annotations

import contextlib
import sys
import time

import pytest
from swarmutil import FAST_PEER, Bootstrap, PeerProcess, swarmloco

pytestmark = pytest.mark.timeout(420)

LIAR = """\
import sys

import torch

from swarmloco.cli import main
from swarmloco.pipeline import daemon


class Flip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


honest = daemon.task_stage


def lying(*args, **kwargs):
    module = honest(*args, **kwargs)
    module.register_forward_pre_hook(lambda _, inputs: (Flip.apply(inputs[0]), *inputs[1:]))
    return module


daemon.task_stage = lying
sys.exit(main())
"""


def test_a_stage_peer_that_returns_flipped_gradients_is_found_out_by_audits(tmp_path):
    liar_script = tmp_path / "liar.py"
    liar_script.write_text(LIAR)
    stage_1 = ("--stage", "1", "--rebalance-every", "0")
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--stages", "2")
        with contextlib.ExitStack() as stack:
            honest = [
                stack.enter_context(
                    PeerProcess.join(swarm, boot.endpoint, tmp_path / f"honest{i}", *stage_1)
                )
                for i in range(2)
            ]
            liar = stack.enter_context(
                PeerProcess(
                    ["join", swarm, "--peer", boot.endpoint, *FAST_PEER, *stage_1],
                    tmp_path / "liar",
                    command=[sys.executable, str(liar_script)],
                )
            )
            for p in (*honest, liar):
                p.wait_for("ready", timeout=120)
            audited = ("--stage", "0", "--rebalance-every", "0", "--audit-share", "0.5")
            driver = stack.enter_context(
                PeerProcess.join(swarm, boot.endpoint, tmp_path / "driver", *audited)
            )
            found = driver.wait_for("replica-distrusted", timeout=300)
            # A report of the driver's after the verdict (its audits by outcome).
            driver.wait_for("driven", lambda e: e["time"] > found["time"], timeout=120)
            # `swarmloco status` shows it from the driver's stage-load record (republished
            # every 2 s): asked again until it does, within two minutes.
            deadline = time.monotonic() + 120
            while True:
                shown = swarmloco("status", swarm, "--peer", boot.endpoint, timeout=120)
                if "its audits distrust 1 replica(s)" in shown.stdout:
                    break
                assert time.monotonic() < deadline, shown.stdout + shown.stderr
            for p in (driver, *honest, liar):
                assert p.stop() == 0, p.log_tail()
    assert found["endpoint"] == liar.endpoint, (found, liar.endpoint)
    assert found["at_stage"] == 1
    assert len(driver.of("replica-distrusted")) == 1, driver.of("replica-distrusted")
    said = "".join(driver.log)
    assert "answered a micro-batch wrong again" in said, driver.log_tail()
    audits = driver.of("driven")[-1]["audits"]
    print(f"found out at {found['distances']}; the driver's audits: {audits}")
    assert audits["found-out"] == 1 and audits["agreed"] >= 1, audits
    for p in (driver, *honest, liar):
        assert "Traceback" not in "".join(p.log), p.log_tail()
