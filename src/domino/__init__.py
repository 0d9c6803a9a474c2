"""domino: tensor-parallel language models whose TP communication hides behind computation."""
