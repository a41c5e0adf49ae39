"""The `specgen` command line: Typer commands that build the config, run the job, map errors to exit codes."""
from __future__ import annotations

import dataclasses
import json
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from specgen.cli_options import with_settings
from specgen.errors import (
    EXIT_RECORD_ERRORS,
    EXIT_SIGINT,
    ConfigError,
    OutputError,
    SpecgenError,
    Stopped,
    WorkerError,
)

PRECEDENCE = ("Settings resolve once, later winning: dataclass defaults < --config YAML "
              "< --speculative-config < individual flags.")

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Offline batch generation with lossless speculative decoding.")

# Options of `run` and `bench` besides the settings (cli_options.with_settings adds one per config field).
Model = Annotated[str | None, typer.Option(
    help="HF checkpoint directory or .gguf file [default: built-in SmolLM2-135M-Instruct]")]
SpecJson = Annotated[str | None, typer.Option(
    help='FastDeploy-style JSON, inline or a file: '
         '{"method": "mtp", "num_speculative_tokens": 1, "model": "path"}.')]
Threads = Annotated[int | None, typer.Option(help="CPU threads; 0 uses every core available.")]
ConfigFile = Annotated[Path | None, typer.Option(
    "--config", help="YAML file with sampling / engine / speculative sections.")]
