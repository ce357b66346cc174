"""sparsify: convert gated-MLP Hugging Face language models to >99% activation sparsity (ReLU gate +
L1 penalty) and run them on TwELL Triton kernels. Stages, one module each:
load -> relufy -> train -> measure -> plan -> export -> push."""

__version__ = "0.1.0"
