"""Variable specs to and from their wire message, ``wehub_ps.v1.VariableSpec``.

Each spec part (optimizer, initializer, partitioner) is a oneof in the
message whose field name is the part's kind name from :mod:`wehub_ps.specs`,
and whose submessage has the dataclass's fields (the seed is kept on the
initializer message itself, for every random initializer).
"""

from __future__ import annotations

from dataclasses import fields

from wehub_ps.placement import MinSizePartitioner
from wehub_ps.specs import (
    INITIALIZER_KINDS,
    OPTIMIZER_KINDS,
    PARTITIONER_KINDS,
    Admission,
    DiskTier,
    Expiry,
    SpecError,
    VariableSpec,
    as_dict,
)
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.dtypes import to_numpy_dtype, to_wire_dtype

__all__ = ["spec_to_proto", "spec_from_proto"]

_EVICTIONS = {"none": ps_pb2.EVICTION_NONE, "lru": ps_pb2.EVICTION_LRU}
_AGGREGATIONS = {"mean": ps_pb2.AGGREGATION_MEAN, "sum": ps_pb2.AGGREGATION_SUM,
                 "row_mean": ps_pb2.AGGREGATION_ROW_MEAN}


def spec_to_proto(spec: VariableSpec) -> ps_pb2.VariableSpec:
    """The wire message of a (valid) spec."""
    msg = ps_pb2.VariableSpec(name=spec.name, shape=spec.shape, dtype=to_wire_dtype(spec.dtype),
                              hash_table=spec.hash_table, max_rows=spec.max_rows,
                              eviction=_EVICTIONS[spec.eviction], aggregation=_AGGREGATIONS[spec.aggregation])
    _oneof_to_proto(spec.initializer, INITIALIZER_KINDS, msg.initializer)
    seed = getattr(spec.initializer, "seed", None)
    if seed is not None:
        msg.initializer.seed = seed
    _oneof_to_proto(spec.optimizer, OPTIMIZER_KINDS, msg.optimizer)
    _oneof_to_proto(spec.partitioner, PARTITIONER_KINDS, msg.partitioner)
    if spec.admission is not None:
        msg.admission.CopyFrom(ps_pb2.AdmissionSpec(**as_dict(spec.admission)))
    if spec.expiry is not None:
        msg.expiry.CopyFrom(ps_pb2.ExpirySpec(**as_dict(spec.expiry)))
    if spec.tier is not None:
        msg.tier.CopyFrom(ps_pb2.DiskTierSpec(memory_rows=spec.tier.memory_rows))
    return msg


def spec_from_proto(msg: ps_pb2.VariableSpec) -> VariableSpec:
    """Rebuild and validate a spec from the wire; SpecError names what is wrong."""
    try:
        dtype = to_numpy_dtype(msg.dtype)
    except ValueError:
        raise SpecError(f"dtype of {msg.name!r} is missing or unknown ({msg.dtype})") from None
    try:
        initializer = _oneof_from_proto(msg.initializer, INITIALIZER_KINDS, "initializer",
                                        seed=msg.initializer.seed)
        optimizer = _oneof_from_proto(msg.optimizer, OPTIMIZER_KINDS, "optimizer")
        if msg.HasField("partitioner"):
            partitioner = _oneof_from_proto(msg.partitioner, PARTITIONER_KINDS, "partitioner")
        else:
            partitioner = MinSizePartitioner()
        return VariableSpec(name=msg.name, shape=tuple(msg.shape), dtype=dtype,
                            initializer=initializer, optimizer=optimizer, partitioner=partitioner,
                            hash_table=msg.hash_table, max_rows=msg.max_rows,
                            eviction=_by_value(_EVICTIONS, msg.eviction, "eviction"),
                            aggregation=_by_value(_AGGREGATIONS, msg.aggregation, "aggregation"),
                            admission=_admission(msg.admission) if msg.HasField("admission") else None,
                            expiry=(Expiry(steps=msg.expiry.steps, seconds=msg.expiry.seconds)
                                    if msg.HasField("expiry") else None),
                            tier=DiskTier(memory_rows=msg.tier.memory_rows) if msg.HasField("tier") else None)
    except SpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise SpecError(f"invalid spec for {msg.name!r}: {exc}") from exc


def _admission(msg: ps_pb2.AdmissionSpec) -> Admission:
    """An admission spec from the wire, where a field left at 0 means the dataclass's default."""
    given = {"min_count": msg.min_count, "probability": msg.probability, "counters": msg.counters}
    return Admission(**{key: value for key, value in given.items() if value}, zeros=msg.zeros)


def _oneof_to_proto(obj: object, kinds: dict[type, str], message) -> None:
    try:
        field_name = kinds[type(obj)]
    except KeyError:
        raise SpecError(f"unsupported {type(message).__name__} value {obj!r}") from None
    sub = getattr(message, field_name)
    sub.CopyFrom(type(sub)(**{key: value for key, value in as_dict(obj).items() if key != "seed"}))


def _oneof_from_proto(message, kinds: dict[type, str], what: str, **extra):
    which = message.WhichOneof("kind")
    for cls, field_name in kinds.items():
        if field_name == which:
            sub = getattr(message, field_name)
            names = {f.name for f in fields(cls)}
            values = {name: getattr(sub, name) for name in names if name not in extra}
            return cls(**values, **{k: v for k, v in extra.items() if k in names})
    raise SpecError(f"{what} is missing or of an unknown kind")


def _by_value(table: dict[str, int], value: int, what: str) -> str:
    for name, number in table.items():
        if number == value:
            return name
    raise SpecError(f"unknown {what} {value} (this version knows {', '.join(map(repr, table))}): "
                    "client and server may be of different versions")
