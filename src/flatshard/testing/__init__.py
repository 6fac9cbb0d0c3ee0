"""Test tools for flatshard's own test suite (not imported by ``import flatshard``).

- ``nccl_semantics``: the ``strict_async`` process group, Gloo underneath, NCCL's rules on top
  (outputs are garbage until ``wait()``, inputs and buffers must stay put while in flight).
- ``virtual_device``: a second, virtual CPU device for the compute side, so that a CPU run can
  tell host (offloaded) tensors from compute-device tensors at every collective.
- ``virtual_streams`` (with ``stream_access`` and ``_clocks``): CUDA's streams, events,
  ``Work.wait()`` and caching allocator modelled on the CPU (vector clocks); every tensor
  access and free checked for ordering against the collectives in flight.
- ``host_sync``: counts what blocks the host in a step on the device path (a collective on a
  Gloo side group, a read or blocking copy of a compute-device tensor, a timed wait).
"""
