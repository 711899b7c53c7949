"""Command-line mistakes as one line: the parser every `radixkv` command uses, and the value types it checks.

A mistake on the command line prints `radixkv CMD: the problem; the fix` on one line and exits with
status 2, before anything slow (a model, a pool) loads; `--help` shows every default. The checks are
argparse types, so a value is refused while the flags parse.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from radixkv.memory.layout import DTYPE_ALIASES, DTYPE_BYTES, canonical_dtype
from radixkv.planning.plan import parse_bytes

USAGE_ERROR = 2  # the exit status of a command-line mistake, as argparse's own


class _DefaultsFormatter(argparse.HelpFormatter):
    """Each flag's default after its help, unless the help says it already or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = "(default" in text or "default:" in text
        if shown or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block: the line says the fix) and the defaults in `--help`."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(**kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def size(text: str) -> int:
    """An argparse type: a size with its unit (`parse_bytes`)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def integer(minimum: int, maximum: int | None = None, power_of_two: bool = False) -> type[int]:
    """An argparse type: an integer in [minimum, maximum] (a power of two if asked)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {value}")
        if power_of_two and value & (value - 1):
            lower = 1 << (value.bit_length() - 1)
            raise argparse.ArgumentTypeError(f"{value} is not a power of two: use {lower} or {lower * 2}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its message
    return parse  # type: ignore[return-value]


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    return integer(0, 65535)(text)


KV_DTYPES = (*sorted(DTYPE_BYTES), *DTYPE_ALIASES)  # fp8 is float8_e4m3fn in every command


def kv_dtype(text: str) -> str:
    """An argparse type: a KV dtype or its alias, as its canonical name (fp8 -> float8_e4m3fn)."""
    if text not in KV_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a KV dtype: use one of {', '.join(KV_DTYPES)}")
    return canonical_dtype(text)
