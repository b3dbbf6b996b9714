"""GPU fast paths (Triton / CUDA graphs). Each has a float64 reference beside it and a test pinning them together."""
