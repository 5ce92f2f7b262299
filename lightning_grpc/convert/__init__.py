"""Protobuf <-> domain conversion: the one place that knows both shapes, one module per kind of object.

The servicers use it to call the cores; the clients use it to return plain Python objects.

- :mod:`.values`: JSON values (Struct/Value), span attribute values (AnyValue), timestamps, durations
- :mod:`.store`: rollouts, attempts, rollout specs, workers, resources
- :mod:`.spans`: spans, and spans as the Store keeps them
- :mod:`.trainer`: tensors, batch options, training events
- :mod:`.framing`: Protobuf framing by hand, for the hot span paths

``from lightning_grpc import convert; convert.span_to_pb(...)`` reaches every function below.
"""

from .framing import length_delimited, varint
from .spans import SpanMessage, span_from_pb, span_record, span_records, span_to_pb
from .store import (
    attempt_from_pb,
    attempt_to_pb,
    config_from_pb,
    config_to_pb,
    resource_from_pb,
    resource_to_pb,
    resources_from_pb,
    resources_update_from_pb,
    resources_update_to_pb,
    rollout_from_pb,
    rollout_to_pb,
    spec_from_pb,
    spec_to_pb,
    worker_from_pb,
    worker_to_pb,
)
from .trainer import (
    batch_options_from_pb,
    batch_options_to_pb,
    run_interruption_from_pb,
    run_interruption_to_pb,
    tensor_from_pb,
    tensor_to_pb,
    training_event_from_pb,
    training_event_to_pb,
)
from .values import (
    any_to_python,
    attributes_from_pb,
    attributes_to_pb,
    dict_to_struct,
    duration_to_float,
    float_to_duration,
    python_to_any,
    python_to_value,
    set_ts,
    struct_to_dict,
    ts_to_float,
    value_to_python,
)

__all__ = [
    "SpanMessage",
    "any_to_python",
    "attempt_from_pb",
    "attempt_to_pb",
    "attributes_from_pb",
    "attributes_to_pb",
    "batch_options_from_pb",
    "batch_options_to_pb",
    "config_from_pb",
    "config_to_pb",
    "dict_to_struct",
    "duration_to_float",
    "float_to_duration",
    "length_delimited",
    "python_to_any",
    "python_to_value",
    "resource_from_pb",
    "resource_to_pb",
    "resources_from_pb",
    "resources_update_from_pb",
    "resources_update_to_pb",
    "rollout_from_pb",
    "rollout_to_pb",
    "run_interruption_from_pb",
    "run_interruption_to_pb",
    "set_ts",
    "span_from_pb",
    "span_record",
    "span_records",
    "span_to_pb",
    "spec_from_pb",
    "spec_to_pb",
    "struct_to_dict",
    "tensor_from_pb",
    "tensor_to_pb",
    "training_event_from_pb",
    "training_event_to_pb",
    "ts_to_float",
    "value_to_python",
    "varint",
    "worker_from_pb",
    "worker_to_pb",
]
