"""The library workers import to train through wehub-ps.

    from worker_client import PSClient, SGD
    with PSClient(["127.0.0.1:7001"], worker_id="worker-0") as client:
        client.create_variable("w", shape=(10,), optimizer=SGD(learning_rate=0.1))
        with client.step() as step:
            step.push({"w": compute_gradient(step.params["w"])})
"""

from wehub_ps.placement import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
from wehub_ps.specs import (
    SGD,
    Adagrad,
    Adam,
    Admission,
    Constant,
    DiskTier,
    Expiry,
    GlorotUniform,
    Momentum,
    Normal,
    SpecError,
    Uniform,
    Zeros,
)
from worker_client.client import PSClient, ShardInfo, Variable
from worker_client.errors import (
    AuthenticationError,
    ClusterMismatchError,
    DTypeMismatchError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotInitializedError,
    NotPrimaryError,
    OverlapRefusedError,
    PSError,
    PSInternalError,
    PSTLSError,
    PSUnavailableError,
    PushWrittenOffError,
    ResourceExhaustedError,
    ServerBusyError,
    ShapeMismatchError,
    TLSProblem,
    VariableConflictError,
    VariableNotFoundError,
)
from worker_client.background import PushHandle
from worker_client.overlap import OverlappedStep
from worker_client.replicas import ReplicaGroup, ReplicaStep
from worker_client.step import Step

__all__ = [
    "PSClient", "Variable", "ShardInfo", "Step", "ReplicaGroup", "ReplicaStep",
    "SGD", "Momentum", "Adagrad", "Adam", "Admission", "Expiry", "DiskTier",
    "Zeros", "Constant", "Uniform", "Normal", "GlorotUniform",
    "MinSizePartitioner", "FixedShardsPartitioner", "MaxSizePartitioner",
    "PSError", "InvalidArgumentError", "ShapeMismatchError", "DTypeMismatchError",
    "VariableNotFoundError", "VariableConflictError", "FailedPreconditionError",
    "ClusterMismatchError", "NotInitializedError", "ResourceExhaustedError",
    "PSUnavailableError", "NotPrimaryError", "PSInternalError", "SpecError", "AuthenticationError",
    "PSTLSError", "TLSProblem",
    "PushWrittenOffError", "ServerBusyError",
    "PushHandle", "OverlappedStep", "OverlapRefusedError",
]
