"""Values: JSON (Struct/Value), span attribute values (ours and OTLP's AnyValue), timestamps and durations."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common

from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.v1 import common_pb2

_INT53 = 2**53

# ------------------------------------------------------------------ JSON values


def value_to_python(v: struct_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return v.string_value
    if kind == "number_value":
        n = v.number_value
        return int(n) if n.is_integer() and abs(n) < _INT53 else n
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return struct_to_dict(v.struct_value)
    if kind == "list_value":
        return [value_to_python(x) for x in v.list_value.values]
    return None


def struct_to_dict(s: struct_pb2.Struct) -> dict[str, Any]:
    return {k: value_to_python(v) for k, v in s.fields.items()}


def python_to_value(obj: Any, out: struct_pb2.Value | None = None, field: str = "value") -> struct_pb2.Value:
    v = out if out is not None else struct_pb2.Value()
    if obj is None:
        v.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        v.bool_value = obj
    elif isinstance(obj, int | float):
        if not math.isfinite(obj):
            raise InvalidArgumentError(field, "JSON numbers must be finite")
        v.number_value = float(obj)
    elif isinstance(obj, str):
        v.string_value = obj
    elif isinstance(obj, Mapping):
        dict_to_struct(obj, v.struct_value, field)
    elif isinstance(obj, list | tuple):
        lst = v.list_value
        lst.SetInParent()
        for i, item in enumerate(obj):
            python_to_value(item, lst.values.add(), f"{field}[{i}]")
    else:
        raise InvalidArgumentError(field, f"{type(obj).__name__} is not JSON")
    return v


def dict_to_struct(
    d: Mapping[str, Any], out: struct_pb2.Struct | None = None, field: str = "value"
) -> struct_pb2.Struct:
    s = out if out is not None else struct_pb2.Struct()
    if out is not None:
        s.SetInParent()  # an empty mapping still sets the field
    for k, item in d.items():
        python_to_value(item, s.fields[str(k)], f"{field}.{k}")
    return s


# ------------------------------------------------------------------ times


def ts_to_float(ts: timestamp_pb2.Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


def set_ts(ts: timestamp_pb2.Timestamp, value: float | None) -> None:
    if value is not None:
        seconds = math.floor(value)
        ts.seconds = seconds
        ts.nanos = round((value - seconds) * 1e9) % 1_000_000_000


def duration_to_float(d: duration_pb2.Duration, present: bool = True) -> float | None:
    if not present:
        return None
    return d.seconds + d.nanos / 1e9


def float_to_duration(value: float, out: duration_pb2.Duration) -> None:
    seconds = math.floor(value)
    out.seconds = seconds
    out.nanos = round((value - seconds) * 1e9) % 1_000_000_000


# ------------------------------------------------------------------ span attributes


def any_to_python(v: common_pb2.AnyValue, numpy_arrays: bool = False) -> Any:
    """An attribute value as Python; int and double arrays as lists, or as numpy arrays when asked."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_to_python(x, numpy_arrays) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_to_python(kv.value, numpy_arrays) for kv in v.kvlist_value.values}
    if kind == "int_array_value":
        values = v.int_array_value.values
        return np.array(values, dtype=np.int64) if numpy_arrays else list(values)
    if kind == "double_array_value":
        doubles = v.double_array_value.values
        return np.array(doubles, dtype=np.float64) if numpy_arrays else list(doubles)
    return getattr(v, kind)


_INTS: set[type] = {int}  # bool is a type of its own here, as in the checks below
_FLOATS: set[type] = {float}


def python_to_any(obj: Any, out: common_pb2.AnyValue) -> None:
    if isinstance(obj, bool):
        out.bool_value = obj
    elif isinstance(obj, int):
        out.int_value = obj
    elif isinstance(obj, float):
        out.double_value = obj
    elif isinstance(obj, str):
        out.string_value = obj
    elif isinstance(obj, bytes | bytearray):
        out.bytes_value = bytes(obj)
    elif isinstance(obj, Mapping):
        kv = out.kvlist_value
        kv.SetInParent()
        for k, item in obj.items():
            entry = kv.values.add()
            entry.key = str(k)
            python_to_any(item, entry.value)
    elif isinstance(obj, list | tuple):
        # the items' types gathered in C: token ids run to thousands, and a test per item took longer
        kinds = set(map(type, obj))
        if kinds == _INTS:
            out.int_array_value.values.extend(obj)
        elif kinds == _FLOATS:
            out.double_array_value.values.extend(obj)
        else:
            arr = out.array_value
            arr.SetInParent()
            for item in obj:
                python_to_any(item, arr.values.add())
    elif obj is None:
        return
    else:
        out.string_value = str(obj)


def attributes_to_pb(attrs: Mapping[str, Any], out: Any) -> None:
    for k, v in attrs.items():
        python_to_any(v, out[k])


def attributes_from_pb(m: Any, numpy_arrays: bool = False) -> dict[str, Any]:
    return {k: any_to_python(v, numpy_arrays) for k, v in m.items()}


# ------------------------------------------------------------------ OTLP attribute values


_OTLP_SCALARS = frozenset({"string_value", "bool_value", "int_value", "double_value", "bytes_value"})


def otlp_value_to_pb(src: otlp_common.AnyValue, out: common_pb2.AnyValue) -> None:
    """One OTLP value into ours; an unset value (or a dictionary index, meaningless here) stays unset."""
    kind = src.WhichOneof("value")
    if kind in _OTLP_SCALARS:
        setattr(out, kind, getattr(src, kind))
    elif kind == "array_value":
        _otlp_array_to_pb(src.array_value.values, out)
    elif kind == "kvlist_value":
        kvlist = out.kvlist_value
        kvlist.SetInParent()
        for item in src.kvlist_value.values:
            otlp_value_to_pb(item.value, kvlist.values.add(key=item.key).value)


def _otlp_array_to_pb(values: Sequence[otlp_common.AnyValue], out: common_pb2.AnyValue) -> None:
    """Homogeneous int and float arrays are packed; anything else stays a list of values."""
    kinds = {v.WhichOneof("value") for v in values}
    if kinds == {"int_value"}:
        out.int_array_value.values.extend([v.int_value for v in values])
    elif kinds == {"double_value"}:
        out.double_array_value.values.extend([v.double_value for v in values])
    else:
        array = out.array_value
        array.SetInParent()
        for v in values:
            otlp_value_to_pb(v, array.values.add())


def otlp_attributes_to_pb(src: Iterable[otlp_common.KeyValue], out: Any) -> None:
    """OTLP key/values into a ``map<string, AnyValue>``; a repeated key keeps its last value."""
    for kv in src:
        entry = out[kv.key]
        entry.Clear()
        otlp_value_to_pb(kv.value, entry)
