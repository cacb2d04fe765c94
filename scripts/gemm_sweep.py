#!/usr/bin/env python3
"""Measures a GPU's dense and grouped GEMMs for the cost model's test table.

Writes `cost-models/data/<name>.json` (format "parallax-gemm-measurements/1"): bf16 `a @ b`
(cuBLAS) and fp8 `torch._scaled_mm` (e4m3, unit per-tensor scales, bf16 output) over a grid
of training shapes, and `torch._grouped_mm` over G experts of m token rows each (the MoE
layer's expert GEMMs). Each time is the mean of 10-30 calls after 3 warm-ups, timed with
CUDA events. Needs PyTorch 2.8 or later with CUDA on a Hopper GPU (grouped and fp8 GEMMs).

    python3 scripts/gemm_sweep.py --out cost-models/data/h100-gemms.json --device dgx-h100-80gb
"""

import argparse
import datetime
import json
import subprocess

import torch


def timeit(fn, iters, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # microseconds


def driver():
    try:
        q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(q, capture_output=True, text=True).stdout.split()[0]
    except (OSError, IndexError):
        return "unknown"


def dense():
    rows = []
    one = torch.tensor(1.0, device="cuda")
    for m in [256, 512, 1024, 2048, 4096, 8192, 16384]:
        for k in [1024, 2048, 4096, 8192]:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a8 = a.to(torch.float8_e4m3fn)
            for n in [512, 1024, 2048, 4096, 8192, 16384]:
                b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                # _scaled_mm takes its second operand column-major.
                b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
                iters = 10 if m * n * k > 2**36 else 30
                bf16 = timeit(lambda: a @ b, iters)
                fp8 = timeit(
                    lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), iters
                )
                rows.append([m, k, n, round(bf16, 2), round(fp8, 2)])
    return rows


def grouped():
    rows = []
    # (hidden, expert width) of Qwen3-30B-A3B, DeepSeek-V3, GPT-OSS, Mixtral 8x22B, and one more.
    for k, n in [(2048, 768), (7168, 2048), (2880, 2880), (6144, 16384), (4096, 1536)]:
        for g in [8, 16, 32, 64, 128]:
            for m in [64, 128, 256, 512, 1024, 2048, 4096]:
                if g * m * (k + n) * 2 > 8e9 or g * k * n * 2 > 12e9:
                    continue  # over about 20 GB of operands
                x = torch.randn(g * m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16)
                offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * m
                t = timeit(lambda: torch._grouped_mm(x, w, offs=offs), 10)
                rows.append([g, m, k, n, round(t, 2)])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", required=True, help="the preset the measurements check")
    args = ap.parse_args()
    p = torch.cuda.get_device_properties(0)
    out = {
        "format": "parallax-gemm-measurements/1",
        "provenance": f"measured {datetime.date.today()} on one {p.name} "
        f"({p.multi_processor_count} SMs, driver {driver()}), PyTorch {torch.__version__}, CUDA "
        f"{torch.version.cuda}, by scripts/gemm_sweep.py: mean time of 10-30 calls after 3 "
        "warm-ups, CUDA events",
        "device": args.device,
        "dense_columns": ["M", "K", "N", "bf16_us", "fp8_us"],
        "dense": dense(),
        "grouped_columns": ["G", "m", "K", "N", "bf16_us"],
        "grouped": grouped(),
    }
    # One row a line, so that a new measurement reads as a diff.
    text = json.dumps(out, separators=(",", ":")).replace("],[", "],\n[")
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
