"""Pipeline parallelism with the Domino TP schedule inside every stage: layer partitioning
(``partition``), schedules and their simulation (``schedules``), point-to-point transfers
(``p2p``), the stage model (``model``) and the runtime that drives a training step
(``runtime``)."""
