"""The in-process agent. It may import torch, but only when started, never on import."""
