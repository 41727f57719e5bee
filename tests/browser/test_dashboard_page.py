"""The dashboard page in a real headless Chromium: its script runs under the page's
Content-Security-Policy, reads /api/v1/state and fills in the swarm that real DHT nodes on
loopback publish."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "net"))
from test_dashboard_app import PIPELINED, dashboard, pipelined_swarm, swarm_of_three

from swarmloco.net.identity import Identity

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.timeout(120),
    # scripts/test installs Debian's chromium where it can (root with apt); elsewhere this
    # is the one test that needs a browser on the machine.
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine"),
]
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--enable-logging=stderr",
    "--v=0",
)


async def rendered(url: str, tmp: Path) -> tuple[str, str]:
    """The page's DOM after its scripts ran (10 s of virtual time), and Chromium's log."""
    process = await asyncio.create_subprocess_exec(
        str(CHROMIUM),
        *FLAGS,
        f"--user-data-dir={tmp}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        url,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=90)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return out.decode(), err.decode(errors="replace")


async def test_the_page_renders_the_swarm_in_a_real_browser(tmp_path):
    stranger = Identity.generate()
    async with (
        swarm_of_three(stranger=stranger) as nodes,
        dashboard(nodes[0].endpoint, interval_s=0.5, trust=(nodes[0].identity.peer_id_hex,)) as (
            collector,
            url,
            _http,
        ),
    ):
        await collector.poll()
        dom, log = await rendered(url, tmp_path)
    # The script ran (a CSP refusal would leave the placeholders) and drew the view.
    assert 'id="status"' in dom and "connecting..." not in dom, log[-2000:]
    assert "Content Security Policy" not in log, log[-2000:]
    cards = re.search(r'id="c-peers">([^<]*)<', dom)
    assert cards is not None and cards.group(1) == "3", dom[:2000]
    assert re.search(r'id="c-round">4 of 40<', dom), dom[:2000]
    # The averaging time is labelled as such, apart from the time between rounds.
    assert "averaging time of each round" in dom and "last round's averaging" in dom
    rows = re.search(r'<tbody id="peers">(.*?)</tbody>', dom, re.S)
    assert rows is not None
    for name in ("peer-0", "peer-1", "peer-2"):
        assert name in rows.group(1)
    # The stranger's claims are listed apart, not counted.
    assert "fast-gpu" not in rows.group(1)
    apart = re.search(r'<tbody id="apart">(.*?)</tbody>', dom, re.S)
    assert apart is not None and "fast-gpu" in apart.group(1), dom[-3000:]
    assert stranger.peer_id_hex[:12] in apart.group(1)
    assert "loopback run" in dom
    # The charts are inline SVG drawn by the page's own script.
    chart = re.search(r'<svg id="loss-chart"[^>]*>(.*?)</svg>', dom, re.S)
    assert chart is not None
    assert "<path" in chart.group(1) or "<polyline" in chart.group(1), chart.group(1)[:500]


async def test_the_page_shows_a_pipelined_runs_stages_as_a_row_of_pools(tmp_path):
    async with (
        pipelined_swarm() as nodes,
        dashboard(nodes[0].endpoint, manifest=PIPELINED) as (collector, url, _http),
    ):
        for _ in range(2):  # (a move is seen between two readings)
            await collector.poll()
        dom, log = await rendered(url, tmp_path)
    assert 'id="stages-panel" hidden' not in dom, log[-2000:]
    first = re.search(r'<div class="pool" id="stage-0">(.*?)</div></div>', dom, re.S)
    slow = re.search(r'<div class="pool limiting" id="stage-1">(.*?)</div></div>', dom, re.S)
    assert first is not None and slow is not None, dom[:4000]
    assert "2 peers" in first.group(1) and "210 seq/s" in first.group(1), first.group(1)
    assert "1 peer<" in slow.group(1) and "30 seq/s" in slow.group(1), slow.group(1)
    assert "round 4" in first.group(1) and "round 5" in slow.group(1)
    assert "limits the pipeline" in slow.group(1)
    assert "2 call(s) refused" in slow.group(1) and "1 step(s) skipped" in slow.group(1)
    assert "refused" not in first.group(1) and "skipped" not in first.group(1)
    assert "its audits distrust 1 replica(s)" in first.group(1)
    assert "distrust" not in slow.group(1)
    assert "2 driver session(s)" in slow.group(1)
    assert "3 micro-batch(es) of drivers gone" in slow.group(1)
    assert "driver" not in first.group(1)
    assert "0 move(s) between stages seen" in dom
    # The run's peers are its stages' (the run's own swarm has none of its own).
    peers = re.search(r'id="c-peers">([^<]*)<.*?id="c-peers-sub">([^<]*)<', dom, re.S)
    assert peers is not None and peers.groups() == ("3", "in 2 stages (below)"), peers
