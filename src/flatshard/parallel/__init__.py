"""The parallel axes that compose with sharding: tensor parallelism (DTensor parameters),
pipeline stages (``fs.pipeline_step``, its checks, weights tied across stages) and experts
(units sharded over their own mesh, their placed state)."""