InputFormat = Annotated[str | None, typer.Option(help="jsonl | parquet [default: from the extension].")]
SummaryJson = Annotated[Path | None, typer.Option(help="Also write the summary to this JSON file.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]


@contextmanager
def exit_codes(interrupted: str = "interrupted", resume: str | None = None) -> Iterator[None]:
    """The one place where errors become exit codes: SpecgenError.exit_code (README: "Exit codes"), 130 for a
    Ctrl-C outside a run. `resume`: the command that continues the job, told after a stop or a write error."""
    try:
        yield
    except Stopped as exc:
        typer.echo(f"{exc}; resume with: {resume}" if resume else str(exc), err=True)
        raise typer.Exit(exc.exit_code) from None
    except OutputError as exc:
        typer.echo(f"error: {exc}"
                   + (f"; free space or fix the folder, then resume with: {resume}" if resume else ""),
                   err=True)
        raise typer.Exit(exc.exit_code) from None
    except WorkerError as exc:
        typer.echo(f"error: {exc}" + (f"; resume with: {resume}" if resume else ""), err=True)
        raise typer.Exit(exc.exit_code) from None
    except SpecgenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        typer.echo(interrupted, err=True)
        raise typer.Exit(EXIT_SIGINT) from None


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM while the model loads stops like Ctrl-C does: a line and exit 143, not a silent death (the job
    installs its own handlers while it runs)."""
    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum, "while loading the model; the output is as it was")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def resume_command() -> str:
    """This command line with --resume: what continues the job (as words where specgen runs as a library)."""
    args = sys.argv[1:]
    if args[:1] != ["run"]:
        return "the same command with --resume"
    return shlex.join(["specgen", *args, *([] if "--resume" in args else ["--resume"])])


def resolve_config(config: Path | None, speculative_config: str | None, flags: dict[str, Any], methods=None):
    """Flags (setting -> value or None) over --speculative-config over the YAML file over defaults."""
    from specgen.app.settings import load_yaml, parse_speculative_config, resolve

    sections = load_yaml(config) if config is not None else None
    spec_json = parse_speculative_config(speculative_config) if speculative_config is not None else None
    return resolve(sections, flags, spec_json, methods)


def _load(model: str | None, cfg) -> Any:
    from specgen.api import load_model

    return load_model(model, cfg.engine)


def _print_summary(summary, title: str) -> None:
    from rich.console import Console

    from specgen.io.report import summary_table

    Console().print(summary_table(summary, title))


def _write_json(path: Path | None, data: Any) -> None:
    if path is not None:
        try:
            path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot write the summary ({exc})") from None


@app.command(help="Generate a completion for every record of INPUT into OUTPUT (.jsonl or .parquet). "
                  + PRECEDENCE)
@with_settings()
def run(
    input: Annotated[Path, typer.Argument(help="Prompts: .jsonl / .json lines, or .parquet.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Results: .jsonl or .parquet.")],
    flags: dict[str, Any],
    model: Model = None, speculative_config: SpecJson = None, config: ConfigFile = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an existing output, skipping the ids it holds; refused when the settings "
                         "that decide its records (stored with it) differ.")] = False,
    allow_mismatch: Annotated[bool, typer.Option(
        "--allow-mismatch", help="With --resume: continue even though the settings differ.")] = False,
    on_error: Annotated[str, typer.Option(
        help="Bad records: skip (write an error record) | fail (exit 2).")] = "skip",
    quiet: Quiet = False, summary_json: SummaryJson = None, input_format: InputFormat = None,
    output_format: Annotated[str, typer.Option(
        help="auto: OpenAI Batch input lines get OpenAI Batch output lines, native records native ones | "
             "openai: every record as an OpenAI Batch output line (.jsonl) | native.")] = "auto",
) -> None:
    from specgen.app.job import check_manifest, run_job, run_manifest
    from specgen.io.job_output import plan_job
    from specgen.io.report import run_progress

    with exit_codes(f"interrupted: finished records are in {output}; rerun with --resume to complete it",
                    resume=resume_command()):
        cfg = resolve_config(config, speculative_config, flags)
        plan = plan_job(input, output, input_format, resume, on_error, allow_mismatch, output_format)
        with plan.lock:
            with sigterm_stops():
                loaded = _load(model, cfg)
                manifest = {**run_manifest(loaded, cfg), "output_format": plan.output_style}
                for line in check_manifest(plan, manifest):
                    typer.echo(f"warning: --allow-mismatch: {line}", err=True)
            with run_progress(quiet) as progress:
                result = run_job(plan, loaded, cfg, progress)
        if not quiet:
            if result.num_resumed:
                typer.echo(f"resumed: {result.num_resumed} records were already in {output}")
            _print_summary(result.summary, "run summary")
        _write_json(summary_json, {**result.summary.to_dict(), "num_resumed": result.num_resumed})
        if result.summary.num_errors:
            typer.echo(f"{result.summary.num_errors} records are error records "
                       "(their `error` field says why)",
                       err=True)
            raise typer.Exit(EXIT_RECORD_ERRORS)


@app.command(help="Print the summary of an output file (.jsonl or .parquet), finished or not.")
def stats(
    output: Annotated[Path, typer.Argument(help="An output of `specgen run`.")],
    summary_json: SummaryJson = None,
) -> None:
    from specgen.io.manifest import describe, read_manifest
    from specgen.io.outputs import iter_output_records, output_format
    from specgen.io.summary import summarize

    with exit_codes():
        output_format(output)
        summary = summarize(iter_output_records(output))
        manifest = read_manifest(output)
        typer.echo("settings (the run manifest):" if manifest
                   else "settings: no manifest (an older specgen's output)")
        for line in describe(manifest or {}):
            typer.echo(f"  {line}")
        _print_summary(summary, f"{output.name}")
        _write_json(summary_json, {**summary.to_dict(), "manifest": manifest})


@app.command(help="Run INPUT once per method (and batch size) on one loaded model and compare them side by "
                  "side: tok/s, speedup, what speculation could reach (the n-gram ceiling, the oracle "
                  "bound), and advice: the fastest choice, with its YAML for --config. " + PRECEDENCE)
@with_settings(exclude=("method", "data_parallel_size", "ray", "tensor_parallel_size", "pd",
                        "expert_parallel_size"))
def bench(
    input: Annotated[Path, typer.Argument(help="Prompts: .jsonl / .json lines, or .parquet.")],
    flags: dict[str, Any],
    methods: Annotated[str, typer.Option(
        help="Comma-separated; the first is the baseline; method:k tries a k of its own "
             "(none,ngram:2,ngram:5).")
    ] = "none,ngram",
    batch_sizes: Annotated[str | None, typer.Option(
        help="Comma-separated batch sizes to bench each method at, e.g. 1,32,256 "
             "[default: --batch-size].")] = None,
    sample: Annotated[int | None, typer.Option(
        help="Bench a uniform random sample of this many records (drawn in one streaming pass; records keep "
             "their line numbers) [default: every record].")] = None,
    sample_seed: Annotated[int, typer.Option(help="Seed of --sample: the same seed, the same records.")] = 0,
    repeats: Annotated[int, typer.Option(
        help="Timed passes per method and batch size, alternated; each keeps its fastest "
             "(shared machines).")] = 1,
    plot: Annotated[Path | None, typer.Option(
        help="Write a PNG: tok/s per method with its oracle bound, acceptance per draft position.")] = None,
    model: Model = None, config: ConfigFile = None, input_format: InputFormat = None,
    summary_json: SummaryJson = None,
) -> None:
    from rich.console import Console

    from specgen.app.advice import advise
    from specgen.app.bench import BenchInput, parse_batch_sizes, parse_methods, run_bench
    from specgen.io.readers import check_input
    from specgen.io.readers import input_format as detect_format
    from specgen.io.report import bench_table
    from specgen.io.sample import sample_records

    with exit_codes():
        choices = parse_methods(methods)
        method_list = [c.method for c in choices]
        if batch_sizes is not None and flags.get("batch_size") is not None:
            raise ConfigError("give --batch-size or --batch-sizes, not both")
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else None
        # The speculative options apply to every speculative method listed; resolve them as for `run`.
        cfg = resolve_config(config, None, {**flags, "method": _bench_spec_method(method_list)},
                             set(method_list))
        check_input(input)
        fmt = detect_format(input, input_format)
        records = sample_records(input, fmt, sample, sample_seed) if sample is not None else None
        rows = run_bench(BenchInput(input, fmt, records), _load(model, cfg), cfg, choices, sizes,
                         repeats=repeats)
        advice = advise(rows, cfg)
        console = Console() if Console().is_terminal else Console(width=150)  # a file gets every column
        if records is not None:
            typer.echo(f"sample: {len(records)} records of {input.name} (seed {sample_seed})")
        console.print(bench_table(rows))
        if advice is not None:
            typer.echo(f"{advice.headline}\nwhy: {advice.why}\n--config YAML:\n{advice.yaml}", nl=False)
        if plot is not None:
            from specgen.io.bench_plot import plot_bench

            plot_bench(rows, plot,
                       f"specgen bench: {input.name}" + (f", {len(records)} sampled" if records else ""))
        _write_json(summary_json, {
            "input": str(input),
            "repeats": repeats,
            "sample": None if records is None else {"records": len(records), "seed": sample_seed,
                                                     "numbers": [r.number for r in records]},
            "rows": [r.to_dict() for r in rows],
            "advice": None if advice is None else advice.to_dict(),
        })


def _train_default(text: str, name: str) -> str:
    """Help text with TrainConfig's default (the one source of defaults) appended."""
    from specgen.train.config import TrainConfig

    return f"{text} [default: {getattr(TrainConfig, name)}]"


def _kinds_help() -> str:
    from specgen.train.kinds import KINDS

    return "; ".join(f"{name}: {k.help} (--method {k.method})" for name, k in KINDS.items())


@app.command("train-head", help="Train a drafting head for a model by self-distillation: generate the "
                  "model's own greedy continuations of the prompts in DATA, cache its hidden states, train "
                  "the head of --kind, and save it into OUTPUT in its public layout (use it with --method "
                  "KIND --draft-model OUTPUT), with loss.csv / loss.png and the held-out acceptance per "
                  "draft position. Rerunning the same command resumes (generation, then training from the "
                  "last checkpoint). Defaults: specgen.train.config.TrainConfig.")
def train_head(
    data: Annotated[Path, typer.Option("--data", help="Prompts: .jsonl / .parquet records as `specgen run` "
                                                      "reads them (only the prompt fields are used).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the head, loss.csv/png, the "
                                                                "data cache and checkpoints.")],
    kind: Annotated[str, typer.Option(help=f"The head. {_kinds_help()}.")] = "mtp",
    data_dir: Annotated[Path | None, typer.Option(help="Where the generated data is cached (share one "
                                                       "between kinds: it depends on the model and --gen-* "
                                                       "only) [default: OUTPUT/data].")] = None,
    model: Model = None,
    steps: Annotated[int | None, typer.Option(help=_train_default("Optimizer steps.", "steps"))] = None,
    batch_size: Annotated[int | None, typer.Option(help=_train_default(
        "Windows per step.", "batch_size"))] = None,
    seq_len: Annotated[int | None, typer.Option(help=_train_default(
        "Positions per window.", "seq_len"))] = None,
    window_anchor: Annotated[str | None, typer.Option(help=_train_default(
        "start | end: windows tiled from each sequence's start, or back from its end (a continuation then "
        "sees up to --seq-len positions of its prompt).", "window_anchor"))] = None,
    lr: Annotated[float | None, typer.Option(help=_train_default(
        "Peak learning rate (warmup, then cosine).", "lr"))] = None,
    warmup_steps: Annotated[int | None, typer.Option(help=_train_default(
        "Linear warmup steps.", "warmup_steps"))] = None,
    gen_max_tokens: Annotated[int | None, typer.Option(help=_train_default(
        "Tokens generated per prompt.", "gen_max_tokens"))] = None,
    gen_batch_size: Annotated[int | None, typer.Option(help=_train_default(
        "Engine slots while generating.", "gen_batch_size"))] = None,
    gen_samples: Annotated[int | None, typer.Option(help=_train_default(
        "Continuations per prompt: one greedy, the rest sampled at --gen-temperature.",
        "gen_samples"))] = None,
    gen_temperature: Annotated[float | None, typer.Option(help=_train_default(
        "Temperature of the sampled continuations.", "gen_temperature"))] = None,
    shortlist: Annotated[int | None, typer.Option(
        help=_train_default("Training softmax over this many most frequent labels; 0: the full vocabulary.",
                            "shortlist"))] = None,
    draft_vocab: Annotated[int | None, typer.Option(
        help=_train_default("Tokens the saved head drafts from: the most frequent training labels (a cheaper "
                            "LM head per draft); 0: the whole training vocabulary.", "draft_vocab"))] = None,
    num_layers: Annotated[int | None, typer.Option(help=_train_default(
        "MTP modules (multi-layer MTP, DeepSeek-V3's num_nextn_predict_layers): module i drafts position "
        "i + 1 from module i - 1's output; with one, the head is chained with itself.",
        "num_layers"))] = None,
    module_weight: Annotated[float | None, typer.Option(help=_train_default(
        "Loss weight of modules 1.. relative to module 0.", "module_weight"))] = None,
    heads: Annotated[int | None, typer.Option(help=_train_default(
        "Medusa / Hydra heads: head i drafts the token i + 1 places after the next one.", "heads"))] = None,
    head_layers: Annotated[int | None, typer.Option(help=_train_default(
        "Medusa / Hydra residual blocks per head.", "head_layers"))] = None,
    head_decay: Annotated[float | None, typer.Option(help=_train_default(
        "Medusa / Hydra: loss weight of head i is DECAY ** i.", "head_decay"))] = None,
    chain_weight: Annotated[float | None, typer.Option(
        help=_train_default("Weight of the second-draft loss (the head applied to its own output; one module "
                            "only); 0 trains the first only.", "chain_weight"))] = None,
    distill: Annotated[float | None, typer.Option(
        help=_train_default("Weight of the soft-target loss (the main model's own distribution over the "
                            "label, from its cached hidden states); the rest goes to the greedy label.",
                            "distill"))] = None,
    hidden_noise: Annotated[float | None, typer.Option(
        help=_train_default("Gaussian noise on the cached hidden input, std relative to each row's RMS "
                            "(EAGLE); 0: none.", "hidden_noise"))] = None,
    eval_every: Annotated[int | None, typer.Option(help=_train_default(
        "Held-out evaluation every N steps.", "eval_every"))] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help=_train_default(
        "Checkpoint every N steps.", "checkpoint_every"))] = None,
    save_dtype: Annotated[str | None, typer.Option(help=_train_default(
        "float16 | float32 on disk (loading upcasts).", "save_dtype"))] = None,
    init: Annotated[str | None, typer.Option(
        help=_train_default("MTP: last-layer (copy of the model's last decoder layer) | random.",
                            "init"))] = None,
    seed: Annotated[int | None, typer.Option(
        help=_train_default("Training seed: held-out split, initialisation, batch order.", "seed"))] = None,
    threads: Threads = None, input_format: InputFormat = None, quiet: Quiet = False,
) -> None:
    from specgen.config import from_mapping
    from specgen.io.readers import check_input
    from specgen.io.readers import input_format as detect_format
    from specgen.train.config import TrainConfig
    from specgen.train.kinds import head_kind

    with exit_codes(f"interrupted: rerun the same command to resume into {output}"):
        entry = head_kind(kind)
        check_input(data)
        fmt = detect_format(data, input_format)
        flags = {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "window_anchor": window_anchor,
                 "lr": lr, "warmup_steps": warmup_steps,
                 "gen_max_tokens": gen_max_tokens, "gen_batch_size": gen_batch_size,
                 "gen_samples": gen_samples,
                 "gen_temperature": gen_temperature, "shortlist": shortlist, "draft_vocab": draft_vocab,
                 "chain_weight": chain_weight, "distill": distill, "hidden_noise": hidden_noise,
                 "num_layers": num_layers, "module_weight": module_weight,
                 "heads": heads, "head_layers": head_layers, "head_decay": head_decay,
                 "eval_every": eval_every,
                 "checkpoint_every": checkpoint_every,
                 "save_dtype": save_dtype, "init": init, "seed": seed}
        cfg = from_mapping(TrainConfig, {k: v for k, v in flags.items() if v is not None},
                           f"train-head --kind {kind}")
        if output.exists() and not output.is_dir():
            raise ConfigError(f"{output}: exists and is not a directory")
        from specgen.api import load_model
        from specgen.train.data import generate_data, read_requests
        from specgen.train.progress import train_progress
        from specgen.train.trainer import held_out_acceptance

        loaded = load_model(model, threads=threads or 0)
        output.mkdir(parents=True, exist_ok=True)
        requests = read_requests(data, fmt, loaded, cfg)
        cache = data_dir or output / "data"
        with train_progress(quiet) as progress:
            generate_data(loaded, requests, cache, cfg, progress.generating,
                          features=entry.features(loaded.config) if entry.features else ())
            trainer = entry.trainer(loaded, output, cfg, cache)
            trainer.run(progress.training)
        if not quiet:
            acc = held_out_acceptance(trainer.rows)
            per = ", ".join(f"{a:.3f}" for a in acc) or "-"
            typer.echo(f"saved {output}/{entry.saves} ({cfg.save_dtype}); held-out acceptance per draft "
                       f"position {per}; loss curve {output}/loss.png; use: --method {entry.method} "
                       f"--draft-model {output}")


