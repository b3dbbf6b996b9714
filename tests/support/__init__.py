"""Tools shared by the tests and the benchmarks (not part of the gdnviz package): the CPU emulation of CUDA's thread
model for the kernels' sources, CUDA-graph capture of a function, test states."""
