"""A rank's share of ``hora.spark.run(fn, df=...)``: its partition as an Arrow file, read back batch by batch.

A DataFrame that only scans Parquet files is read from its files instead
(:mod:`hora.spark.files`).  For every other one, the Spark task writes the
Arrow record batches of its partition (from ``mapInArrow``) to a local Arrow
IPC file as they arrive (:func:`spill`); the rank reads that file with
:func:`data`, for as many epochs as it likes.  A
read holds one of the file's record batches (``spark.sql.execution.arrow.
maxRecordsPerBatch`` rows, 10,000 by default) plus the batch being built,
never the whole partition: the file is read, not memory-mapped.

Columns may be numeric (integers, floats, booleans), arrays of numbers of one
length per column (a 2-D array per batch) or Spark ML vectors (dense or
sparse, given back dense).  :func:`check_schema` refuses any other column on
the driver, before the job starts, naming the column.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from hora.errors import ConfigError, HoraError

#: The rank's Arrow file and the job's row counts, in the directory named by ``HORA_SPARK_DATA``.
META_FILE = "meta.json"
_NUMERIC = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType", "BooleanType")


def rank_file(directory: str, rank: int) -> str:
    """The Arrow file that holds rank ``rank``'s partition."""
    return os.path.join(directory, f"rank-{rank}.arrow")


def check_schema(schema: Any) -> None:
    """Refuse a DataFrame with a column the rank-side readers cannot turn into NumPy arrays.

    ``schema`` is the DataFrame's ``pyspark.sql.types.StructType``.

    Raises:
        ConfigError: a column is neither numeric, an array of numbers, nor an
            ML vector; the message names it and its type.
    """
    for field in schema.fields:
        kind = type(field.dataType).__name__
        if kind in _NUMERIC or kind == "VectorUDT":
            continue
        if kind == "ArrayType" and type(field.dataType.elementType).__name__ in _NUMERIC:
            continue
        raise ConfigError(
            f"column {field.name!r} has type {field.dataType.simpleString()}, which hora.spark cannot hand to the "
            "ranks: df= columns must be numeric, arrays of numbers or ML vectors. Select or cast the columns "
            "first, e.g. df.select('features', 'label')"
        )


def spill(batches: Iterable[Any], path: str) -> int:
    """Write Arrow record batches to an Arrow IPC file at ``path`` as they come; return the row count."""
    import pyarrow as pa

    rows = 0
    writer = None
    try:
        for batch in batches:
            if writer is None:
                writer = pa.ipc.new_file(path, batch.schema)
            writer.write_batch(batch)
            rows += batch.num_rows
        if writer is None:  # an empty partition: an empty file, so the reader needs no special case
            writer = pa.ipc.new_file(path, pa.schema([]))
    finally:
        if writer is not None:
            writer.close()
    return rows


def write_meta(directory: str, rows: Sequence[int]) -> None:
    """Record every rank's row count next to the rank's file (``rows[r]`` is rank ``r``'s)."""
    with open(os.path.join(directory, META_FILE), "w", encoding="utf-8") as f:
        json.dump({"rows": [int(r) for r in rows]}, f)


def column_to_numpy(array: Any, name: str) -> np.ndarray:
    """One Arrow column as a NumPy array: 1-D for numbers, 2-D for arrays and vectors (``name`` for messages).

    Raises:
        HoraError: the column has nulls, arrays of different lengths, or a type with no NumPy form.
    """
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise HoraError(f"column {name!r} has {array.null_count} null values; drop or fill them before "
                        "hora.spark.run (df.na.drop() or df.na.fill(...))")
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _lists(array, name)
    if pa.types.is_struct(kind) and {f.name for f in kind} >= {"type", "values"}:
        return _vectors(array, name)
    if pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return array.to_numpy()
    raise HoraError(f"column {name!r} has Arrow type {kind}, which hora.spark cannot turn into a NumPy array")