def _without(func: Any, *names: str) -> Any:
    """A command calling `func` whose options are func's but `names` (left at their defaults)."""
    import functools
    import inspect

    sig = inspect.signature(func, eval_str=True)

    @functools.wraps(func)
    def command(**kwargs: Any) -> None:
        func(**kwargs)

    del command.__wrapped__  # typer reads __signature__, not the wrapped function's
    command.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in names])
    command.__annotations__ = {}
    return command


app.command("train-mtp", help="Train an MTP head (train-head --kind mtp): generate the model's own greedy "
                              "continuations of the prompts in DATA, cache its hidden states, train the "
                              "head, and save it into OUTPUT (DeepSeek-V3 layout; use it with --method mtp "
                              "--mtp-model OUTPUT). Rerunning the same command resumes (generation, then "
                              "training from the last checkpoint). Defaults: "
                              "specgen.train.config.TrainConfig.")(
    _without(train_head, "kind", "heads", "head_layers", "head_decay"))


@app.command("make-draft", help="Build a draft model for --method draft_model from the main model itself: "
                               "its first --layers decoder layers with its final norm and LM head, saved as "
                               "an ordinary HF checkpoint in OUTPUT (float32; it quantizes at load with the "
                               "main model). With --data, the layers and final norm are first trained by "
                               "self-distillation on the model's own continuations of those prompts "
                               "(train-mtp's data and loop; training state in OUTPUT/training, so rerunning "
                               "resumes). Use: --method draft_model --draft-model OUTPUT.")
