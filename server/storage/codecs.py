"""How values are stored and shown: floats with non-finite flags, packed arrays, JSON documents, times.

Every module that reads or writes the database (the store, its read models, the alert engine) encodes
and decodes values through these functions, so a NaN is stored and read back the same way everywhere.
"""

from __future__ import annotations

import json
import math
import sys
from array import array
from datetime import datetime, timezone
from typing import Any, overload

from ..models import Flag
from ..schemas import json_float

__all__ = ["decode_float", "dump_json", "encode_float", "iso_time", "pack", "unpack"]

_FLAG_VALUES = {Flag.NAN: math.nan, Flag.POS_INF: math.inf, Flag.NEG_INF: -math.inf}


def encode_float(value: float) -> tuple[float | None, int]:
    """(value column, flag column) for a float: non-finite values are stored as NULL plus a flag."""
    if math.isfinite(value):
        return value, Flag.FINITE
    if math.isnan(value):
        return None, Flag.NAN
    return None, Flag.POS_INF if value > 0 else Flag.NEG_INF


def decode_float(value: float | None, flag: int) -> float:
    """The float a (value, flag) pair of columns stores (encode_float's inverse)."""
    if flag == Flag.FINITE and value is not None:
        return value
    return _FLAG_VALUES.get(Flag(flag), math.nan)


def pack(values: list[float] | list[int], typecode: str) -> bytes:
    """Little-endian bytes of a float64 ("d") or int64 ("q") array: compact, portable, NaN-preserving."""
    packed = array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes, typecode: str) -> list[Any]:
    """The values pack() stored."""
    values = array(typecode)
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else json_float(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def dump_json(document: dict[str, Any]) -> str:
    """Standard JSON text for a free-form document; NaN/±Inf become "NaN"/"Infinity"/"-Infinity"."""
    return json.dumps(_json_safe(document), allow_nan=False, default=str)


@overload
def iso_time(seconds: float) -> str: ...


@overload
def iso_time(seconds: None) -> None: ...


@overload
def iso_time(seconds: float | None) -> str | None: ...


def iso_time(seconds: float | None) -> str | None:
    """A stored Unix time (seconds) as the API shows it (ISO 8601, UTC); None stays None."""
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()
