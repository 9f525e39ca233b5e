"""`dynbatchctl plan`: how many requests fit in one batch on a device, offline, with the arithmetic shown.

No daemon is needed. The model's dimensions come from its own config.json
(the model named in the config file, or a model directory given directly);
device memory from ``--memory-gb`` (which wins), else the config's
``devices.memory_gb``, else NVML (GPU ``--gpu``), the daemon's own order; where that is a table by device (a
mixed pool), one plan per device (``--json``: a list). The config file is found as every
command finds it (`dynbatchd.config.find_config`). Memory figures are GiB (2^30 bytes), as GPU
vendors count them. The model is `dynbatchd.memory.plan_memory`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dynbatchd import config as cfgmod
from dynbatchd.memory import GIB, MemoryPlan, model_dims, model_directory, plan_memory, read_model_config
from dynbatchd.plugins import Plugins
from dynbatchd.memory import fmt_bytes as _size
from dynbatchd.errors import DynbatchdError


class PlanError(DynbatchdError):
    """Something the operator must fix; printed as one line."""


def nvml_memory(index: int) -> tuple[str, int] | None:
    """(name, total bytes) of GPU `index` from NVML, or None where NVML or the GPU is absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        if index >= pynvml.nvmlDeviceGetCount():
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        return (name.decode() if isinstance(name, bytes) else str(name)), int(total)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def resolve_model(cfg: cfgmod.Config | None, model: str | None) -> tuple[str, Path, int | None]:
    """(label, model directory or config.json, the runner's sequence cap) for --model or the config's first model."""
    if cfg is not None and (model is None or model in cfg.models):
        name = model or next(iter(cfg.models))
        settings = cfg.models[name]
        runner = Plugins.load().runners().get(settings.runner)   # it says what it plans from, built-in or not
        found = model_directory(runner, dict(settings.options)) if runner is not None else None
        if found is not None:
            return name, found[0], found[1]
        if settings.runner in ("torchscript", "exported"):   # a program file: say where to look instead
            raise PlanError(f"model {name!r} is a {settings.runner} program, which has no config.json to plan "
                            "from; pass --model DIR with the config.json of the model it was exported from")
        raise PlanError(f"model {name!r} (runner {settings.runner!r}) names no model directory "
                        "(options.path); pass --model DIR with a config.json")
    if model is None:
        raise PlanError("no config file found: pass --config FILE or --model DIR")
    path = Path(model)
    if not path.exists():
        known = f" (models in {cfg.source}: {', '.join(cfg.models)})" if cfg is not None else ""
        raise PlanError(f"--model {model!r} is neither a model of the config nor a path{known}")
    return path.name or model, path, None


def device_memory(cfg: cfgmod.Config | None, memory_gb: float | None, gpu: int) -> dict[str, Any]:
    if memory_gb is not None:
        return {"name": "device", "total_bytes": int(memory_gb * GIB), "source": "--memory-gb"}
    if cfg is not None and not isinstance(cfg.devices.memory_gb, dict) and cfg.devices.memory_gb > 0:
        return {"name": "device", "total_bytes": int(cfg.devices.memory_gb * GIB),   # as the daemon sizes it
                "source": f"{cfg.source}: devices.memory_gb"}
    found = nvml_memory(gpu)
    if found is not None:
        return {"name": found[0], "total_bytes": found[1], "source": f"NVML (GPU {gpu})"}
    raise PlanError("device memory unknown: NVML sees no GPU; pass --memory-gb or set devices.memory_gb")