def make_draft(
    output: Annotated[Path, typer.Option("--output", "-o", help="A new directory for the draft checkpoint.")],
    model: Model = None,
    layers: Annotated[int, typer.Option(
        help="Decoder layers the draft keeps (1 .. the main model's - 1).")] = 6,
    data: Annotated[Path | None, typer.Option("--data", help="Prompts to distill on (.jsonl / .parquet as "
                                                             "`specgen run` reads them); "
                                                             "none: the cut alone.")] = None,
    steps: Annotated[int | None, typer.Option(help=_train_default("Optimizer steps.", "steps"))] = None,
    batch_size: Annotated[int | None, typer.Option(help=_train_default(
        "Windows per step.", "batch_size"))] = None,
    seq_len: Annotated[int | None, typer.Option(help=_train_default(
        "Positions per window.", "seq_len"))] = None,
    lr: Annotated[float | None, typer.Option(help=_train_default("Peak learning rate.", "lr"))] = None,
    gen_max_tokens: Annotated[int | None, typer.Option(help=_train_default(
        "Tokens generated per prompt.", "gen_max_tokens"))] = None,
    distill: Annotated[float | None, typer.Option(help=_train_default(
        "Weight of the main model's own distribution in the loss; the rest on its greedy label.",
        "distill"))] = None,
    seed: Annotated[int | None, typer.Option(help=_train_default("Training seed.", "seed"))] = None,
    threads: Threads = None, input_format: InputFormat = None, quiet: Quiet = False,
) -> None:
    with exit_codes(f"interrupted: rerun the same command to resume into {output}"):
        from specgen.config import EngineConfig
        from specgen.models import load_checkpoint
        from specgen.models.export import first_layers, save_hf

        ckpt = load_checkpoint(model, EngineConfig().cache_root())
        total = ckpt.config.num_layers
        draft = first_layers(ckpt, layers)
        info: dict = {"source": ckpt.source, "layers": layers}
        if data is not None:
            if (output / "config.json").exists():
                raise ConfigError(f"{output}: already holds a draft checkpoint")
            flags = {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                     "gen_max_tokens": gen_max_tokens, "distill": distill, "seed": seed}
            trained = _distill_draft(model, data, output / "training", layers, flags, threads, input_format,
                                     quiet)
            draft = dataclasses.replace(draft, weights={**draft.weights, **trained.pop("weights")})
            info["training"] = trained
        save_hf(draft, output, {"specgen_draft": info}, keep=("training",))
        how = ("" if data is None
               else f", distilled (held-out first-draft agreement {info['training']['eval_acc']:.3f})")
        typer.echo(f"saved {output}: {layers} of the {total} layers of {ckpt.source}{how}; use: --method "
                   f"draft_model --draft-model {output}")


