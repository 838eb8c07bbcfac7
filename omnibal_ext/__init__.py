"""OmniBal balancing algorithms: data (ISF), model (partition), memory (recompute).

Independent of Megatron: numpy (and torch only in the profiler). Planners take statistics and
costs and return plans that serialise to JSON; the trainer in ``megatron/`` executes them.
"""
__version__ = "0.1.0"
