"""The plan of a run before it starts: GPU memory per stage, host memory, cache disk, and the
layout (stages, replicas, base storage, recompute, block swap) that fits the machine fastest."""
