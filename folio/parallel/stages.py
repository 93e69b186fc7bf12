"""Pipeline stages as plain arithmetic (no torch): which layers each stage holds, which rank is which stage, and
the start-up check of pipeline_parallel_size. The model pass that uses it is folio/parallel/pipeline_parallel.py.

Ranks are laid out as vLLM's: rank = pp_rank * tp + tp_rank, so a stage's tensor-parallel ranks are neighbours and
the last stage's first rank, (pp - 1) * tp, is the one whose ModelRunnerOutput goes back to the engine core.
"""

from __future__ import annotations

PP_FLAG = "pipeline_parallel_size (--pipeline-parallel-size)"


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage ``pp_rank`` holds: vLLM's even split (get_pp_indices), the layers
    that do not divide evenly going one each to the stages before the last, from the second-last backwards (the
    last stage also runs the final norm and the LM head).

    Example: 30 layers, pp=2 -> [0, 15), [15, 30); pp=4 -> sizes [7, 8, 8, 7]; 3 layers, pp=2 -> [0, 2), [2, 3).
    """
    check_pipeline_parallel(num_layers, pp_size)
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def check_pipeline_parallel(num_layers: int, pp_size: int) -> None:
    """Raises ValueError naming --pipeline-parallel-size and the limit where pp cannot split the model's layers
    (every stage needs at least one layer)."""
    if pp_size < 1:
        raise ValueError(f"{PP_FLAG} must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(f"{PP_FLAG} {pp_size} exceeds the model's number of layers {num_layers}")


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank whose ModelRunnerOutput the engine core reads: the last stage's first tensor-parallel rank."""
    return (pp_size - 1) * tp_size
