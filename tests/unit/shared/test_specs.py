"""VariableSpec: validation, wire round trips, seeds, differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
from google.protobuf import json_format

from wehub_ps.dtypes import BFLOAT16
from wehub_ps.placement import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    stable_hash64,
)
from wehub_ps.specs import (
    MAX_NAME_LENGTH,
    MAX_RANK,
    SGD,
    Adagrad,
    Adam,
    Constant,
    Explicit,
    GlorotUniform,
    Momentum,
    Normal,
    SpecError,
    Uniform,
    VariableSpec,
    Zeros,
    initializer_from_name,
    with_seed,
)
from wehub_ps.specs_proto import spec_from_proto, spec_to_proto
from wehub_ps.v1 import ps_pb2

# ---- validation ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    (dict(name=""), ["name", "''"]),
    (dict(name=None), ["name", "None"]),
    (dict(name=3), ["name", "3"]),
    (dict(name="has space"), ["name", "'has space'"]),
    (dict(name="semi;colon"), ["name", "'semi;colon'"]),
    (dict(name="ünicode"), ["name", "'ünicode'"]),
    (dict(name="x" * (MAX_NAME_LENGTH + 1)), ["name", str(MAX_NAME_LENGTH)]),
    (dict(shape=(3, -1)), ["shape", "(3, -1)"]),
    (dict(shape=[3, 4]), ["shape", "[3, 4]"]),
    (dict(shape=(3.0,)), ["shape", "(3.0,)"]),
    (dict(shape=(True,)), ["shape", "(True,)"]),
    (dict(shape=(1,) * (MAX_RANK + 1)), ["shape", "rank", str(MAX_RANK + 1)]),
    (dict(shape=(2**40, 2**40)), ["shape", "too many elements"]),
    (dict(dtype="int32"), ["dtype", "int32"]),
    (dict(dtype=np.int64), ["dtype", "int64"]),
    (dict(dtype=np.uint8), ["dtype", "uint8"]),
    (dict(dtype="bfloat16"), ["dtype", "bfloat16"]),
    (dict(dtype=np.complex64), ["dtype", "complex64"]),
    (dict(dtype="no-such-dtype"), ["dtype", "no-such-dtype"]),
    (dict(optimizer=SGD), ["optimizer", "type"]),
    (dict(optimizer="adam"), ["optimizer", "str"]),
    (dict(initializer="zeros"), ["initializer", "str"]),
    (dict(partitioner=None), ["partitioner", "NoneType"]),
    (dict(aggregation="avg"), ["aggregation", "'avg'", "'row_mean'"]),
    (dict(aggregation="MEAN"), ["aggregation", "'MEAN'"]),
])
def test_variable_spec_validation(kwargs, words):
    args = dict(name="ok/name", shape=(4, 5), dtype="float32")
    args.update(kwargs)
    with pytest.raises(SpecError) as info:
        VariableSpec(**args)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from {info.value}"


@pytest.mark.parametrize("make, words", [
    (lambda: SGD(learning_rate=0), ["SGD.learning_rate", "0"]),
    (lambda: SGD(learning_rate=-0.1), ["SGD.learning_rate", "-0.1"]),
    (lambda: SGD(learning_rate=math.nan), ["SGD.learning_rate", "nan"]),
    (lambda: SGD(learning_rate=math.inf), ["SGD.learning_rate", "inf"]),
    (lambda: SGD(learning_rate="0.1"), ["SGD.learning_rate", "'0.1'"]),
    (lambda: SGD(learning_rate=True), ["SGD.learning_rate", "True"]),
    (lambda: Momentum(learning_rate=0.0), ["Momentum.learning_rate", "0.0"]),
    (lambda: Momentum(momentum=-0.5), ["Momentum.momentum", "-0.5"]),
    (lambda: Momentum(nesterov=1), ["Momentum.nesterov", "1"]),
    (lambda: Adagrad(learning_rate=-1.0), ["Adagrad.learning_rate", "-1.0"]),
    (lambda: Adagrad(initial_accumulator_value=-0.1), ["Adagrad.initial_accumulator_value", "-0.1"]),
    (lambda: Adagrad(epsilon=0.0), ["Adagrad.epsilon", "0.0"]),
    (lambda: Adam(learning_rate=0), ["Adam.learning_rate", "0"]),
    (lambda: Adam(beta_1=1.0), ["Adam.beta_1", "1.0"]),
    (lambda: Adam(beta_1=-0.1), ["Adam.beta_1", "-0.1"]),
    (lambda: Adam(beta_2=1.5), ["Adam.beta_2", "1.5"]),
    (lambda: Adam(beta_2=-1e-9), ["Adam.beta_2", "-1e-09"]),
    (lambda: Adam(epsilon=-1e-7), ["Adam.epsilon", "-1e-07"]),
    (lambda: Constant(value=math.inf), ["Constant.value", "inf"]),
    (lambda: Uniform(minval=1.0, maxval=0.0), ["Uniform.maxval", "minval"]),
    (lambda: Uniform(minval=math.nan), ["Uniform.minval", "nan"]),
    (lambda: Uniform(seed=-1), ["Uniform.seed", "-1"]),
    (lambda: Uniform(seed=2**64), ["Uniform.seed", str(2**64)]),
    (lambda: Normal(stddev=-1.0), ["Normal.stddev", "-1.0"]),
    (lambda: Normal(mean=math.inf), ["Normal.mean", "inf"]),
    (lambda: Normal(seed=1.5), ["Normal.seed", "1.5"]),
    (lambda: GlorotUniform(seed=True), ["GlorotUniform.seed", "True"]),
    (lambda: Explicit(b"short"), ["Explicit.sha256", "32"]),
    (lambda: Explicit("0" * 32), ["Explicit.sha256"]),
])
def test_config_validation(make, words):
    with pytest.raises(SpecError) as info:
        make()
    for word in words:
        assert word in str(info.value), f"{word!r} missing from {info.value}"


@pytest.mark.parametrize("make", [
    lambda: Momentum(momentum=0.0),
    lambda: Adam(beta_1=0.0, beta_2=0.0),
    lambda: Adagrad(initial_accumulator_value=0.0),
    lambda: Normal(stddev=0.0),
    lambda: Uniform(minval=1.0, maxval=1.0),
    lambda: Constant(-5),
    lambda: Uniform(seed=0),
    lambda: Uniform(seed=2**64 - 1),
    lambda: SGD(learning_rate=3),
])
def test_boundary_values_are_accepted(make):
    make()


def test_valid_spec_normalises_its_fields():
    spec = VariableSpec("a-b_c.d:0/e", (np.int64(2), 3), ">f4")
    assert spec.shape == (2, 3)
    assert all(type(d) is int for d in spec.shape)
    assert spec.dtype == np.dtype("<f4") and spec.dtype.str == "<f4"
    assert spec.num_elements == 6 and spec.nbytes == 24
    assert isinstance(spec.initializer, Zeros)
    assert isinstance(spec.optimizer, SGD)
    assert isinstance(spec.partitioner, MinSizePartitioner)
    assert VariableSpec("n", (), "float16").num_elements == 1
    assert VariableSpec("n", (0, 5), np.float64).nbytes == 0
    VariableSpec("x" * MAX_NAME_LENGTH, (1,) * MAX_RANK, "float32")


# ---- seeds -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Uniform, Normal, GlorotUniform])
def test_seed_is_filled_from_the_name(cls):
    spec = VariableSpec("dense/kernel", (3, 4), "float32", initializer=cls())
    assert spec.initializer.seed == stable_hash64("dense/kernel")
    assert spec.initializer == with_seed(cls(), "dense/kernel")
    # Deterministic, and different for another name.
    again = VariableSpec("dense/kernel", (3, 4), "float32", initializer=cls())
    other = VariableSpec("dense/bias", (3, 4), "float32", initializer=cls())
    assert spec == again
    assert other.initializer.seed != spec.initializer.seed
    # An explicit seed is kept.
    seeded = VariableSpec("dense/kernel", (3, 4), "float32", initializer=cls(seed=5))
    assert seeded.initializer.seed == 5
    assert seeded != spec


def test_with_seed_keeps_other_parameters():
    got = with_seed(Uniform(-2.0, 3.0), "v")
    assert got == Uniform(-2.0, 3.0, seed=stable_hash64("v"))
    assert with_seed(Zeros(), "v") == Zeros()
    assert with_seed(Constant(2.0), "v") == Constant(2.0)


def test_initializer_from_name():
    assert initializer_from_name("zeros") == Zeros()
    assert initializer_from_name("glorot_uniform") == GlorotUniform()
    with pytest.raises(SpecError, match="'bogus'"):
        initializer_from_name("bogus")


# ---- wire round trip ---------------------------------------------------------------------

INITIALIZERS = [Zeros(), Constant(0.0), Constant(-2.5), Uniform(-1.0, 2.0), Uniform(seed=0),
                Normal(1.0, 0.25, seed=2**64 - 1), GlorotUniform(), GlorotUniform(seed=77),
                Explicit(bytes(range(32)))]
OPTIMIZERS = [SGD(), SGD(learning_rate=0.5), Momentum(), Momentum(0.1, 0.0, True),
              Adagrad(), Adagrad(0.2, 0.0, 1e-3), Adam(), Adam(0.1, 0.0, 0.5, 1e-4)]
PARTITIONERS = [MinSizePartitioner(), MinSizePartitioner(1024, 3), FixedShardsPartitioner(7),
                MaxSizePartitioner(4096), MaxSizePartitioner(1, 2)]


@pytest.mark.parametrize("initializer", INITIALIZERS, ids=repr)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("partitioner", PARTITIONERS, ids=repr)
def test_proto_round_trip(initializer, optimizer, partitioner):
    spec = VariableSpec("layer/w", (10, 0, 3), "float64", initializer=initializer,
                        optimizer=optimizer, partitioner=partitioner)
    msg = spec_to_proto(spec)
    # Survives real serialisation, not just the in-memory message.
    wire = ps_pb2.VariableSpec.FromString(msg.SerializeToString())
    back = spec_from_proto(wire)
    assert back == spec
    assert back.differences(spec) == []
    assert type(back.initializer) is type(initializer)
    assert type(back.optimizer) is type(optimizer)
    assert type(back.partitioner) is type(partitioner)
    assert wire.initializer.WhichOneof("kind") is not None
    assert wire.optimizer.WhichOneof("kind") is not None
    assert wire.partitioner.WhichOneof("kind") is not None


@pytest.mark.parametrize("dtype, wire", [("float16", ps_pb2.FLOAT16), ("float32", ps_pb2.FLOAT32),
                                         ("float64", ps_pb2.FLOAT64)])
def test_proto_dtype_and_shape(dtype, wire):
    spec = VariableSpec("v", (), dtype)
    msg = spec_to_proto(spec)
    assert msg.dtype == wire
    assert list(msg.shape) == []
    assert msg.name == "v"
    assert spec_from_proto(msg) == spec


def test_to_proto_carries_the_seed():
    spec = VariableSpec("v", (2,), "float32", initializer=Normal(seed=123))
    assert spec_to_proto(spec).initializer.seed == 123
    assert spec_to_proto(spec).initializer.normal.stddev == 0.05


def test_from_proto_without_partitioner_uses_the_default():
    msg = spec_to_proto(VariableSpec("v", (2,), "float32"))
    msg.ClearField("partitioner")
    assert spec_from_proto(msg).partitioner == MinSizePartitioner()


@pytest.mark.parametrize("mutate, words", [
    (lambda m: setattr(m, "dtype", ps_pb2.DATA_TYPE_UNSPECIFIED), ["dtype"]),
    (lambda m: setattr(m, "dtype", 99), ["dtype", "99"]),
    (lambda m: setattr(m, "dtype", ps_pb2.INT32), ["dtype", "int32"]),
    (lambda m: m.ClearField("optimizer"), ["optimizer"]),
    (lambda m: m.ClearField("initializer"), ["initializer"]),
    (lambda m: setattr(m, "name", "bad name"), ["name", "'bad name'"]),
    (lambda m: setattr(m.optimizer.sgd, "learning_rate", -1.0), ["learning_rate", "-1.0"]),
    (lambda m: m.partitioner.fixed_shards.SetInParent(), ["num_shards", "0"]),
    (lambda m: setattr(m.partitioner.min_size, "min_shard_bytes", 0), ["min_shard_bytes", "0"]),
    (lambda m: setattr(m, "aggregation", 7), ["aggregation", "7"]),
])
def test_from_proto_refuses_invalid_messages(mutate, words):
    msg = spec_to_proto(VariableSpec("v", (2, 3), "float32"))
    mutate(msg)
    with pytest.raises(SpecError) as info:
        spec_from_proto(msg)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from {info.value}"


@pytest.mark.parametrize("aggregation", ["mean", "sum", "row_mean"])
@pytest.mark.parametrize("hash_table", [False, True])
def test_aggregation_travels_in_the_proto_and_its_json(aggregation, hash_table):
    """The wire message and the checkpoint/spec-log JSON (ps_server.durability.format) keep it."""
    spec = VariableSpec("v", (3,), "float32", hash_table=hash_table, aggregation=aggregation)
    wire = ps_pb2.VariableSpec.FromString(spec_to_proto(spec).SerializeToString())
    assert spec_from_proto(wire) == spec
    as_json = json_format.MessageToDict(spec_to_proto(spec), preserving_proto_field_name=True)
    assert spec_from_proto(json_format.ParseDict(as_json, ps_pb2.VariableSpec())).aggregation == aggregation


# ---- differences -------------------------------------------------------------------------


def test_differences_name_the_fields():
    base = VariableSpec("v", (10, 4), "float32")
    assert base.differences(VariableSpec("v", (10, 4), np.float32)) == []

    diffs = base.differences(VariableSpec("v", (20, 4), "float32"))
    assert len(diffs) == 1 and diffs[0].startswith("shape") and "(10, 4)" in diffs[0] and "(20, 4)" in diffs[0]

    diffs = base.differences(VariableSpec("v", (10, 4), "float64"))
    assert diffs == ["dtype 'float32' != 'float64'"]

    diffs = base.differences(VariableSpec("v", (10, 4), "float32", optimizer=Adam()))
    assert len(diffs) == 1 and diffs[0].startswith("optimizer") and "Adam" in diffs[0]

    diffs = base.differences(VariableSpec("v", (10, 4), "float32", initializer=Constant(1.0),
                                          partitioner=FixedShardsPartitioner(2)))
    assert [d.split()[0] for d in diffs] == ["initializer", "partitioner"]

    diffs = base.differences(VariableSpec("v", (10, 4), "float32", aggregation="row_mean"))
    assert diffs == ["aggregation 'mean' != 'row_mean'"]

    other = VariableSpec("v", (10, 4), "float32", initializer=Uniform(seed=1))
    assert [d.split()[0] for d in other.differences(
        VariableSpec("v", (10, 4), "float32", initializer=Uniform(seed=2)))] == ["initializer"]


def test_bfloat16_is_not_a_variable_dtype_but_parses():
    with pytest.raises(SpecError, match="bfloat16"):
        VariableSpec("v", (2,), BFLOAT16)
