from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    FLOAT32: _ClassVar[DataType]
    FLOAT64: _ClassVar[DataType]
    FLOAT16: _ClassVar[DataType]
    BFLOAT16: _ClassVar[DataType]
    INT8: _ClassVar[DataType]
    INT16: _ClassVar[DataType]
    INT32: _ClassVar[DataType]
    INT64: _ClassVar[DataType]
    UINT8: _ClassVar[DataType]
    UINT16: _ClassVar[DataType]
    UINT32: _ClassVar[DataType]
    UINT64: _ClassVar[DataType]
    BOOL: _ClassVar[DataType]

class Eviction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVICTION_NONE: _ClassVar[Eviction]
    EVICTION_LRU: _ClassVar[Eviction]

class Aggregation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGGREGATION_MEAN: _ClassVar[Aggregation]
    AGGREGATION_SUM: _ClassVar[Aggregation]
    AGGREGATION_ROW_MEAN: _ClassVar[Aggregation]

class RowLookup(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_LOOKUP_CREATE: _ClassVar[RowLookup]
    ROW_LOOKUP_READ_ONLY: _ClassVar[RowLookup]
    ROW_LOOKUP_READ_ONLY_ZEROS: _ClassVar[RowLookup]

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KIND_UNSPECIFIED: _ClassVar[PushKind]
    GRADIENT: _ClassVar[PushKind]
    ASSIGN: _ClassVar[PushKind]
DATA_TYPE_UNSPECIFIED: DataType
FLOAT32: DataType
FLOAT64: DataType
FLOAT16: DataType
BFLOAT16: DataType
INT8: DataType
INT16: DataType
INT32: DataType
INT64: DataType
UINT8: DataType
UINT16: DataType
UINT32: DataType
UINT64: DataType
BOOL: DataType
EVICTION_NONE: Eviction
EVICTION_LRU: Eviction
AGGREGATION_MEAN: Aggregation
AGGREGATION_SUM: Aggregation
AGGREGATION_ROW_MEAN: Aggregation
ROW_LOOKUP_CREATE: RowLookup
ROW_LOOKUP_READ_ONLY: RowLookup
ROW_LOOKUP_READ_ONLY_ZEROS: RowLookup
PUSH_KIND_UNSPECIFIED: PushKind
GRADIENT: PushKind
ASSIGN: PushKind

class ZerosInitializer(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConstantInitializer(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: float
    def __init__(self, value: _Optional[float] = ...) -> None: ...

class UniformInitializer(_message.Message):
    __slots__ = ("minval", "maxval")
    MINVAL_FIELD_NUMBER: _ClassVar[int]
    MAXVAL_FIELD_NUMBER: _ClassVar[int]
    minval: float
    maxval: float
    def __init__(self, minval: _Optional[float] = ..., maxval: _Optional[float] = ...) -> None: ...

class NormalInitializer(_message.Message):
    __slots__ = ("mean", "stddev")
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STDDEV_FIELD_NUMBER: _ClassVar[int]
    mean: float
    stddev: float
    def __init__(self, mean: _Optional[float] = ..., stddev: _Optional[float] = ...) -> None: ...

class GlorotUniformInitializer(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExplicitInitializer(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    def __init__(self, sha256: _Optional[bytes] = ...) -> None: ...

class InitializerSpec(_message.Message):
    __slots__ = ("zeros", "constant", "uniform", "normal", "glorot_uniform", "explicit", "seed")
    ZEROS_FIELD_NUMBER: _ClassVar[int]
    CONSTANT_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_FIELD_NUMBER: _ClassVar[int]
    NORMAL_FIELD_NUMBER: _ClassVar[int]
    GLOROT_UNIFORM_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    zeros: ZerosInitializer
    constant: ConstantInitializer
    uniform: UniformInitializer
    normal: NormalInitializer
    glorot_uniform: GlorotUniformInitializer
    explicit: ExplicitInitializer
    seed: int
    def __init__(self, zeros: _Optional[_Union[ZerosInitializer, _Mapping]] = ..., constant: _Optional[_Union[ConstantInitializer, _Mapping]] = ..., uniform: _Optional[_Union[UniformInitializer, _Mapping]] = ..., normal: _Optional[_Union[NormalInitializer, _Mapping]] = ..., glorot_uniform: _Optional[_Union[GlorotUniformInitializer, _Mapping]] = ..., explicit: _Optional[_Union[ExplicitInitializer, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class SGDConfig(_message.Message):
    __slots__ = ("learning_rate",)
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    def __init__(self, learning_rate: _Optional[float] = ...) -> None: ...

class MomentumConfig(_message.Message):
    __slots__ = ("learning_rate", "momentum", "nesterov")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    momentum: float
    nesterov: bool
    def __init__(self, learning_rate: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ...) -> None: ...

class AdagradConfig(_message.Message):
    __slots__ = ("learning_rate", "initial_accumulator_value", "epsilon")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    initial_accumulator_value: float
    epsilon: float
    def __init__(self, learning_rate: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class AdamConfig(_message.Message):
    __slots__ = ("learning_rate", "beta_1", "beta_2", "epsilon")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA_1_FIELD_NUMBER: _ClassVar[int]
    BETA_2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta_1: float
    beta_2: float
    epsilon: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta_1: _Optional[float] = ..., beta_2: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("sgd", "momentum", "adagrad", "adam")
    SGD_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    sgd: SGDConfig
    momentum: MomentumConfig
    adagrad: AdagradConfig
    adam: AdamConfig
    def __init__(self, sgd: _Optional[_Union[SGDConfig, _Mapping]] = ..., momentum: _Optional[_Union[MomentumConfig, _Mapping]] = ..., adagrad: _Optional[_Union[AdagradConfig, _Mapping]] = ..., adam: _Optional[_Union[AdamConfig, _Mapping]] = ...) -> None: ...

class MinSizePartitionerSpec(_message.Message):
    __slots__ = ("min_shard_bytes", "max_shards")
    MIN_SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARDS_FIELD_NUMBER: _ClassVar[int]
    min_shard_bytes: int
    max_shards: int
    def __init__(self, min_shard_bytes: _Optional[int] = ..., max_shards: _Optional[int] = ...) -> None: ...

class FixedShardsPartitionerSpec(_message.Message):
    __slots__ = ("num_shards",)
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    num_shards: int
    def __init__(self, num_shards: _Optional[int] = ...) -> None: ...

class MaxSizePartitionerSpec(_message.Message):
    __slots__ = ("max_shard_bytes", "max_shards")
    MAX_SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARDS_FIELD_NUMBER: _ClassVar[int]
    max_shard_bytes: int
    max_shards: int
    def __init__(self, max_shard_bytes: _Optional[int] = ..., max_shards: _Optional[int] = ...) -> None: ...

class PartitionerSpec(_message.Message):
    __slots__ = ("min_size", "fixed_shards", "max_size")
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIXED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    min_size: MinSizePartitionerSpec
    fixed_shards: FixedShardsPartitionerSpec
    max_size: MaxSizePartitionerSpec
    def __init__(self, min_size: _Optional[_Union[MinSizePartitionerSpec, _Mapping]] = ..., fixed_shards: _Optional[_Union[FixedShardsPartitionerSpec, _Mapping]] = ..., max_size: _Optional[_Union[MaxSizePartitionerSpec, _Mapping]] = ...) -> None: ...

class VariableSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "initializer", "optimizer", "partitioner", "hash_table", "max_rows", "eviction", "aggregation", "admission", "expiry", "tier")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PARTITIONER_FIELD_NUMBER: _ClassVar[int]
    HASH_TABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DataType
    initializer: InitializerSpec
    optimizer: OptimizerSpec
    partitioner: PartitionerSpec
    hash_table: bool
    max_rows: int
    eviction: Eviction
    aggregation: Aggregation
    admission: AdmissionSpec
    expiry: ExpirySpec
    tier: DiskTierSpec
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DataType, str]] = ..., initializer: _Optional[_Union[InitializerSpec, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., partitioner: _Optional[_Union[PartitionerSpec, _Mapping]] = ..., hash_table: _Optional[bool] = ..., max_rows: _Optional[int] = ..., eviction: _Optional[_Union[Eviction, str]] = ..., aggregation: _Optional[_Union[Aggregation, str]] = ..., admission: _Optional[_Union[AdmissionSpec, _Mapping]] = ..., expiry: _Optional[_Union[ExpirySpec, _Mapping]] = ..., tier: _Optional[_Union[DiskTierSpec, _Mapping]] = ...) -> None: ...

class DiskTierSpec(_message.Message):
    __slots__ = ("memory_rows",)
    MEMORY_ROWS_FIELD_NUMBER: _ClassVar[int]
    memory_rows: int
    def __init__(self, memory_rows: _Optional[int] = ...) -> None: ...

class AdmissionSpec(_message.Message):
    __slots__ = ("min_count", "probability", "counters", "zeros")
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    ZEROS_FIELD_NUMBER: _ClassVar[int]
    min_count: int
    probability: float
    counters: int
    zeros: bool
    def __init__(self, min_count: _Optional[int] = ..., probability: _Optional[float] = ..., counters: _Optional[int] = ..., zeros: _Optional[bool] = ...) -> None: ...

class ExpirySpec(_message.Message):
    __slots__ = ("steps", "seconds")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    seconds: float
    def __init__(self, steps: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class VariableInfo(_message.Message):
    __slots__ = ("spec", "row_start", "row_end", "version", "initialized", "optimizer_steps", "num_rows", "evicted_rows", "expired_rows", "admitted_rows", "unadmitted_reads", "dropped_gradient_rows", "rows_on_disk", "disk_bytes", "memory_hits", "cold_reads")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_ROWS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    UNADMITTED_READS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GRADIENT_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HITS_FIELD_NUMBER: _ClassVar[int]
    COLD_READS_FIELD_NUMBER: _ClassVar[int]
    spec: VariableSpec
    row_start: int
    row_end: int
    version: int
    initialized: bool
    optimizer_steps: int
    num_rows: int
    evicted_rows: int
    expired_rows: int
    admitted_rows: int
    unadmitted_reads: int
    dropped_gradient_rows: int
    rows_on_disk: int
    disk_bytes: int
    memory_hits: int
    cold_reads: int
    def __init__(self, spec: _Optional[_Union[VariableSpec, _Mapping]] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., version: _Optional[int] = ..., initialized: _Optional[bool] = ..., optimizer_steps: _Optional[int] = ..., num_rows: _Optional[int] = ..., evicted_rows: _Optional[int] = ..., expired_rows: _Optional[int] = ..., admitted_rows: _Optional[int] = ..., unadmitted_reads: _Optional[int] = ..., dropped_gradient_rows: _Optional[int] = ..., rows_on_disk: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., memory_hits: _Optional[int] = ..., cold_reads: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("any_replica",)
    ANY_REPLICA_FIELD_NUMBER: _ClassVar[int]
    any_replica: bool
    def __init__(self, any_replica: _Optional[bool] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "server_id", "server_version", "variables", "chunk_bytes_limit", "workers", "worker_lease_seconds", "last_checkpoint", "restored_from", "consistency", "stored_bytes", "memory_limit_bytes", "replication", "lane_port")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    server_id: str
    server_version: str
    variables: _containers.RepeatedCompositeFieldContainer[VariableInfo]
    chunk_bytes_limit: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    worker_lease_seconds: float
    last_checkpoint: CheckpointInfo
    restored_from: CheckpointInfo
    consistency: ConsistencyInfo
    stored_bytes: int
    memory_limit_bytes: int
    replication: ReplicaStatus
    lane_port: int
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., server_id: _Optional[str] = ..., server_version: _Optional[str] = ..., variables: _Optional[_Iterable[_Union[VariableInfo, _Mapping]]] = ..., chunk_bytes_limit: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., worker_lease_seconds: _Optional[float] = ..., last_checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., restored_from: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., consistency: _Optional[_Union[ConsistencyInfo, _Mapping]] = ..., stored_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., replication: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., lane_port: _Optional[int] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_index", "replicas", "role", "epoch", "primary_address", "applied_sequence", "backups", "etcd_reachable")
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    ETCD_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    replica_index: int
    replicas: int
    role: str
    epoch: int
    primary_address: str
    applied_sequence: int
    backups: _containers.RepeatedCompositeFieldContainer[BackupStatus]
    etcd_reachable: bool
    def __init__(self, replica_index: _Optional[int] = ..., replicas: _Optional[int] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., primary_address: _Optional[str] = ..., applied_sequence: _Optional[int] = ..., backups: _Optional[_Iterable[_Union[BackupStatus, _Mapping]]] = ..., etcd_reachable: _Optional[bool] = ...) -> None: ...

class BackupStatus(_message.Message):
    __slots__ = ("replica_index", "address", "in_sync", "acknowledged_sequence", "lag_records", "lag_bytes", "lag_seconds")
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    replica_index: int
    address: str
    in_sync: bool
    acknowledged_sequence: int
    lag_records: int
    lag_bytes: int
    lag_seconds: float
    def __init__(self, replica_index: _Optional[int] = ..., address: _Optional[str] = ..., in_sync: _Optional[bool] = ..., acknowledged_sequence: _Optional[int] = ..., lag_records: _Optional[int] = ..., lag_bytes: _Optional[int] = ..., lag_seconds: _Optional[float] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwitchoverRequest(_message.Message):
    __slots__ = ("to_replica", "timeout_seconds")
    TO_REPLICA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    to_replica: int
    timeout_seconds: float
    def __init__(self, to_replica: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class SwitchoverResponse(_message.Message):
    __slots__ = ("replica_index", "address", "seconds")
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    replica_index: int
    address: str
    seconds: float
    def __init__(self, replica_index: _Optional[int] = ..., address: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "incarnation", "live", "seconds_since_seen", "step", "registered_unix", "pushes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_SEEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    live: bool
    seconds_since_seen: float
    step: int
    registered_unix: float
    pushes: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., live: _Optional[bool] = ..., seconds_since_seen: _Optional[float] = ..., step: _Optional[int] = ..., registered_unix: _Optional[float] = ..., pushes: _Optional[int] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("checkpoint_id", "path", "created_unix", "write_seconds", "pause_seconds", "bytes", "num_shards")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    path: str
    created_unix: float
    write_seconds: float
    pause_seconds: float
    bytes: int
    num_shards: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., path: _Optional[str] = ..., created_unix: _Optional[float] = ..., write_seconds: _Optional[float] = ..., pause_seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "step", "leaving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    step: int
    leaving: bool
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., step: _Optional[int] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds", "server_id", "cluster_step", "consistency")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_STEP_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    server_id: str
    cluster_step: int
    consistency: str
    def __init__(self, lease_seconds: _Optional[float] = ..., server_id: _Optional[str] = ..., cluster_step: _Optional[int] = ..., consistency: _Optional[str] = ...) -> None: ...

class ConsistencyInfo(_message.Message):
    __slots__ = ("mode", "staleness", "backup_workers", "step", "pulls", "pulls_blocked", "blocked_seconds", "max_staleness_admitted", "dropped_gradients", "steps_applied")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PULLS_BLOCKED_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    mode: str
    staleness: int
    backup_workers: int
    step: int
    pulls: int
    pulls_blocked: int
    blocked_seconds: float
    max_staleness_admitted: int
    dropped_gradients: int
    steps_applied: int
    def __init__(self, mode: _Optional[str] = ..., staleness: _Optional[int] = ..., backup_workers: _Optional[int] = ..., step: _Optional[int] = ..., pulls: _Optional[int] = ..., pulls_blocked: _Optional[int] = ..., blocked_seconds: _Optional[float] = ..., max_staleness_admitted: _Optional[int] = ..., dropped_gradients: _Optional[int] = ..., steps_applied: _Optional[int] = ...) -> None: ...

class CreateVariableRequest(_message.Message):
    __slots__ = ("spec", "shard_index", "num_shards", "validate_only", "booking", "cancel_booking")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    BOOKING_FIELD_NUMBER: _ClassVar[int]
    CANCEL_BOOKING_FIELD_NUMBER: _ClassVar[int]
    spec: VariableSpec
    shard_index: int
    num_shards: int
    validate_only: bool
    booking: str
    cancel_booking: bool
    def __init__(self, spec: _Optional[_Union[VariableSpec, _Mapping]] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., validate_only: _Optional[bool] = ..., booking: _Optional[str] = ..., cancel_booking: _Optional[bool] = ...) -> None: ...

class CreateVariableResponse(_message.Message):
    __slots__ = ("variable", "created")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    variable: VariableInfo
    created: bool
    def __init__(self, variable: _Optional[_Union[VariableInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class PullItem(_message.Message):
    __slots__ = ("variable", "offset", "count", "row_ids")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ROW_IDS_FIELD_NUMBER: _ClassVar[int]
    variable: str
    offset: int
    count: int
    row_ids: bytes
    def __init__(self, variable: _Optional[str] = ..., offset: _Optional[int] = ..., count: _Optional[int] = ..., row_ids: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("shard_index", "num_shards", "items", "wire_dtype", "chunk_bytes", "worker_id", "incarnation", "step", "lookup")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    items: _containers.RepeatedCompositeFieldContainer[PullItem]
    wire_dtype: DataType
    chunk_bytes: int
    worker_id: str
    incarnation: str
    step: int
    lookup: RowLookup
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., items: _Optional[_Iterable[_Union[PullItem, _Mapping]]] = ..., wire_dtype: _Optional[_Union[DataType, str]] = ..., chunk_bytes: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., step: _Optional[int] = ..., lookup: _Optional[_Union[RowLookup, str]] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("variable", "offset", "count", "dtype", "version", "part_elements")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PART_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    variable: str
    offset: int
    count: int
    dtype: DataType
    version: int
    part_elements: int
    def __init__(self, variable: _Optional[str] = ..., offset: _Optional[int] = ..., count: _Optional[int] = ..., dtype: _Optional[_Union[DataType, str]] = ..., version: _Optional[int] = ..., part_elements: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("header", "data", "pad")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    data: bytes
    pad: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., pad: _Optional[bytes] = ...) -> None: ...

class ChunkBatch(_message.Message):
    __slots__ = ("headers", "data")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    headers: ChunkHeaders
    data: bytes
    def __init__(self, headers: _Optional[_Union[ChunkHeaders, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChunkHeaders(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ChunkHeader]
    def __init__(self, items: _Optional[_Iterable[_Union[ChunkHeader, _Mapping]]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("chunks", "batches")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    batches: _containers.RepeatedCompositeFieldContainer[ChunkBatch]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., batches: _Optional[_Iterable[_Union[ChunkBatch, _Mapping]]] = ...) -> None: ...

class PushItem(_message.Message):
    __slots__ = ("variable", "elements", "wire_dtype", "base_version", "row_ids")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROW_IDS_FIELD_NUMBER: _ClassVar[int]
    variable: str
    elements: int
    wire_dtype: DataType
    base_version: int
    row_ids: bytes
    def __init__(self, variable: _Optional[str] = ..., elements: _Optional[int] = ..., wire_dtype: _Optional[_Union[DataType, str]] = ..., base_version: _Optional[int] = ..., row_ids: _Optional[bytes] = ...) -> None: ...

class PushBegin(_message.Message):
    __slots__ = ("worker_id", "incarnation", "sequence", "shard_index", "num_shards", "kind", "items", "step", "pull_after", "continued")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PULL_AFTER_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    sequence: int
    shard_index: int
    num_shards: int
    kind: PushKind
    items: _containers.RepeatedCompositeFieldContainer[PushItem]
    step: int
    pull_after: PullRequest
    continued: bool
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., sequence: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., kind: _Optional[_Union[PushKind, str]] = ..., items: _Optional[_Iterable[_Union[PushItem, _Mapping]]] = ..., step: _Optional[int] = ..., pull_after: _Optional[_Union[PullRequest, _Mapping]] = ..., continued: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("begin", "chunks", "batches")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    begin: PushBegin
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    batches: _containers.RepeatedCompositeFieldContainer[ChunkBatch]
    def __init__(self, begin: _Optional[_Union[PushBegin, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., batches: _Optional[_Iterable[_Union[ChunkBatch, _Mapping]]] = ...) -> None: ...

class VariableVersion(_message.Message):
    __slots__ = ("variable", "version")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    variable: str
    version: int
    def __init__(self, variable: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("versions", "duplicate", "elements_applied", "dropped", "cluster_step", "pulled")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_STEP_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VariableVersion]
    duplicate: bool
    elements_applied: int
    dropped: bool
    cluster_step: int
    pulled: PullResponse
    def __init__(self, versions: _Optional[_Iterable[_Union[VariableVersion, _Mapping]]] = ..., duplicate: _Optional[bool] = ..., elements_applied: _Optional[int] = ..., dropped: _Optional[bool] = ..., cluster_step: _Optional[int] = ..., pulled: _Optional[_Union[PullResponse, _Mapping]] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("id", "pull", "push")
    ID_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    id: int
    pull: PullRequest
    push: PushRequest
    def __init__(self, id: _Optional[int] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., push: _Optional[_Union[PushRequest, _Mapping]] = ...) -> None: ...

class ExchangeError(_message.Message):
    __slots__ = ("code", "reason", "message", "primary")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    primary: str
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., primary: _Optional[str] = ...) -> None: ...

class LaneHello(_message.Message):
    __slots__ = ("token", "incarnation")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    token: str
    incarnation: str
    def __init__(self, token: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("id", "pull", "push", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    pull: PullResponse
    push: PushResponse
    error: ExchangeError
    def __init__(self, id: _Optional[int] = ..., pull: _Optional[_Union[PullResponse, _Mapping]] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ..., error: _Optional[_Union[ExchangeError, _Mapping]] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("start", "applied", "probe", "epoch")
    START_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    start: FollowStart
    applied: int
    probe: bool
    epoch: int
    def __init__(self, start: _Optional[_Union[FollowStart, _Mapping]] = ..., applied: _Optional[int] = ..., probe: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class FollowStart(_message.Message):
    __slots__ = ("shard_index", "num_shards", "replica_index", "incarnation", "address", "epoch", "token")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    replica_index: int
    incarnation: int
    address: str
    epoch: int
    token: str
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., replica_index: _Optional[int] = ..., incarnation: _Optional[int] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class ReplicationMessage(_message.Message):
    __slots__ = ("epoch", "snapshot_file", "snapshot_done", "record", "ping", "refused", "open_push", "take_over")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FILE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    OPEN_PUSH_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    snapshot_file: SnapshotFile
    snapshot_done: int
    record: ReplicationRecord
    ping: int
    refused: str
    open_push: OpenPush
    take_over: bool
    def __init__(self, epoch: _Optional[int] = ..., snapshot_file: _Optional[_Union[SnapshotFile, _Mapping]] = ..., snapshot_done: _Optional[int] = ..., record: _Optional[_Union[ReplicationRecord, _Mapping]] = ..., ping: _Optional[int] = ..., refused: _Optional[str] = ..., open_push: _Optional[_Union[OpenPush, _Mapping]] = ..., take_over: _Optional[bool] = ...) -> None: ...

class OpenPush(_message.Message):
    __slots__ = ("stream", "begin")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    stream: int
    begin: PushBegin
    def __init__(self, stream: _Optional[int] = ..., begin: _Optional[_Union[PushBegin, _Mapping]] = ...) -> None: ...

class SnapshotFile(_message.Message):
    __slots__ = ("path", "offset", "last", "data")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    last: bool
    data: bytes
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., last: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicationRecord(_message.Message):
    __slots__ = ("sequence", "push", "push_end", "rows_read", "created", "consistency", "finish", "checkpoint", "sync_decision", "sync_step", "rows_expired")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PUSH_END_FIELD_NUMBER: _ClassVar[int]
    ROWS_READ_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SYNC_DECISION_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    ROWS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    push: PushApplied
    push_end: PushEnded
    rows_read: TableRowsRead
    created: VariableSpec
    consistency: str
    finish: bool
    checkpoint: bool
    sync_decision: SyncDecision
    sync_step: SyncStep
    rows_expired: RowsExpired
    def __init__(self, sequence: _Optional[int] = ..., push: _Optional[_Union[PushApplied, _Mapping]] = ..., push_end: _Optional[_Union[PushEnded, _Mapping]] = ..., rows_read: _Optional[_Union[TableRowsRead, _Mapping]] = ..., created: _Optional[_Union[VariableSpec, _Mapping]] = ..., consistency: _Optional[str] = ..., finish: _Optional[bool] = ..., checkpoint: _Optional[bool] = ..., sync_decision: _Optional[_Union[SyncDecision, _Mapping]] = ..., sync_step: _Optional[_Union[SyncStep, _Mapping]] = ..., rows_expired: _Optional[_Union[RowsExpired, _Mapping]] = ...) -> None: ...

class RowsExpired(_message.Message):
    __slots__ = ("time", "tables")
    TIME_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    time: float
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    def __init__(self, time: _Optional[float] = ..., tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ...) -> None: ...

class SyncDecision(_message.Message):
    __slots__ = ("stream", "step", "accumulate", "tables")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    stream: int
    step: int
    accumulate: bool
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    def __init__(self, stream: _Optional[int] = ..., step: _Optional[int] = ..., accumulate: _Optional[bool] = ..., tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ...) -> None: ...

class SyncStep(_message.Message):
    __slots__ = ("step", "applied")
    STEP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    step: int
    applied: bool
    def __init__(self, step: _Optional[int] = ..., applied: _Optional[bool] = ...) -> None: ...

class PushApplied(_message.Message):
    __slots__ = ("stream", "begin", "message", "completed")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    stream: int
    begin: PushBegin
    message: bytes
    completed: bool
    def __init__(self, stream: _Optional[int] = ..., begin: _Optional[_Union[PushBegin, _Mapping]] = ..., message: _Optional[bytes] = ..., completed: _Optional[bool] = ...) -> None: ...

class PushEnded(_message.Message):
    __slots__ = ("stream", "begin", "completed")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    stream: int
    begin: PushBegin
    completed: bool
    def __init__(self, stream: _Optional[int] = ..., begin: _Optional[_Union[PushBegin, _Mapping]] = ..., completed: _Optional[bool] = ...) -> None: ...

class TableRowsRead(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("variable", "ids")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    variable: str
    ids: bytes
    def __init__(self, variable: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("variable", "shard_index", "num_shards", "chunk_bytes")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    variable: str
    shard_index: int
    num_shards: int
    chunk_bytes: int
    def __init__(self, variable: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ExportRowsResponse(_message.Message):
    __slots__ = ("ids", "rows", "dtype", "row_elements", "version")
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROW_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    rows: bytes
    dtype: DataType
    row_elements: int
    version: int
    def __init__(self, ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., dtype: _Optional[_Union[DataType, str]] = ..., row_elements: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...
