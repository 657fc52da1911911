"""`pdkv profile`: measure running engines' prefill and decode curves into a profile file for `pdkv plan --slo`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdkv.cli.options import JsonOpt, ModelOpt
from pdkv.cli.output import console, err_console, print_json

HELP = """Measure a prefill and a decode engine: prefill time against prompt length and concurrency, inter-token
latency against batch size and KV in use. Writes a versioned profile (JSON, with the model and the hardware
in it) that `pdkv plan --slo` and `pdkv simulate` read.

P gets bursts of distinct random prompts, one output token each; its /metrics, read around each burst, give its own time.
D gets batches of streamed completions side by side, its /metrics polled for KV usage.
Point it at idle engines: other traffic skews the curves.
One engine may play both roles (P and D URLs equal).

Examples:

  pdkv profile --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 -o qwen3-8b.profile.json

  pdkv profile --prefill http://10.0.0.2:8100 --decode http://10.0.0.3:8200 --hardware "1 x H200, TP 1" --model ./Qwen3-8B

  pdkv profile --prefill http://127.0.0.1:8000 --prompt-tokens 64,256 --concurrency 1,4 --batches 1,8 --json
"""

def _ints(text: str, flag: str) -> tuple[int, ...]:
    from pdkv.errors import UsageError

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None
    return values


def render_profile(profile, out=None) -> None:
    """The profile's measurements and fitted curves as tables."""
    from pdkv.planner import median

    out = out or console
    m, h = profile.model, profile.hardware
    out.print(f"[bold]pdkv profile[/]: {m.name} on {h.description}  (vLLM {h.vllm_version or '?'}, "
              f"KV capacity {m.kv_capacity_tokens or '?'} tokens, block {m.block_size or '?'})")  # fmt: skip
    pre = Table(title="Prefill (P): bursts of one-token requests", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("prompt tokens", "concurrency", "latency p50 ms", "makespan ms", "fit ms"):
        pre.add_column(col, justify="right")
    f = profile.prefill_fit
    for b in profile.prefill:
        fit = f.step_ms(b.prompt_tokens * b.concurrency, b.prompt_tokens**2 * b.concurrency, b.concurrency) + f.outside_ms
        pre.add_row(str(b.prompt_tokens), str(b.concurrency), f"{median(b.latencies_ms):,.1f}", f"{b.makespan_ms:,.1f}", f"{fit:,.1f}")
    out.print(pre)
    out.print(f"  fit: step = {f.overhead_ms:.3f} ms + {f.ms_per_request:.3f} ms x requests + {f.ms_per_token:.5f} ms x tokens"
              f" + {f.ms_per_token_sq:.3g} ms x tokens^2 on P's engine, + {f.outside_ms:.2f} ms a request outside it"
              f"  (RMS error {f.rms_error_ms:.2f} ms over {f.points} bursts)")  # fmt: skip
    dec = Table(title="Decode (D): streams side by side", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("batch", "ran at", "context tokens", "ITL ms (D)", "client p50 ms", "KV usage", "running", "fit ms"):
        dec.add_column(col, justify="right")
    d = profile.decode_fit
    for r in profile.decode:
        usage = "?" if r.kv_usage is None else f"{r.kv_usage:.1%}"
        client = f"{median(r.itl_ms):,.2f}" if r.itl_ms else "-"
        engine = "-" if r.decode_ms is None else f"{r.decode_ms:,.2f}"
        ran = "-" if r.mean_batch is None else f"{r.mean_batch:,.1f}"
        fit = f"{d.itl_ms(r.ran_batch, r.kv_tokens):,.2f}"
        dec.add_row(str(r.batch), ran, str(r.context_tokens), engine, client, usage, str(r.running), fit)
    out.print(dec)
    out.print(f"  fit: ITL = {d.base_ms:.3f} ms + {d.ms_per_seq:.4f} ms x batch + {d.ms_per_kv_token:.3g} ms x KV tokens"
              f"  (RMS error {d.rms_error_ms:.2f} ms over {d.points} runs)")  # fmt: skip


def profile(
    prefill: Annotated[str, typer.Option("--prefill", "-p", help="URL of the prefill engine (vLLM's OpenAI server).")],
    decode: Annotated[str | None, typer.Option("--decode", "-d", help="URL of the decode engine (default: --prefill's).")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the profile here.")] = None,
    prompt_tokens: Annotated[str, typer.Option("--prompt-tokens", help="Prompt lengths for P, comma-separated.")] = "128,512,1024,2048",
    concurrency: Annotated[str, typer.Option("--concurrency", help="Burst sizes for P, comma-separated.")] = "1,2,4,8",
    batches: Annotated[str, typer.Option("--batches", help="Batch sizes for D, comma-separated.")] = "1,4,16,32",
    context_tokens: Annotated[str, typer.Option("--context-tokens", help="D's prompt lengths, comma-separated.")] = "128,1024",
    output_tokens: Annotated[int, typer.Option("--output-tokens", help="Tokens each D stream generates.")] = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="Bursts per prompt length and concurrency.")] = 2,
    hardware: Annotated[str | None, typer.Option("--hardware", help="Where the engines run, in words (default: detected here).")] = None,
    model: ModelOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random prompts.")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds one request may take.")] = 300.0,
    json_out: JsonOpt = False,
) -> None:
    from pdkv.planner import ProfileSettings, run_profile, save_profile, unbatched_runs

    kv_bytes = None
    if model is not None:
        from pdkv.geometry import geometry_from_model

        kv_bytes = geometry_from_model(model).bytes_per_token
    settings = ProfileSettings(
        prompt_tokens=_ints(prompt_tokens, "--prompt-tokens"), concurrency=_ints(concurrency, "--concurrency"),
        batches=_ints(batches, "--batches"), context_tokens=_ints(context_tokens, "--context-tokens"),
        output_tokens=output_tokens, repeats=repeats, timeout_s=timeout, seed=seed, hardware=hardware, kv_bytes_per_token=kv_bytes,
    )  # fmt: skip
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=not err_console.is_terminal) as bar:  # fmt: skip
        task = bar.add_task("profiling", total=settings.steps())

        def on_progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        result = run_profile(prefill, decode, settings, on_progress)
    if output is not None:
        save_profile(result, output)
    for r in unbatched_runs(result.decode):
        err_console.print(f"[yellow]warning[/]: D ran the {r.batch} streams over {r.context_tokens}-token prompts at a mean batch of "
                          f"{r.mean_batch:.1f}: they hardly overlapped (the engine or its API server is short of CPU; on a CPU "
                          "host bind the engine with `pdkv up --omp-bind` to cores its API server does not need). The fit uses "
                          "the batch D ran at.")  # fmt: skip
    if json_out:
        print_json(result)
        return
    render_profile(result)
    if output is not None:
        console.print(f"profile written to {output}")


def register(app: typer.Typer) -> None:
    app.command("profile", help=HELP)(profile)
