"""Training translators.

- ``fit``: stage 1, least squares from streamed moments;
- ``recipe``: the stage-1 recipe (source-layer choice, token maps) as one call;
- ``distill``: stage 2, distillation through the frozen target;
- ``samples``: training and evaluation samples for a pair of models;
- ``store``: frozen passes computed once and kept on disk;
- ``loop``: the training run (checkpoints, budget, resume);
- ``distributed``: data parallelism over mlx.distributed.
"""
