"""``pretrain_xdistill.py --config run.yaml [key=value ...]``: a YAML file (and dotted
overrides) as the defaults of the command line's flags.

Keys are the flags' names, grouped or not (``teacher: {load: ...}`` is ``--teacher-load``);
values are typed as the flag would type them; an unknown key or a wrong type is refused naming
the file and the key. Flags given on the command line still win. A relative ``teachers_config``
in the file is the file beside it (an include); every other path is the user's, from the
working directory.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

#: Keys naming another config file: written in a config file as a relative path, they are read
#: beside that file (``teachers_config: teachers.yaml``), whatever the working directory; given
#: as an override or a flag they are the user's paths (from the working directory).
BESIDE_THE_FILE = ("teachers_config",)


def _flatten(node, prefix: str = "") -> dict[str, object]:
    """``{"teacher": {"load": x}, "lr": y}`` -> ``{"teacher_load": x, "lr": y}`` (a YAML group
    is the flags' prefix; dashes may be used for underscores)."""
    out: dict[str, object] = {}
    for key, value in node.items():
        name = f"{prefix}{str(key).replace('-', '_')}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "_"))
        else:
            out[name] = value
    return out


def _typed(action: argparse.Action, value, where: str):
    """A config value as the flag would have given it (the flag's type on strings and list
    items; booleans only for on/off flags)."""
    flag = action.option_strings[0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {flag} is on/off: true or false, got {value!r}")
        return value

    def one(item):
        if item is None:
            return item
        if action.type is None:  # the flag form gives text: a YAML 0.7 (a data weight) too
            return item if isinstance(item, str) else str(item)
        if not isinstance(item, str):
            return float(item) if action.type is float and isinstance(item, int) else item
        try:
            return action.type(item)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {flag} got {item!r}: {exc}") from exc

    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [one(v) for v in (value if isinstance(value, list) else [value])]
    if isinstance(value, list):
        raise ValueError(f"{where}: {flag} takes one value, got a list")
    value = one(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {flag} must be one of {list(action.choices)}, got {value!r}")
    return value


def apply_config(parser: argparse.ArgumentParser, path: str, overrides: Sequence[str]) -> None:
    """Make a YAML file plus dotted ``key=value`` overrides the parser's defaults (OmegaConf,
    interpolations resolved), so that flags on the command line still win. Keys are the flags'
    names (``tensor_model_parallel_size`` or ``tensor-model-parallel-size``), grouped or not
    (``teacher: {load: ...}`` = ``teacher_load``); an unknown key is an error naming it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    try:
        own = OmegaConf.load(path)
        given = OmegaConf.from_dotlist(list(overrides))
        values = _flatten(OmegaConf.to_container(OmegaConf.merge(own, given), resolve=True) or {})
        in_file = _flatten(OmegaConf.to_container(own, resolve=True) or {})
        in_overrides = _flatten(OmegaConf.to_container(given, resolve=True) or {})
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    for key in BESIDE_THE_FILE:  # the file's own relative reference: beside it, not the cwd
        value = values.get(key)
        if (isinstance(value, str) and key in in_file and key not in in_overrides
                and not os.path.isabs(value)):
            values[key] = os.path.join(os.path.dirname(os.path.abspath(path)), value)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    defaults = {}
    for key, value in values.items():
        action = actions.get(key)
        if action is None or key in ("config", "help"):
            raise ValueError(f"--config {path}: unknown key {key!r} (no --{key.replace('_', '-')}"
                             f" argument; pretrain_xdistill.py --help lists them)")
        defaults[key] = _typed(action, value, f"--config {path}")
        action.required = False  # given by the file; a flag may still override it
    parser.set_defaults(**defaults)


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser``'s arguments from ``argv``, where ``--config run.yaml [key=value ...]``
    (OmegaConf, as NeMo-RL / Megatron-Bridge runs are written) gives defaults for every flag and
    flags given on the command line win. Argparse errors exit with usage; a bad config raises
    ValueError."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    if known.config is None:
        return parser.parse_args(argv)
    overrides, flags = [], []
    for i, token in enumerate(rest):
        value_of_flag = i > 0 and _takes_value(parser, rest[i - 1])
        is_override = "=" in token and not token.startswith("-") and not value_of_flag
        (overrides if is_override else flags).append(token)
    apply_config(parser, known.config, overrides)
    args = parser.parse_args(flags)
    args.config = known.config
    return args


def _takes_value(parser: argparse.ArgumentParser, token: str) -> bool:
    """Whether ``token`` is a flag that consumes the next token (so ``k=v`` after it is its
    value, not an override)."""
    for action in parser._actions:
        if token in action.option_strings:
            return action.nargs != 0
    return False
