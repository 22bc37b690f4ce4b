"""What a resumed training run must share with the run it continues.

A checkpoint records the options that decide the run's result (data, limits, losses, schedule, image
position...) and the command that started it. `--resume` with other options would silently continue a
different run from the first one's weights and optimiser state, so it is refused, naming each option that
differs and the interrupted run's command. Options that only say how long to run, where to write or how
many threads to use may change between the two; each script names those.

An option added after a checkpoint was written is absent from its record. Given the parser's defaults,
such an option left at its default is taken to be the older run's behaviour (new options are off by
default) and the run resumes, saying so; set to anything else it is refused like any other difference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

_ABSENT = object()


def run_options(args: argparse.Namespace, free: Iterable[str], **resolved) -> dict:
    """Every command-line option except those in `free`, with `resolved` values (defaults made explicit,
    a file's content hash instead of its path) replacing or adding to them. Pass values not named after an
    option as a dict, e.g. **{"--init file (SHA-256)": digest}: messages show such names as they are."""
    free = set(free)
    options = {name: value for name, value in vars(args).items() if name not in free}
    options.update(resolved)
    return options


def check_resume(saved: dict | None, options: dict, checkpoint: Path, command: str | None = None,
                 defaults: dict | None = None) -> None:
    """Return when `options` are those `saved` in `checkpoint`; else exit with what differs. A checkpoint
    written before options were recorded (`saved` None) is resumed as told, with a warning. An option the
    checkpoint does not record, at its value in `defaults` (the parser's), is not a difference."""
    if saved is None:
        print(f"warning: {checkpoint} does not record its run's options (written by an older version): "
              f"resuming with this command's, unchecked", file=sys.stderr)
        return
    defaults = defaults or {}
    newer = sorted(name for name in set(options) - set(saved)
                   if name in defaults and options[name] == defaults[name])
    if newer:
        print(f"note: {checkpoint} was written before " + ", ".join(_flag(name) for name in newer)
              + " existed; resuming with " + ("its" if len(newer) == 1 else "their") + " default", file=sys.stderr)
    differ = [name for name in sorted(set(saved) | set(options))
              if name not in newer and saved.get(name, _ABSENT) != options.get(name, _ABSENT)]
    if not differ:
        return
    lines = "\n".join(f"  {_flag(name)}: the interrupted run had {_shown(saved.get(name, _ABSENT))}, "
                      f"this command has {_shown(options.get(name, _ABSENT))}" for name in differ)
    started = f"\nThe interrupted run's command: {command}" if command else ""
    raise SystemExit(f"{checkpoint} belongs to a run with other options; resuming it with these would continue a "
                     f"different run from its weights:\n{lines}{started}\n"
                     f"Resume with the same options, or start afresh without --resume or with another --out.")


def _flag(name: str) -> str:
    """An option's flag; a resolved value named in words ("data read (SHA-256)") as it is."""
    return "--" + name.replace("_", "-") if name.isidentifier() else name


def _shown(value) -> str:
    return "(not recorded)" if value is _ABSENT else repr(value)
