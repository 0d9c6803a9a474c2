"""Every ``domino`` subcommand, one module each (``hf_import`` is ``domino import``), registered
in :data:`domino.cli.SUBCOMMANDS`.

A command module is a thin argparse layer: ``add_arguments(parser)`` defines its flags and
``run(args)`` checks what only the command line can get wrong, then calls the feature's library
code (training, data, checkpoint, inference, bench). :mod:`domino.cli` wires them together.
"""
