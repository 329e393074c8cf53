"""Batches of a SparseTensor fed through ``tf.compat.v1.sparse_placeholder``'s three
placeholders (training.Input.sparse), for `run` and `verify`.

A .npz holds the whole pool as one SparseTensor whose axis 0 counts examples: arrays keyed
``N/indices`` [entries, rank], ``N/values`` [entries] and ``N/shape`` [rank]. A batch of rows
(``take``) keeps the entries of those rows, in the order the rows are asked for, renumbered from
0, with the batch's row count as the dense shape's axis 0; that is what one device is fed, and
what split-inputs' SparseSplit cuts again for the replicas."""

from __future__ import annotations

import numpy as np

from graphxform.errors import GraphxformError


def check_pool(path: str, name: str, indices, values, shape) -> None:
    """One line naming the file and the input for a pool that is no SparseTensor."""
    if indices.ndim != 2 or values.ndim != 1 or shape.ndim != 1:
        raise GraphxformError(f"{path}: sparse input '{name}' needs '{name}/indices' of rank 2, "
                              f"'{name}/values' of rank 1 and '{name}/shape' of rank 1 (got "
                              f"ranks {indices.ndim}, {values.ndim}, {shape.ndim})")
    if len(indices) != len(values) or indices.shape[1] != len(shape):
        raise GraphxformError(f"{path}: sparse input '{name}': {len(indices)} indices of "
                              f"{indices.shape[1]} column(s), {len(values)} values and a shape "
                              f"of {len(shape)} dimension(s) do not fit together")
    if len(shape) < 1 or shape[0] < 1:
        raise GraphxformError(f"{path}: sparse input '{name}' has no rows (shape "
                              f"{shape.tolist()})")
    if len(indices) and ((indices < 0).any() or (indices >= shape).any()):
        raise GraphxformError(f"{path}: sparse input '{name}' has an index outside its shape "
                              f"{shape.tolist()}")


def rows(pool: tuple) -> int:
    """How many examples a pool (indices, values, shape) holds."""
    return int(pool[2][0])


def take(pool: tuple, wanted) -> tuple:
    """The batch of rows ``wanted`` (positions into the pool) of ``pool``."""
    indices, values, shape = pool
    wanted = np.asarray(wanted, dtype=np.int64)
    order = np.argsort(indices[:, 0], kind="stable")  # entries grouped by row, order kept
    starts = np.searchsorted(indices[order, 0], wanted, side="left")
    ends = np.searchsorted(indices[order, 0], wanted, side="right")
    picked = np.concatenate([order[a:b] for a, b in zip(starts, ends)] or
                            [np.zeros(0, np.int64)])
    counts = ends - starts
    new_indices = indices[picked].copy()
    new_indices[:, 0] = np.repeat(np.arange(len(wanted)), counts)
    new_shape = shape.copy()
    new_shape[0] = len(wanted)
    return new_indices, values[picked], new_shape


def synthetic(rng, batch: int, rank: int, dtype, columns: int = 3) -> tuple:
    """A batch of ``batch`` rows, each with entries at its first two of ``columns`` positions
    along axis 1 (and 0 beyond): small values, as `run` makes without a .npz."""
    rank = max(rank, 2)
    per_row = min(2, columns)
    indices = np.zeros((batch * per_row, rank), dtype=np.int64)
    indices[:, 0] = np.repeat(np.arange(batch), per_row)
    indices[:, 1] = np.tile(np.arange(per_row), batch)
    shape = np.array([batch, columns] + [1] * (rank - 2), dtype=np.int64)
    if dtype.is_floating:
        values = rng.standard_normal(len(indices)).astype(dtype.as_numpy_dtype)
    elif dtype.is_integer or dtype.is_bool:
        values = rng.integers(0, 2, len(indices)).astype(dtype.as_numpy_dtype)
    else:
        raise GraphxformError(f"cannot make synthetic values for a sparse input of "
                              f"{dtype.name}; pass --feeds")
    return indices, values, shape
