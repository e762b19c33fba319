"""Parse ``hora run`` arguments from the flag table, with messages that say what to do.

Not argparse: it would answer a typo with a bare "unrecognized arguments" and cannot tell a flag that
hora refuses for now from one that does not exist. Here every token before the command is looked up
in :data:`hora.runner.flags.FLAGS`; a typo gets a "did you mean", a refused flag says why, and the
first token that is not a flag (or everything after ``--``) is the command.
"""

from __future__ import annotations

import difflib
import textwrap
from dataclasses import dataclass, field
from typing import Any

from hora.base import knobs
from hora.base.errors import LaunchError
from hora.runner.flags import BY_NAME, FLAGS, GROUPS, Flag


class UsageError(LaunchError, ValueError):
    """Bad command line; ``hora run`` prints the message and exits with 2, like argparse. A ``ValueError``
    too, as it was before the launcher's errors became :class:`hora.base.errors.LaunchError`."""


@dataclass
class Parsed:
    values: dict[str, Any] = field(default_factory=dict)  # dest -> value, only for flags given
    command: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    help: bool = False


def suggest(word: str, choices: list[str]) -> str:
    """`` (did you mean X?)`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _lookup(name: str) -> Flag | None:
    flag = BY_NAME.get(name)
    if flag is None and name.startswith("--") and len(name) > 3:
        # unique prefixes of long flags work, as with argparse (horovodrun users may rely on them)
        hits = {BY_NAME[n] for n in BY_NAME if n.startswith(name) and n.startswith("--")}
        if len(hits) == 1:
            flag = hits.pop()
    return flag


def convert(flag: Flag, name: str, text: Any) -> Any:
    """Turn one raw value (a string from argv, or anything from YAML) into the flag's type; a knob's flag
    gives the knob's value (``--fusion-threshold-mb 4`` -> 4 MiB in bytes)."""
    value = _convert(flag, name, text)
    if flag.knob is not None and flag.unit != 1:
        return knobs.BY_NAME[flag.knob].type(value * flag.unit)
    return value


def _convert(flag: Flag, name: str, text: Any) -> Any:
    if flag.choices:  # case-insensitive; the value as the table spells it (DEBUG, tcp)
        match = next((c for c in flag.choices if c.upper() == str(text).upper()), None)
        if match is None:
            raise UsageError(f"{name} must be one of {', '.join(flag.choices)}; got {text!r}")
        return match
    if flag.kind is int:
        if isinstance(text, bool) or not str(text).strip().lstrip("-").isdigit():
            raise UsageError(f"{name} expects a whole number, got {text!r}")
        return int(text)
    if flag.kind is float:
        try:
            if isinstance(text, bool):
                raise ValueError
            return float(text)
        except ValueError:
            raise UsageError(f"{name} expects a number, got {text!r}") from None
    return str(text)


def parse(args: list[str]) -> Parsed:
    """Split ``hora run`` arguments into flag values and the command.

    >>> p = parse(["-np", "2", "--cycle-time-ms=5", "python", "train.py", "--lr", "0.1"])
    >>> p.values, p.command
    ({'num_proc': 2, 'cycle_time': 5.0}, ['python', 'train.py', '--lr', '0.1'])
    """
    out = Parsed()
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            out.command = args[i + 1:]
            break
        if not tok.startswith("-") or tok == "-":
            out.command = args[i:]
            break
        if tok in ("-h", "--help"):
            out.help = True
            i += 1
            continue
        name, eq, inline = tok.partition("=")
        flag = _lookup(name)
        short = BY_NAME.get(tok[:2])
        if flag is None and not eq and len(tok) > 2 and tok[1] != "-" and short and short.takes_value:
            name, inline, eq = tok[:2], tok[2:], "="  # -p2222, -Hlocalhost:2 (argparse allows these)
            flag = BY_NAME[name]
        if flag is None:
            raise UsageError(f"unknown flag {name}{suggest(name, list(BY_NAME))}; see hora run --help")
        if flag.status == "not yet":
            raise UsageError(f"{name} is not supported yet: {flag.why}")
        if name in flag.deprecated:
            out.warnings.append(f"{name} is deprecated; use {flag.names[0]}")
        i += 1
        if not flag.takes_value:
            if eq:
                raise UsageError(f"{name} takes no value")
            out.values[flag.dest] = flag.const
        else:
            raw = [inline] if eq else []
            while len(raw) < flag.nargs:
                if i >= len(args) or args[i] in BY_NAME:
                    raise UsageError(f"{name} needs {flag.nargs} value{'s' * (flag.nargs > 1)}")
                raw.append(args[i])
                i += 1
            vals = [convert(flag, name, r) for r in raw]
            out.values[flag.dest] = vals[0] if flag.nargs == 1 else vals
    return out


def no_effect(values: dict[str, Any]) -> tuple[list[str], list[str]]:
    """For the settings in ``values`` that hora accepts without effect: (a line each for ``--verbose``,
    a warning each for the ones that need one). Once per setting, however it was given (flag, config file,
    ``hora.run()`` argument) and however many of its flags were used."""
    seen, ignored, warnings = set(), [], []
    for f in FLAGS:
        if f.status != "no-op" or f.dest not in values or f.dest in seen:
            continue
        seen.add(f.dest)
        ignored.append(f"{f.names[0]} ({f.why})")
        if not f.quiet:
            warnings.append(f"{f.names[0]} is accepted but has no effect: {f.why}")
    return ignored, warnings


def _tag(flag: Flag) -> str:
    if flag.status == "no-op":
        return f" [accepted, no effect: {flag.why}]"
    if flag.status == "not yet":
        return " [not supported yet]"
    if flag.knob is not None:
        return f" [env HORA_{knobs.BY_NAME[flag.knob].env}]"
    return f" [env {flag.env}]" if flag.env else ""


def format_help() -> str:
    lines = ["usage: hora run [flags] command [args...]", "",
             "Start `command` as hora workers, one per rank; horovodrun's flags work the same way.",
             "Flags after the first word that is not a flag belong to the command ('--' also ends flags)."]
    for group in GROUPS:
        lines += ["", f"{group}:"]
        # the launcher's own flags, then those of the knobs, then what hora accepts without effect or refuses
        for f in sorted((f for f in FLAGS if f.group == group), key=lambda f: (f.status != "yes", f.knob is not None)):
            meta = f.metavar or {int: "N", float: "NUM"}.get(f.kind, "TEXT")
            if f.choices:
                meta = "{" + ",".join(f.choices) + "}"
            names = ", ".join(f.names) + (f" {meta}" if f.takes_value else "")
            text = textwrap.wrap(f.help + _tag(f), 70)
            if len(names) > 30:
                lines.append(f"  {names}")
                names = ""
            lines.append(f"  {names:<30} {text[0]}")
            lines += [" " * 33 + t for t in text[1:]]
    lines += ["", f"  {'-h, --help':<30} show this help and exit"]
    return "\n".join(lines) + "\n"
