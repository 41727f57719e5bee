"""The view as text for a terminal (``swarmloco status``). Pure; the view's strings are
already cleaned of control characters (view.py), so printing them is safe."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def human(value: float | None, unit: str = "") -> str:
    """1234567 -> ``1.23M``; None -> ``-``."""
    if value is None:
        return "-"
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}{unit}"
    return f"{value:.3g}{unit}"


def human_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for factor, suffix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if value >= factor:
            return f"{value / factor:.3g} {suffix}"
    return f"{value:.0f} B"


def duration(seconds: float | None) -> str:
    """``3725`` -> ``1h02m``; None -> ``-``."""
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = []
    for row in [headers, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


def _swarm_line(swarm: Mapping[str, Any]) -> str:
    if not swarm.get("known"):
        return f"swarm {swarm['id']} (manifest not read)"
    parts = [f"swarm {swarm['id']}"]
    if swarm.get("name"):
        parts.append(repr(swarm["name"]))
    task = swarm.get("task", "")
    if swarm.get("preset"):
        task += f"/{swarm['preset']}"
    parts.append(task)
    if swarm.get("params"):
        parts.append(f"{human(swarm['params'])} parameters")
    if swarm.get("created_at"):
        parts.append(f"created {swarm['created_at']}")
    return "  ".join(parts)


def _apart_count(view: Mapping[str, Any]) -> str:
    count = view.get("peers_uncounted") or 0
    return f", {count} not counted" if count else ""


def progress_line(progress: Any) -> str:
    """``round 18 of 40; a round every 23.1 s (averaging 0.66 s of it); ends in about
    8m14s``, from the view's ``progress`` (what is unknown is left out)."""
    if not isinstance(progress, dict) or progress.get("round") is None:
        return ""
    parts = [f"round {progress['round']}" + (f" of {progress['of']}" if progress.get("of") else "")]
    every, averaging = progress.get("round_every_s"), progress.get("averaging_s")
    if every is not None:
        parts.append(
            f"a round every {every:.1f} s"
            + (f" (averaging {averaging:.2f} s of it)" if averaging is not None else "")
        )
    if progress.get("eta_s") is not None and progress.get("of"):
        parts.append(
            "the run is over"
            if progress["eta_s"] <= 0
            else f"ends in about {duration(progress['eta_s'])}"
        )
    return "; ".join(parts)


def dataset_line(dataset: Any) -> str:
    """``dataset: epoch 0, 312 of 462 sequences landed (68%); of 11 shards 7 done, 3
    leased by 2 reader(s), 1 free``, from the view's ``dataset`` ("" without one)."""
    if not isinstance(dataset, dict):
        return ""
    total = dataset["sequences"]
    share = f" ({100 * dataset['landed'] / total:.0f}%)" if total else ""
    free = max(0, dataset["shards"] - dataset["done"] - dataset["leased"])
    return (
        f"dataset: epoch {dataset['epoch']}, {dataset['landed']:,} of {total:,} sequences "
        f"landed{share}; of {dataset['shards']} shards {dataset['done']} done, "
        f"{dataset['leased']} leased by {dataset['readers']} reader(s), {free} free"
    )


def render(view: Mapping[str, Any]) -> str:
    """The view as a few lines of summary, the per-peer table and the latest rounds."""
    lines = [_swarm_line(view["swarm"])]
    if view.get("error"):
        lines.append(f"error: {view['error']}")
    lines.append(_summary_line(view))
    where = progress_line(view.get("progress"))
    if where:
        lines.append(where)
    upcoming = view.get("next_round")
    if upcoming and upcoming["peers"]:
        lines.append(
            f"round {upcoming['round']}: {human(upcoming['tokens'])} tokens so far from "
            f"{upcoming['peers']} peer(s)"
        )
    if line := dataset_line(view.get("dataset")):
        lines.append(line)
    pipeline = view.get("pipeline")
    if pipeline:
        lines.append("")
        lines += stages_lines(pipeline)
    peers = view.get("peers", [])
    if peers:
        lines.append("")
        lines += _peer_table(peers)
        if view.get("peers_not_shown"):
            lines.append(f"... and {view['peers_not_shown']} more peers")
    apart = view.get("uncounted", [])
    if apart:
        lines.append("")
        lines.append("not counted (no trusted peer averaged with them; their claims):")
        lines += _uncounted_table(apart)
    rounds = view.get("rounds", [])[-8:]
    if rounds:
        lines.append("")
        lines += _rounds_table(rounds)
    for warning in view.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def stages_lines(pipeline: Mapping[str, Any]) -> list[str]:
    """A pipelined run's stages: a table of the pools, which limits the pipeline, moves."""
    rows = []
    for row in pipeline["stages"]:
        peers = str(row["peers"]) + (
            f" (+{row['moving_in']} moving in)" if row["moving_in"] else ""
        )
        limits = "limits the pipeline" if row["stage"] == pipeline["limiting"] else ""
        rate = human(row["throughput"]) if row["peers"] else "-"
        round_ = "-" if row.get("round") is None else str(row["round"])
        queue, free = str(row["queue"]), str(row["free"])
        refused, skipped = str(row.get("refused", 0)), str(row.get("skipped", 0))
        notes = [limits] if limits else []
        if row.get("distrusted"):
            notes.append(f"its audits distrust {row['distrusted']} replica(s)")
        if row.get("drivers"):
            notes.append(f"{row['drivers']} driver session(s)")
        if row.get("orphaned"):
            notes.append(f"{row['orphaned']} micro-batch(es) of drivers gone")
        rows.append([str(row["stage"]), peers, rate, queue, free, round_, refused, skipped,
                     "; ".join(notes)])  # fmt: skip
    header = ["STAGE", "PEERS", "SEQ/S", "QUEUE", "FREE", "ROUND", "REFUSED", "SKIPPED", ""]
    lines = table(header, rows)
    moves = pipeline.get("recent_moves") or []
    said = "; ".join(f"{m['peer']} {m['from']} -> {m['to']}" for m in moves)
    if pipeline["moves"] is None:
        lines.append(
            "moves between stages: not seen in one reading (`swarmloco dashboard` counts them)"
        )
    else:
        lines.append(
            f"moves between stages: {pipeline['moves']}" + (f" (last: {said})" if said else "")
        )
    return lines


