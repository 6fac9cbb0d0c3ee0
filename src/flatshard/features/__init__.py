"""Optional optimizations layered on the plain path: buckets of coalesced units, the root split
and lazy root, the gather pool, recomputation views, activation checkpointing and compile
boundaries. Each is reached from ``flatshard.core`` only where its option is on."""