def channel_rows(cfg: cfgmod.Config | None, mp: MemoryPlan) -> list[dict[str, Any]]:
    rows = []
    per_token = mp.per_request_bytes / mp.dims.seq_len if mp.dims.kind == "decoder" else 0.0
    for name, ch in (cfg.channels.items() if cfg is not None else ()):
        fits = min(ch.max_batch, mp.max_batch)
        status = "fits" if ch.max_batch <= mp.max_batch else ("does not fit" if mp.max_batch == 0 else f"lower to {fits}")
        token_budget = int(mp.usable_bytes // per_token) if per_token > 0 and mp.usable_bytes > 0 else None
        rows.append({"channel": name, "configured_max_batch": ch.max_batch, "memory_max_batch": mp.max_batch,
                     "recommended_max_batch": fits, "status": status, "max_tokens": ch.max_tokens,
                     "token_budget": token_budget,
                     "max_tokens_fits": None if not ch.max_tokens or token_budget is None
                     else ch.max_tokens <= token_budget})
    return rows


def build_plans(config: Path | None, model: str | None, memory_gb: float | None, seq_len: int | None,
                dtype: str | None, headroom: float, reserve_gb: float | None, gpu: int,
                profile: str | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    """One plan, or one per device where the config's ``devices.memory_gb`` is a table by device
    (a mixed pool) and neither --memory-gb nor --profile names one memory for all."""
    path = cfgmod.find_config(config)
    try:
        cfg = cfgmod.load(path) if path is not None else None
    except cfgmod.ConfigError as exc:
        raise PlanError(str(exc)) from None
    table = cfg.devices.memory_gb if cfg is not None else None
    if memory_gb is not None or profile is not None or not isinstance(table, dict) or not table:
        return build_plan(config, model, memory_gb, seq_len, dtype, headroom, reserve_gb, gpu, profile)
    plans = []
    for device, gb in table.items():
        data = build_plan(config, model, gb, seq_len, dtype, headroom, reserve_gb, gpu)
        data["device"].update(name=device, source=f"{cfg.source}: devices.memory_gb.{device}")
        plans.append(data)
    return plans


def build_plan(config: Path | None, model: str | None, memory_gb: float | None, seq_len: int | None,
               dtype: str | None, headroom: float, reserve_gb: float | None, gpu: int,
               profile: str | None = None) -> dict[str, Any]:
    """Everything `plan` prints, as data. `profile`: a device profile (`dynbatchd.capacity`) whose
    memory_gb stands in for --memory-gb, so a mixed pool is planned one device kind at a time."""
    from_profile = None
    if profile is not None and memory_gb is None:
        from dynbatchd.capacity import load_profile

        try:
            from_profile = load_profile(profile)
        except cfgmod.ConfigError as exc:
            raise PlanError(str(exc)) from None
        memory_gb = from_profile.memory_gb
    path = cfgmod.find_config(config)
    try:
        cfg = cfgmod.load(path) if path is not None else None
    except cfgmod.ConfigError as exc:
        raise PlanError(str(exc)) from None
    label, model_path, cap = resolve_model(cfg, model)
    try:
        raw, model_dir = read_model_config(model_path)
        dims = model_dims(raw, model_dir=model_dir, name=label, seq_len=seq_len or cap, dtype=dtype)
        device = device_memory(cfg, memory_gb, gpu)
        mp = plan_memory(dims, device["total_bytes"], headroom=headroom,
                         reserve_bytes=None if reserve_gb is None else int(reserve_gb * GIB))
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    data = mp.as_dict()
    if from_profile is not None:
        device.update(name=from_profile.name, source=f"profile {from_profile.name}: memory_gb")
    return {"config": str(path) if path else None, "model": data.pop("dims"), "device": device,
            "memory": data, "channels": channel_rows(cfg, mp)}


def render(data: dict[str, Any], console: Console) -> None:
    m, dev, mem = data["model"], data["device"], data["memory"]
    heads = f"{m['kv_heads']} kv heads" if m["kind"] == "decoder" else f"{m['heads']} heads"
    console.print(f"[bold]{m['name']}[/bold] ({m['kind']}, {m['layers']} layers, {heads} × "
                  f"{m['head_dim']}, {m['seq_len']} tokens, {m['bytes_per_elem']} B/elem) on {dev['name']} "
                  f"{_size(dev['total_bytes'])} [dim](from {dev['source']})[/dim]", highlight=False)
    steps = Table(title="memory arithmetic")
    for col, justify in (("step", "left"), ("formula", "left"), ("value", "right")):
        steps.add_column(col, justify=justify)
    for s in mem["steps"]:
        value = f"{int(s['value'])} {s['unit']}" if s["unit"] != "bytes" else _size(s["value"])
        steps.add_row(s["label"], s["formula"], value)
    console.print(steps)
    if data["channels"]:
        table = Table(title="max batch per channel")
        for col in ("channel", "configured", "memory allows", "recommended", "status", "token cap"):
            table.add_column(col, justify="left" if col in ("channel", "status", "token cap") else "right")
        for r in data["channels"]:
            cap = "-" if not r["max_tokens"] else (f"{r['max_tokens']} " + (
                "?" if r["max_tokens_fits"] is None else "fits" if r["max_tokens_fits"] else f"> {r['token_budget']}"))
            style = "green" if r["status"] == "fits" else "yellow"
            table.add_row(r["channel"], str(r["configured_max_batch"]), str(r["memory_max_batch"]),
                          str(r["recommended_max_batch"]), f"[{style}]{r['status']}[/{style}]", cap)
        console.print(table)
    console.print(f"[dim]weights counted once; the guide's formula (weights × batch) would allow "
                  f"{mem['guide_max_batch']}.[/dim]", highlight=False)


def plan(ctx: typer.Context,
         config: Optional[Path] = typer.Option(None, "--config", "-c",
                                               help="Config file (default: dynbatchctl --config, else "
                                                    "$DYNBATCHD_CONFIG, ./etc/dynbatchd.toml, "
                                                    "/etc/dynbatchd/dynbatchd.toml)."),
         model: Optional[str] = typer.Option(None, "--model", "-m",
                                             help="A model of the config, or a model directory / config.json "
                                                  "(default: the config's first model)."),
         memory_gb: Optional[float] = typer.Option(None, "--memory-gb", min=0.0,
                                                   help="Device memory in GiB; wins over the config and NVML "
                                                        "(default: devices.memory_gb, else NVML)."),
         seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1,
                                               help="Tokens per request (default: the runner's max_tokens, "
                                                    "else max_position_embeddings)."),
         dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, float16, bfloat16, int8… "
                                                                   "(default: the config's torch_dtype, else float32)."),
         headroom: float = typer.Option(0.20, "--headroom", min=0.0, max=0.99, help="Fraction of memory kept free."),
         reserve_gb: Optional[float] = typer.Option(None, "--reserve-gb", min=0.0,
                                                    help="Activation/workspace reserve in GiB (default: min(1, 5% of total))."),
         gpu: int = typer.Option(0, "--gpu", min=0, help="NVML index of the GPU to plan for."),
         profile: Optional[str] = typer.Option(None, "--profile",
                                               help="Device profile (h100-80gb, l4-24gb, cpu-16core or a TOML "
                                                    "file) whose memory to plan for; --memory-gb wins."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")) -> None:
    """Max batch per channel for a model on a device, from the model's config.json, with the arithmetic shown
    (one plan per device where the config's devices.memory_gb is a table by device)."""
    config = config or getattr(ctx.obj, "config", None)   # the global dynbatchctl --config
    try:
        data = build_plans(config, model, memory_gb, seq_len, dtype, headroom, reserve_gb, gpu, profile)
    except PlanError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        console = Console()
        for i, one in enumerate(data if isinstance(data, list) else [data]):
            if i:
                console.print()
            render(one, console)
