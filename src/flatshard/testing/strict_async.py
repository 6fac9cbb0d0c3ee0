"""Importing this module registers the ``strict_async`` backend in this process (for process
pools that take a module to import before ``init_process_group``; see ``nccl_semantics``)."""

from flatshard.testing import nccl_semantics

nccl_semantics.register()
