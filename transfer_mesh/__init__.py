"""TransferMesh: HF <-> Megatron layouts, versioned checksummed buckets, weight transports to the engines."""
