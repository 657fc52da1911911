"""`pdkv model`: models pdkv ships for tests and local deployments."""

from __future__ import annotations

from pathlib import Path

import typer

from pdkv.cli.options import JsonOpt
from pdkv.cli.output import console, print_json

model_app = typer.Typer(help="Models pdkv ships.", no_args_is_help=True)

TINY_HELP = """Write the embedded tiny Qwen3-architecture model into DIR (real random bf16 weights).

Examples:

  pdkv model tiny ./tiny-model

  pdkv model tiny ./tiny-model --seed 7 --json
"""


@model_app.command("tiny", help=TINY_HELP)
def tiny(
    directory: Path = typer.Argument(..., help="Folder to write the model into."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and the tokenizer corpus."),
    std: float = typer.Option(0.02, "--std", help="Standard deviation of the random weights."),
    json_out: JsonOpt = False,
) -> None:
    from pdkv.geometry import geometry_from_model
    from pdkv.tinymodel import TinyModelSpec, write_tiny_model

    out = write_tiny_model(directory, TinyModelSpec(seed=seed, std=std))
    files = sorted(p.name for p in out.iterdir())
    geometry = geometry_from_model(out)
    if json_out:
        print_json({"path": str(out.resolve()), "files": files, "geometry": geometry})
        return
    console.print(f"wrote tiny model to [bold]{out}[/] ({', '.join(files)})")
    shape = f"{geometry.layers} layers, {geometry.kv_heads} KV heads x {geometry.head_dim}"
    console.print(f"KV per token: {geometry.bytes_per_token} B ({shape})")


RANDOM_HELP = """Write a Qwen3-architecture model of CONFIG's size into DIR: the config, a tokenizer naming every id
(t0, t1, ...) and seeded random bf16 weights, made on a GPU when one is present. For GPU hosts that cannot
download a model: the weights are random, the shapes, KV bytes and speed are the real model's.

Examples:

  pdkv model random /models/qwen3-8b-random --config tests/fixtures/configs/qwen3-8b/config.json

  pdkv model random ./m --config config.json --no-weights --json
"""


@model_app.command("random", help=RANDOM_HELP)
def random_model(
    directory: Path = typer.Argument(..., help="Folder to write the model into."),
    config: Path = typer.Option(..., "--config", help="A Qwen3 config.json (its sizes and initializer_range)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights."),
    weights: bool = typer.Option(True, "--weights/--no-weights", help="Write the weights (or only config and tokenizer)."),
    json_out: JsonOpt = False,
) -> None:
    import json

    from pdkv.errors import UsageError
    from pdkv.randmodel import write_random_model

    try:
        cfg = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {config}: {e}", hint="give a model's config.json") from None
    out = write_random_model(directory, cfg, seed=seed, weights=weights)
    files = sorted(p.name for p in out.iterdir())
    if json_out:
        print_json({"path": str(out.resolve()), "files": files})
        return
    console.print(f"wrote model to [bold]{out}[/] ({len(files)} files)")


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
