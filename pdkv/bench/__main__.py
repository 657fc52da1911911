"""`python -m pdkv.bench`: the benchmark without the typer CLI, for hosts that carry only pdkv's core deps.

Takes the same core options as `pdkv bench` and always prints the JSON report.
Exit codes follow pdkv.errors: 1 failed (including corrupted bytes), 2 usage, 3 could not start.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from pdkv.errors import PdkvError


def main(argv: list[str] | None = None) -> int:
    from pdkv.bench.layout import expand_layouts, parse_sweep
    from pdkv.bench.runner import BenchSpec, run_bench, settings_from_env
    from pdkv.geometry import dense_geometry, geometry_from_model

    p = argparse.ArgumentParser(prog="python -m pdkv.bench", description=__doc__)
    p.add_argument("--model")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=63)
    p.add_argument("--layout", action="append", default=[])
    p.add_argument("--sweep", action="append", default=[])
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--device", default="")
    p.add_argument("--src", default="cpu")
    p.add_argument("--dst", default="cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--link-gbps", type=float)
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--target")
    p.add_argument("--hostname", default="127.0.0.1")
    p.add_argument("--json", action="store_true", help="accepted for symmetry with `pdkv bench`; output is always JSON")
    a = p.parse_args(argv)
    try:
        if a.model:
            geometry = geometry_from_model(a.model, dtype=a.dtype)
        elif None in (a.layers, a.kv_heads, a.head_dim):
            p.error("give --model or all of --layers --kv-heads --head-dim")
        else:
            geometry = dense_geometry(a.layers, a.kv_heads, a.head_dim, a.dtype or "bfloat16")
        swept = parse_sweep(a.sweep)
        spec = BenchSpec(
            geometry=geometry,
            block_size=a.block_size,
            blocks=swept.get("blocks", [a.blocks]),
            layouts=swept.get("layout", expand_layouts(a.layout)),
            protocol=a.protocol,
            device=a.device,
            hostname=a.hostname,
            src=a.src,
            dst=a.dst,
            iters=a.iters,
            warmup=a.warmup,
            seed=a.seed,
            link_gbps=a.link_gbps,
            baseline=a.baseline,
            target=a.target,
            settings=settings_from_env(),
        )
        report = run_bench(spec)
    except PdkvError as exc:
        print(f"pdkv bench: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return int(exc.exit_code)
    sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
