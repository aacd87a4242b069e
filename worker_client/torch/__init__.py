"""PyTorch on wehub-ps: a ``torch.nn.Module``'s parameters live on the ps-servers.

Optional (the ``torch`` extra); ``import worker_client`` never loads torch.
:func:`attach` makes a module's parameters variables and drives its
steps; :class:`PSEmbedding` is an embedding layer over a server-side table
(worker_client.torch.embedding).

    from worker_client import PSClient
    from worker_client.torch import attach

    client = PSClient.from_env()
    ps_model = attach(client, model, prefix="digits",
                      optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
    for x, y in batches:
        with ps_model.step():           # pulls straight into model's parameters, in place
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        # leaving the block pushed every .grad as one push and cleared them

Variables are named ``prefix/<name from named_parameters()>``. Every
worker attaches its own freshly built model; per variable, the first
worker to create it gives the initial values, and every worker pulls them. The optimizer runs on
the servers: a ``torch.optim`` optimizer's parameter groups map to the
servers' SGD, Momentum (torch's momentum and nesterov), Adagrad and Adam
with torch's values and defaults (Adam ε = 1e-8, Adagrad's initial
accumulator 0); a wehub optimizer object applies to every parameter as
given (its own, Keras, defaults). Options the servers lack (weight decay,
dampening, amsgrad, maximize, lr_decay, other classes) are refused with
:class:`UnsupportedOptimizerError` naming them. The optimizer object itself
is only read: do not call its ``step()``.

A step: entering pulls every variable into its parameter (CPU tensors
through a numpy view of their memory, no copy in between; CUDA tensors
through a pinned host buffer, which needs CuPy, the ``gpu`` extra).
Leaving pushes every parameter's ``.grad`` (parameters without one are
skipped) and every row module's rows as one push, then sets the
gradients to None. Leaving by an exception pushes nothing and clears the
gradients.

Row modules (:class:`PSEmbedding`, or any module of one's own) take part
through two methods, found on every submodule of the attached model that has both:

- ``begin_step() -> None``: called as each step begins, before the pull;
  the module forgets the rows of the previous step.
- ``take_row_gradients() -> dict[str, tuple[ids, grads]]``: called as the
  step ends, after the backward pass (also when it ends by an exception:
  the rows are then dropped, as the step pushes nothing):
  per table (its full variable name), the row ids the step used and their
  gradients, shape ``(len(ids), *row_shape)``, as ``PSClient.push(rows=)``
  takes them (numpy, or DLPack tensors; repeated ids are summed). They go
  in the same push as the dense gradients, which synchronous mode needs
  (one push per worker and step).

A row module's own parameters are not attached as dense variables: its
tables hold them.
"""

from worker_client.torch.collection import (
    KeyedJaggedBatch,
    PooledFeatures,
    PSEmbeddingBagCollection,
    TableConfig,
)
from worker_client.torch.embedding import EmbeddingOptimizerError, PSEmbedding
from worker_client.torch.embedding_bag import PSEmbeddingBag
from worker_client.torch.export import ExportedEmbedding, ExportedEmbeddingBag, plain_model
from worker_client.torch.module import PSModel, attach
from worker_client.torch.optimizers import (
    UnsupportedOptimizerError,
    optimizers_by_parameter,
    server_optimizer,
    table_optimizer,
)
from worker_client.torch.step import TorchStep

__all__ = ["EmbeddingOptimizerError", "ExportedEmbedding", "ExportedEmbeddingBag", "KeyedJaggedBatch",
           "PSEmbedding", "PSEmbeddingBag", "PSEmbeddingBagCollection", "PSModel", "PooledFeatures", "TableConfig",
           "TorchStep", "UnsupportedOptimizerError", "attach", "optimizers_by_parameter", "plain_model",
           "server_optimizer", "table_optimizer"]