def _lists(array: Any, name: str) -> np.ndarray:
    import pyarrow as pa

    if len(array) == 0:
        return np.zeros((0, 0), dtype=array.type.value_type.to_pandas_dtype())
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        values = array.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(array), width)
    offsets = array.offsets.to_numpy()
    lengths = np.diff(offsets)
    if lengths.min() != lengths.max():
        raise HoraError(f"column {name!r} holds arrays of different lengths ({lengths.min()} to {lengths.max()}); "
                        "every row must have the same length to make a batch")
    values = array.flatten().to_numpy(zero_copy_only=False)
    return values.reshape(len(array), int(lengths[0]))


def _vectors(array: Any, name: str) -> np.ndarray:
    """Spark ML vectors (struct of type, size, indices, values; type 1 dense, 0 sparse) as a dense 2-D array."""
    kinds = array.field("type").to_numpy(zero_copy_only=False)
    values = array.field("values")
    if len(array) == 0:
        return np.zeros((0, 0))
    if (kinds == 1).all():
        return _lists(values, name)
    sizes = array.field("size").to_numpy(zero_copy_only=False)
    dense_lengths = np.diff(values.offsets.to_numpy())
    width = int(np.where(kinds == 1, dense_lengths, np.nan_to_num(sizes.astype(float))).max())
    out = np.zeros((len(array), width))
    flat_values = values.flatten().to_numpy(zero_copy_only=False)
    value_offsets = values.offsets.to_numpy()
    indices = array.field("indices")
    flat_indices = indices.flatten().to_numpy(zero_copy_only=False) if indices.null_count < len(array) else None
    index_offsets = indices.offsets.to_numpy()
    for row in range(len(array)):
        row_values = flat_values[value_offsets[row]:value_offsets[row + 1]]
        if kinds[row] == 1:
            if len(row_values) != width:
                raise HoraError(f"column {name!r} holds vectors of different sizes; every row must have the same")
            out[row] = row_values
        else:
            assert flat_indices is not None
            out[row, flat_indices[index_offsets[row]:index_offsets[row + 1]]] = row_values
    return out


