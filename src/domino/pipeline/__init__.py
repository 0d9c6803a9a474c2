"""Pipeline parallelism with the Domino TP schedule inside every stage: layer partitioning
(``partition``), schedules and their simulation (``schedules``), the stage model (``model``) and
the runtime that drives a training step (``runtime``; it also moves activations and gradients
between stages, point to point over the ``pp`` group's ``CommGroup.isend``/``irecv``)."""
