"""The churn soak, short: `scripts/chaos.py` for 90 s, as CI runs it.

Five peer processes and a bootstrap node on loopback. Once every peer is up and a first
round is applied (the schedule waits for that, however loaded the machine), the bootstrap
node is killed for good at 20 s, a guest joins at 15 s and leaves at 45 s, and a peer is
SIGKILLed at 29.5 s (seed 3) and restarted, so it must rejoin through the peers it
remembers; the last 30 s have no faults. The swarm must end on one state, with no
traceback, no failed restart and no checkpoint that does not verify. The full report is
printed (pytest shows it with -s or on failure).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_with_kills_and_a_dead_bootstrap_ends_on_one_state(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--minutes", "1.5", "--quiet", "30", "--seed", "3", "--no-baseline"),
            *("--dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    chaos = report["chaos"]
    print(json.dumps(chaos, indent=1))
    actions = [f["action"] for f in chaos["faults"]]
    guest_log = tmp_path / "chaos" / "peer5.log"  # the guest: the peer after the five
    guest = guest_log.read_text()[-2000:] if guest_log.exists() else "(never started)"
    assert "kill-bootstrap" in actions and "join" in actions, actions
    assert "leave" in actions, (actions, guest)  # the guest came up and was stopped
    assert any(a.startswith("kill") and a != "kill-bootstrap" for a in actions), actions
    logs = "\n".join(p.read_text()[-3000:] for p in (tmp_path / "chaos").glob("peer*.log"))
    assert chaos["tracebacks"] == 0, logs
    assert chaos["restarts"]["failed"] == 0 and chaos["restarts"]["resumed"] >= 1, logs
    assert chaos["corrupted_checkpoints"] == 0
    assert chaos["rounds_committed"] >= 5
    assert chaos["final_digests_agree"], logs
    # Once the faults stop, one group per round: no round of the quiet end is applied with
    # two digests (issue 12's alternation).
    assert chaos["several_digests_in_quiet_end"] == 0, chaos
