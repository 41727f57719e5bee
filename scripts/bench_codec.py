#!/usr/bin/env python3
"""Codec throughput against a plain memory copy, in one run. Prints one JSON object.

GB/s are of fp32 input (4 bytes per element). Quantizing (and error feedback) is
compiled on CPU peers; the eager figures are the fallback used where torch.compile is
unavailable. Decoding runs torch's own kernels under either backend (inductor's int8 loads
are slower), so its "eager" and "compiled" figures measure the same code.

    python scripts/bench_codec.py [--numel 25000000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine, median_seconds

from swarmloco.core import codec
from swarmloco.core.codec import CodecConfig


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--block-size", type=int, default=1024)
    args = parser.parse_args()

    x = codec.padded_zeros(args.numel, args.block_size)
    x[: args.numel].normal_(generator=torch.Generator().manual_seed(0))
    gb = args.numel * 4 / 1e9
    dst = torch.empty_like(x)
    memcpy = median_seconds(lambda: dst.copy_(x), repeats=args.repeats)

    result: dict[str, object] = {
        "benchmark": "codec",
        "machine": machine(),
        "settings": {
            "numel": args.numel,
            "block_size": args.block_size,
            "repeats": args.repeats,
            "scale_dtype": "float32",
            "statistic": "median",
        },
        "numel": args.numel,
        "memcpy_gbps": gb / memcpy,
    }
    for backend in ("auto", "eager"):
        cfg = CodecConfig(block_size=args.block_size, backend=backend)
        start = time.perf_counter()
        q, s = codec.quantize(x, cfg)  # first call compiles
        first_call = time.perf_counter() - start
        quant = median_seconds(lambda cfg=cfg: codec.quantize(x, cfg), repeats=args.repeats)
        acc = torch.zeros_like(x)
        codec.dequantize_accumulate_(acc, q, s, 0.25, cfg)
        accum = median_seconds(
            lambda acc=acc, q=q, s=s, cfg=cfg: codec.dequantize_accumulate_(acc, q, s, 0.25, cfg),
            repeats=args.repeats,
        )
        prefix = "" if backend == "auto" else "eager_"
        result[f"{prefix}quantize_gbps"] = gb / quant
        result[f"{prefix}dequantize_accumulate_gbps"] = gb / accum
        if backend == "auto":
            result["compiled"] = codec.compile_failure() is None
            result["compile_failure"] = codec.compile_failure()
            result["first_call_s"] = first_call
            y = codec.dequantize(q, s, args.block_size)
            err = (x - y).abs().view(-1, args.block_size).amax(1)
            absmax = x.abs().view(-1, args.block_size).amax(1).clamp_min(1e-30)
            result["max_abs_error_over_absmax"] = float((err / absmax).max())
            result["bytes_per_element_on_wire"] = cfg.wire_bytes(args.numel) / args.numel
    result["quantize_over_memcpy"] = result["quantize_gbps"] / result["memcpy_gbps"]  # type: ignore[operator]
    result["dequantize_accumulate_over_memcpy"] = (
        result["dequantize_accumulate_gbps"] / result["memcpy_gbps"]  # type: ignore[operator]
    )
    result["target_ratio"] = 0.35
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
