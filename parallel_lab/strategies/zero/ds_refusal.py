"""What DeepSpeed refuses in a config file, as one line: each offending key path, why, and the fix.

DeepSpeed checks its config sections with pydantic models (``DeepSpeedBF16Config``,
``DeepSpeedZeroConfig``, ...) and stops at the first section that fails, with a page of text. Here
the ``ValidationError``'s own records (``.errors()``: a ``loc`` tuple relative to the section's
model, an error type, the input) become key paths of the file, every section is checked so every
offending key is named at once, and the line stays under 300 characters. A key that belongs to
another section (fp16's loss-scaling keys in ``bf16``: DeepSpeed's "Extra inputs are not
permitted") says which; an unknown key gets the nearest name DeepSpeed knows. DeepSpeed's full
message is printed above the line with ``PARALLEL_LAB_VERBOSE=1``.

The batch keys are checked first with DeepSpeed's own arithmetic
(``DeepSpeedConfig._set_batch_related_parameters`` and ``_batch_assertion``), so a non-number or
a batch that does not split over the ranks is named instead of DeepSpeed's ``'>' not supported``.
"""

from __future__ import annotations

import difflib
import os
import sys
import typing

from parallel_lab.strategies.zero.ds_auto import BATCH_KEYS, MAX_LINE, dotted, first_fitting, fit