class PartitionData:
    """This rank's rows of ``df=``, read from its local Arrow file.

    Attributes:
        path: the Arrow IPC file.
        rows_per_rank: every rank's row count, by rank.
        rank: this rank.
    """

    def __init__(self, path: str, rows_per_rank: Sequence[int], rank: int) -> None:
        self.path = path
        self.rows_per_rank = tuple(int(r) for r in rows_per_rank)
        self.rank = rank

    @property
    def num_rows(self) -> int:
        """Rows this rank holds."""
        return self.rows_per_rank[self.rank]

    @property
    def even_rows(self) -> int:
        """Rows every rank reads with ``even=True``: the smallest partition's count."""
        return min(self.rows_per_rank)

    @property
    def columns(self) -> list[str]:
        """The columns of the partition, in order."""
        import pyarrow as pa

        with pa.OSFile(self.path, "rb") as source:
            return list(pa.ipc.open_file(source).schema.names)

    def steps(self, batch_size: int, even: bool = True, drop_last: bool = False) -> int:
        """How many batches :meth:`batches` gives with these arguments."""
        rows = self.even_rows if even else self.num_rows
        return rows // batch_size if drop_last else -(-rows // batch_size)

    def batches(
        self,
        batch_size: int = 256,
        columns: Sequence[str] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        even: bool = True,
        drop_last: bool = False,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Yield batches as ``{column: array}`` dicts of NumPy arrays, ``batch_size`` rows each.

        With ``even`` (the default) every rank reads the same number of rows,
        the smallest partition's, so every rank takes the same number of
        steps (allreduce needs that); the few extra rows of larger partitions
        are left out.  ``shuffle`` reads the file's record batches in a
        random order and shuffles the rows inside each, differently for each
        ``epoch`` (the order is the same on a rank for a given
        ``seed`` and ``epoch``).  ``drop_last`` leaves out a last, short batch.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
        limit = self.even_rows if even else self.num_rows
        if drop_last:
            limit -= limit % batch_size
        rng = np.random.default_rng([seed, epoch, self.rank]) if shuffle else None
        pending: list[dict[str, np.ndarray]] = []
        pending_rows = 0
        left = limit
        records = self.record_batches(columns, rng)
        try:
            for record in records:
                if left <= 0:
                    break
                part = {n: column_to_numpy(record.column(n), n) for n in record.schema.names}
                rows = record.num_rows
                if rng is not None:
                    permutation = rng.permutation(rows)
                    part = {n: a[permutation] for n, a in part.items()}
                if rows > left:
                    part = {n: a[:left] for n, a in part.items()}
                    rows = left
                left -= rows
                pending.append(part)
                pending_rows += rows
                while pending_rows >= batch_size:
                    batch, pending, pending_rows = _take(pending, batch_size)
                    yield batch
        finally:
            records.close()  # closes the file now, not when the generator is collected
        if pending_rows:
            yield _take(pending, pending_rows)[0]

    def record_batches(self, columns: Sequence[str] | None = None, rng: np.random.Generator | None = None
                       ) -> Generator[Any, None, None]:
        """The partition's Arrow record batches with ``columns`` (all for None), in the file's order or, with
        ``rng``, in a random order of the file's batches.

        Raises:
            ConfigError: a column is not in the data.
        """
        import pyarrow as pa

        with pa.OSFile(self.path, "rb") as source:
            reader = pa.ipc.open_file(source)
            names = check_columns(columns, reader.schema.names)
            order = np.arange(reader.num_record_batches)
            if rng is not None:
                rng.shuffle(order)
            for index in order:
                record = reader.get_batch(int(index))
                yield record if names == record.schema.names else record.select(names)

    def torch_dataset(self, batch_size: int = 256, **kwargs: Any) -> Any:
        """A ``torch.utils.data.IterableDataset`` of batches (dicts of tensors): ``DataLoader(ds, batch_size=None)``.

        Takes the arguments of :meth:`batches`; ``set_epoch(e)`` changes the
        shuffle for the next pass.
        """
        from hora.spark.torch_data import BatchDataset

        return BatchDataset(self, batch_size=batch_size, **kwargs)

    def tf_dataset(self, batch_size: int = 256, **kwargs: Any) -> Any:
        """A ``tf.data.Dataset`` of batches (dicts of tensors), re-read from the file on each pass.

        Takes the arguments of :meth:`batches` but ``epoch``: each new pass
        over the dataset counts as the next epoch for the shuffle.
        """
        import tensorflow as tf

        if "epoch" in kwargs:
            raise ConfigError("tf_dataset counts epochs itself (each pass is the next one): leave epoch out")
        first = next(self.batches(batch_size=1, columns=kwargs.get("columns"), even=False), None)
        if first is None:
            raise HoraError(f"rank {self.rank} has no rows: a tf.data.Dataset needs the column types from one")
        signature = {n: tf.TensorSpec(shape=(None, *a.shape[1:]), dtype=tf.as_dtype(a.dtype)) for n, a in first.items()}
        passes = iter(range(1 << 62))

        def generate() -> Iterator[dict[str, np.ndarray]]:
            yield from self.batches(batch_size=batch_size, epoch=next(passes), **kwargs)

        return tf.data.Dataset.from_generator(generate, output_signature=signature)


def check_columns(columns: Sequence[str] | None, available: Sequence[str]) -> list[str]:
    """``columns`` (every one of ``available`` for None), after checking they exist.

    Raises:
        ConfigError: a column is not in ``available``; the message names it and lists the columns there are.
    """
    names = list(columns) if columns is not None else list(available)
    missing = [n for n in names if n not in available]
    if missing:
        raise ConfigError(f"columns {missing} are not in the data; it has {list(available)}")
    return names


def _take(pending: list[dict[str, np.ndarray]], count: int) -> tuple[dict[str, np.ndarray], list, int]:
    """The first ``count`` rows of the pending parts as one batch; the parts left and their rows."""
    taken: list[dict[str, np.ndarray]] = []
    need = count
    while need:
        part = pending[0]
        rows = len(next(iter(part.values())))
        if rows <= need:
            taken.append(pending.pop(0))
            need -= rows
        else:
            taken.append({n: a[:need] for n, a in part.items()})
            pending[0] = {n: a[need:] for n, a in part.items()}
            need = 0
    batch = taken[0] if len(taken) == 1 else {n: np.concatenate([t[n] for t in taken]) for n in taken[0]}
    left = sum(len(next(iter(p.values()))) for p in pending)
    return batch, pending, left