def _distill_draft(model, data: Path, workdir: Path, layers: int, flags: dict, threads, input_format,
                   quiet: bool) -> dict:
    """Generate the main model's continuations of `data` and train the draft's layers on them
    (train/draft.py); returns the training summary with the trained weights under "weights" (HF names)."""
    from specgen.api import load_model
    from specgen.config import from_mapping
    from specgen.io.readers import check_input
    from specgen.io.readers import input_format as detect_format
    from specgen.train.config import TrainConfig
    from specgen.train.data import generate_data, read_requests
    from specgen.train.draft import DraftTrainer
    from specgen.train.progress import train_progress

    check_input(data)
    fmt = detect_format(data, input_format)
    cfg = from_mapping(TrainConfig, {k: v for k, v in flags.items() if v is not None}, "make-draft")
    loaded = load_model(model, threads=threads or 0)
    if not 1 <= layers < loaded.config.num_layers:
        raise ConfigError(f"--layers must be in 1..{loaded.config.num_layers - 1}, got {layers}")
    workdir.mkdir(parents=True, exist_ok=True)
    requests = read_requests(data, fmt, loaded, cfg)
    with train_progress(quiet) as progress:
        generate_data(loaded, requests, workdir / "data", cfg, progress.generating)
        trainer = DraftTrainer(loaded, workdir, cfg, layers)
        summary = trainer.run(progress.training)
    return {**summary, "weights": trainer.draft.hf_weights()}


def _bench_spec_method(methods) -> str | None:
    """The method the speculative options are checked against: the last speculative one listed."""
    names = [m.value for m in methods if m.value != "none"]
    return names[-1] if names else None


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash in a native kernel prints where Python was (Paddle's own dumps are off)
    app(prog_name="specgen")
