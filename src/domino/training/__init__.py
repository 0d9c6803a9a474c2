"""End-to-end training: `domino train` settings, checks, launch, loop, optimiser, logging."""