VERBOSE_ENV = "PARALLEL_LAB_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def print_verbose(key: str, path: str, exc: BaseException) -> None:
    """DeepSpeed's own message, whole, above the one-line error (PARALLEL_LAB_VERBOSE=1 only)."""
    if verbose():
        where = f"{key}={path}" if path != "(section)" else f"section {key} of the file"
        print(f"parallel_lab: DeepSpeed's message for {where}:\n{exc}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- batch
def _count(value) -> int | None:
    """A positive whole number as DeepSpeed takes it (16 or 16.0), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if value == int(value) and value > 0 else None


def batch_problem(data: dict, world: int) -> str | None:
    """What is wrong with the file's batch keys at this world size, as DeepSpeed computes them."""
    given = {k: data[k] for k in BATCH_KEYS if data.get(k) is not None}
    bad = [k for k, v in given.items() if _count(v) is None]
    if bad:
        listed = ", ".join(f"{k}={given[k]!r}" for k in bad)
        return f'{listed}: must be a positive integer or "auto"; fix: write a whole number > 0 (no quotes) or "auto"'
    if not given:
        return None
    accum, batch, micro = (_count(given[k]) if k in given else None for k in BATCH_KEYS)
    if batch is None and micro is None:
        return (
            "gradient_accumulation_steps alone gives no batch size; fix: add train_batch_size or "
            'train_micro_batch_size_per_gpu (a number or "auto")'
        )
    if batch is not None and micro is not None and accum is None:  # DeepSpeed's order of derivation
        accum = batch // micro // world
    elif batch is not None and accum is None:
        accum, micro = 1, batch // world
    elif batch is not None and micro is None:
        micro = batch // world // accum
    elif batch is None:
        batch, accum = micro * (accum or 1) * world, accum or 1
    if micro > 0 and accum > 0 and batch == micro * accum * world:
        return None
    order = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    listed = ", ".join(f"{k}={given[k]}" for k in order if k in given)
    return (
        f"{listed} {'do' if len(given) > 1 else 'does'} not fit world_size {world} "
        f"({batch} != {micro} * {accum} * {world}); fix: make "
        f'batch = micro x accumulation x world_size, or set the derived ones to "auto"'
    )


# -------------------------------------------------------------------------------------------- pydantic
def _sections(data: dict) -> list[tuple[str, typing.Callable, type]]:
    """(key path of the section, DeepSpeed's parse of it from the whole file, its model)."""
    from deepspeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
    from deepspeed.runtime.precision_config import (
        DeepSpeedBF16Config,
        DeepSpeedFP16Config,
        get_bfloat16_config,
        get_float16_config,
    )
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config

    bf16 = "bf16" if "bf16" in data or "bfloat16" not in data else "bfloat16"
    sections = [
        ("zero_optimization", get_zero_config, DeepSpeedZeroConfig),
        ("fp16", get_float16_config, DeepSpeedFP16Config),
        (bf16, get_bfloat16_config, DeepSpeedBF16Config),
        ("", get_monitor_config, DeepSpeedMonitorConfig),
    ]
    try:
        from deepspeed.comm.config import CommsLoggerConfig
        from deepspeed.compile.config import CompileConfig

        sections.append(("comms_logger", lambda d: CommsLoggerConfig(**d.get("comms_logger", {})), CommsLoggerConfig))
        sections.append(("compile", lambda d: CompileConfig(**d.get("compile", {})), CompileConfig))
    except ImportError:  # another DeepSpeed: the sections above still say most
        pass
    return sections


def _fields(model) -> set[str]:
    """The keys a pydantic model takes (names and aliases)."""
    names = set()
    for name, info in getattr(model, "model_fields", {}).items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def _model_at(model, loc: tuple):
    """The nested pydantic model a loc's parent points at (offload_param -> its config), or None."""
    for key in loc:
        fields = getattr(model, "model_fields", {})
        info = fields.get(key) or next((f for f in fields.values() if f.alias == key), None)
        if info is None:
            return None
        candidates = [info.annotation, *typing.get_args(info.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and hasattr(c, "model_fields")), None)
        if model is None:
            return None
    return model


def _collect(data: dict, exc: BaseException) -> list[dict]:
    """Every pydantic error of every section, each with its key path in the file."""
    found: list[dict] = []
    seen: set[tuple] = set()
    sections = _sections(data)
    for prefix, parse, model in sections:
        try:
            parse(data)
        except Exception as err:  # a ValidationError, or DeepSpeed's own check
            if hasattr(err, "errors") and callable(err.errors):
                if str(err) != str(exc):  # DeepSpeed stopped at its first section: the others too
                    print_verbose(prefix or "monitor", "(section)", err)
                for e in err.errors():
                    path = tuple(p for p in (prefix, *e["loc"]) if p != "")
                    if path not in seen:
                        seen.add(path)
                        found.append({**e, "path": path, "section": prefix, "model": model})
    if not found and hasattr(exc, "errors"):  # a section not listed above: its model's name is the title
        for e in exc.errors():
            found.append({**e, "path": (getattr(exc, "title", "?"), *e["loc"]), "section": "", "model": None})
    return found


def _home(key: str, section: str, data: dict) -> str | None:
    """The other section whose model takes `key` (fp16 for bf16.loss_scale), if any."""
    for prefix, _, model in _sections(data):
        if prefix and prefix != section and key in _fields(model):
            return prefix
    return None


def _describe(errors: list[dict], data: dict) -> tuple[list[str], list[str]]:
    """Groups of key paths with one cause, each 'paths why; fix: ...': (full, shorter)."""
    homes: dict[tuple[str, str], list[str]] = {}
    unknown, wrong = [], []
    for e in errors:
        where = dotted(e["path"])
        if e["type"] == "extra_forbidden":
            home = _home(str(e["loc"][-1]), e["section"], data) if len(e["loc"]) == 1 else None
            if home:
                homes.setdefault((e["section"], home), []).append(where)
                continue
            known = _fields(_model_at(e["model"], tuple(e["loc"][:-1])) if e["model"] else None)
            near = difflib.get_close_matches(str(e["loc"][-1]), sorted(known), n=1)
            unknown.append((where, f"{where} (did you mean {near[0]}?)" if near else where))
        elif e["type"] == "missing":
            wrong.append((where, f"{where} missing"))
        else:
            shown = repr(e.get("input"))
            shown = shown if len(shown) <= 20 else shown[:17] + "..."
            why = str(e["msg"]).rstrip(".").replace("Input should be", "should be")
            wrong.append((where, f"{where}={shown} {why}"))
    full, short = [], []
    for (section, home), paths in homes.items():
        many = len(paths) > 1
        what = "loss-scaling key" if home == "fp16" and section.startswith("b") else "key"
        listed = ", ".join(paths)
        article = "an" if home[0] in "aefo" else "a"
        verb, it, belongs = ("are", "them", "they belong") if many else (f"is {article}", "it", "it belongs")
        plural = "s" if many else ""
        full.append(f"{listed} {verb} {home} {what}{plural}; fix: remove {it} from {section} ({belongs} in {home})")
        short.append(f"{listed} belong{'' if many else 's'} in {home}; fix: remove from {section}")
    if unknown:
        verb = "are unknown keys" if len(unknown) > 1 else "is an unknown key"
        full.append(f"{', '.join(u[1] for u in unknown)} {verb}; fix: rename or remove")
        short.append(f"{', '.join(u[0] for u in unknown)} unknown; fix: rename or remove")
    if wrong:
        full.append(f"{'; '.join(w[1] for w in wrong)}; fix the value{'s' if len(wrong) > 1 else ''}")
        short.append(f"{', '.join(w[0] for w in wrong)} invalid; fix the value{'s' if len(wrong) > 1 else ''}")
    return full, short


def deepspeed_refusal(key: str, path: str, data: dict, exc: BaseException) -> str:
    """One line (under 300 characters with the prefix) for what DeepSpeed raised on this file."""
    print_verbose(key, path, exc)
    full, short = _describe(_collect(data, exc), data) if hasattr(exc, "errors") else ([], [])
    if full:  # where the whole story is too long, every key path is still named (the why dropped)
        head = f"{key}={path} is refused by DeepSpeed: "
        return first_fitting(key, path, head + "; ".join(full), head + "; ".join(short))
    message = " ".join(str(exc).split()) or type(exc).__name__
    suffix = "; fix the file"
    line = fit(f"{key}={path} is refused by DeepSpeed: {message}{suffix}", key, path)
    return line if line.endswith(suffix) else line[: MAX_LINE - len(suffix)].rstrip(". ") + "..." + suffix
