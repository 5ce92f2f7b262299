"""The loops that learn: pull whole-group batches from the TrainerService and update the model.

``loop`` runs an experiment (services, rollouts, updates, weight hand-off); ``learner`` and ``ppo``
are the reference torch learner and its losses; ``verl_backend`` hands updates to verl on GPUs;
``experiment`` is the experiment file (``lightning-grpc train --help-config`` lists its keys). The
in-process peer the benchmarks compare with is ``bench/direct.py``. The batches themselves are built by
:mod:`lightning_grpc.batching`, which knows nothing of training.
"""
