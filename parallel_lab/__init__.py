"""parallel_lab: one CIFAR model, every parallelism strategy, every number proven."""

__version__ = "0.1.0"
