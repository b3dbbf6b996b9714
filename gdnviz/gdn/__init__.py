"""The Gated DeltaNet core: float64 reference recurrences and helpers around them."""
