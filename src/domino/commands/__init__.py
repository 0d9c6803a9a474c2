"""Command-line entry points that span tiers (checkpoint, inference and training): each is a thin
argparse layer over library functions; `domino train`, `preprocess` and `bench` live with their
features."""
