"""MedVQA: retrieval-augmented medical visual question answering."""

__version__ = "0.1.0"
