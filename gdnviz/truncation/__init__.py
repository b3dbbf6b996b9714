"""Top-r truncation of Gated DeltaNet head states: ``S [K, V]`` → ``U_r U_rᵀ S`` (its top-r left singular directions).

Modules, one job each:

* ``constants``  the algorithm's numbers, fixed start matrices and iteration tables (a leaf);
* ``ranks``      the one rank validator (``RankOutOfRange``);
* ``reference``  float64 references: the exact SVD answer, energies, the energy-error bound, and the CUDA kernel's
  algorithm in torch (the CPU path);
* ``cuda``       the NVRTC kernel's launches (source ``cuda_truncate_src.cu``);
* ``dispatch``   the one place that chooses the path (``truncate_states``);
* ``spec`` / ``callback``  which heads at which rank (``TruncationSpec``), and the runner callback that applies it
  at every boundary (``TruncateCallback``).

Contract: retained energy within 1e-5 (relative to ‖S‖²_F) of the exact top-r answer for every state.
"""
from gdnviz.truncation.callback import TruncateCallback
from gdnviz.truncation.constants import MAX_RANK, iterations_for, pass_iterations
from gdnviz.truncation.dispatch import truncate_states
from gdnviz.truncation.ranks import check_rank, state_ranks
from gdnviz.truncation.reference import energy_error, energy_error_bound, exact_truncate, retained_energy
from gdnviz.truncation.spec import TruncationSpec

__all__ = [
    "truncate_states",
    "exact_truncate",
    "retained_energy",
    "energy_error",
    "energy_error_bound",
    "iterations_for",
    "pass_iterations",
    "MAX_RANK",
    "check_rank",
    "state_ranks",
    "TruncationSpec",
    "TruncateCallback",
]
