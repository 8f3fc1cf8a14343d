"""Bundled demos: each runs one PyTorch performance practice the bad way and the good way."""
