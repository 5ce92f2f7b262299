"""The loops that learn: pull whole-group batches from the TrainerService and update the model.

``loop`` runs an experiment (services, rollouts, updates, weight hand-off); ``learner`` and ``ppo``
are the reference torch learner and its losses; ``verl_backend`` hands updates to verl on GPUs;
``direct`` is the in-process peer the benchmarks compare with. The batches themselves are built by
:mod:`lightning_grpc.batching`, which knows nothing of training.
"""
