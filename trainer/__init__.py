"""The Megatron trainer: megatron-core GPTModel on CPU or GPU, batching, losses, checkpoints, trainer groups."""