def _summary_line(view: Mapping[str, Any]) -> str:
    """Peers online, the round, the swarm's rate, agreement on the round and the losses
    (a pipelined run's: its stages' peers and the pipeline's rate; each stage's round is
    in the table of stages)."""
    pipeline = view.get("pipeline")
    if pipeline:
        rate = pipeline.get("throughput")
        return (
            f"peers online {pipeline.get('peers', 0)} in {len(pipeline['stages'])} stages  "
            f"{'-' if rate is None else human(rate)} sequences/s through the pipeline  "
            "(each stage averages in rounds of its own)"
        )
    agreement = view.get("agreement")
    agree = (
        f"{agreement['holders']}/{agreement['published']} agree on round {agreement['round']}"
        if agreement and agreement["published"]
        else "no digests yet"
    )
    loss = f"  loss {_loss(view.get('loss'))}" if view.get("loss") is not None else ""
    eval_loss = (
        f"  eval loss {_loss(view.get('eval_loss'))}" if view.get("eval_loss") is not None else ""
    )
    round_now = view.get("round")
    return (
        f"peers online {view['peers_online']} (of {view['peers_known']} known"
        f"{_apart_count(view)})  "
        f"round {'-' if round_now is None else round_now}  "
        f"{human(view.get('tokens_per_s'))} tokens/s  {agree}{loss}{eval_loss}"
    )


_PEER_COLUMNS = [
    "NAME",
    "ID",
    "STATE",
    "ROUND",
    "TOK/S",
    "SHARE",
    "LOSS",
    "EVAL",
    "DEVICE",
    "MFU",
    "UPTIME",
    "VERSION",
    "LAST ERROR",
]


def _peer_table(peers: list[Mapping[str, Any]]) -> list[str]:
    """The counted peers, one row each."""
    return table(_PEER_COLUMNS, [_peer_row(p) for p in peers])


def _peer_row(p: Mapping[str, Any]) -> list[str]:
    return [
        p["name"] or "-",
        p["short_id"],
        p["state"] if p["online"] or p["state"] == "left" else f"offline ({duration(p['age_s'])})",
        str(p["round"]),
        human(p["tokens_per_s"]),
        f"{100 * p['share']:.1f}%",
        _loss(p["loss"]),
        _loss(p["eval_loss"]),
        " ".join(filter(None, [p["device"] or "-", f"({p['fit']})" if p["fit"] else ""])),
        f"{100 * p['mfu']:.1f}%" if p["mfu"] is not None else "-",
        duration(p["uptime_s"]),
        p["version"] or "-",
        p["last_error"][:60] or "-",
    ]


def _uncounted_table(apart: list[Mapping[str, Any]]) -> list[str]:
    """Keys no trusted peer averaged with, and what they claim."""
    return table(
        ["NAME", "ID", "STATE", "ROUND", "TOK/S", "AGE"],
        [
            [
                p["name"] or "-",
                p["short_id"],
                p["state"],
                str(p["round"]),
                human(p["tokens_per_s"]),
                duration(p["age_s"]),
            ]
            for p in apart
        ],
    )


def _rounds_table(rounds: list[Mapping[str, Any]]) -> list[str]:
    """The given rounds' group, time, traffic, compression and failures."""
    return table(
        ["ROUND", "GROUP", "SECONDS", "SENT/PEER", "PAYLOAD", "RATIO", "FAILURES"],
        [
            [
                str(r["round"]),
                str(r["group"]),
                "-" if r["seconds"] is None else f"{r['seconds']:.2f}",
                human_bytes(r["bytes_sent"]),
                human_bytes(r["payload_bytes"]),
                "-" if r["compression"] is None else f"{r['compression']:.2f}x",
                str(r["failures"]),
            ]
            for r in rounds
        ],
    )
