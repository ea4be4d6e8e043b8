"""The flags' value checks (argparse `type=`: a bad value is a usage error naming the flag), for server/args.py
and the benchmark scripts' parsers."""

from __future__ import annotations

import argparse
from typing import Any


def number(kind, text: str, what: str, ok) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    return number(int, text, "a positive integer", lambda v: v > 0)


def nonnegative_int(text: str) -> int:
    return number(int, text, "an integer >= 0", lambda v: v >= 0)


def token_count(text: str) -> int:
    """A positive integer, or vLLM's forms: 32k = 32,000, 2.5k = 2,500 (k m g: powers of 1000), 32K = 32,768."""
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", text.strip())
    if m is None:
        if text.strip().lower() in ("auto", "-1"):
            raise argparse.ArgumentTypeError(f"{text} (vLLM: the longest that fits) is not supported: give a number, "
                                             "or leave the flag out for the default")
        return positive_int(text)
    number, suffix = m.groups()
    if suffix.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"must be a whole number before {suffix} (a power of 1024), got {text!r}")
    scale = 1000 ** " kmg".index(suffix) if suffix.islower() else 1024 ** " KMG".index(suffix)
    return positive_int(str(int(float(number) * scale)))


# vLLM's other names of these values (--dtype half, --load-format safetensors), read as ours.
VALUE_ALIASES = {"dtype": {"half": "float16", "float": "float32"}, "load_format": {"safetensors": "auto"}}


def value_alias(flag: str):
    return lambda text: VALUE_ALIASES[flag].get(text, text)


def positive_float(text: str) -> float:
    return number(float, text, "a positive number", lambda v: v > 0)


def nonnegative_float(text: str) -> float:
    return number(float, text, "a number >= 0", lambda v: v >= 0)


def fraction(text: str) -> float:
    return number(float, text, "a number in (0, 1]", lambda v: 0 < v <= 1)


def port_number(text: str) -> int:
    return number(int, text, "a port number in 0..65535 (0: any free port)", lambda v: 0 <= v <= 65535)


def power_of_two(text: str) -> int:
    return number(int, text, "a positive power of two", lambda v: v > 0 and not v & (v - 1))


def at_least_two(text: str) -> int:
    return number(int, text, "an integer >= 2", lambda v: v >= 2)


def speculative_config(text: str):
    """--speculative-config JSON -> config.SpeculativeConfig (a bad one is a one-line usage error)."""
    from deepinfer_jax.config import SpeculativeConfig

    try:
        spec = SpeculativeConfig.parse(text)
        spec.check_supported()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec
