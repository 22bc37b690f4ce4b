"""Training of the projector, kept beside the runtime package `medvqa` (which never imports it).

- data.py: cached encoder features, held-out splits, training examples.
- loss.py: the shipped recipe's loss, standardisation and schedule.
- experimental.py: measured, unshipped experiments (off by default).

scripts/train_projector.py is the command line; weights/offline/card.json records the shipped run.
"""
