"""Reproducing the paper's tables: experiment grids, their runs, and reports.

- `cells`: one training run of a grid (`Cell`), run as the README's commands run it, in
  its own workdir; a rerun skips finished cells.
- `grids`: the experiments by name (`EXPERIMENTS`), each a grid of cells at `tiny` or
  `paper` scale with the paper's numbers beside it.
- `report`: a grid's results as CSV, markdown (means ± std over seeds) and PNG plots.

`experiments/reproduce.py` is the command line.
"""
