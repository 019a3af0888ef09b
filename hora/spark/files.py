"""``df=`` straight from the files: a DataFrame that only scans Parquet files is read by the ranks with pyarrow.

Handing rows to Python through Spark costs a JVM decode of every value, a
conversion to Arrow and, to balance the ranks, a shuffle: on 1M rows of 784
floats, 2 ranks, that took 9 to 14 times as long as pyarrow reading the same
Parquet files (docs/benchmarks.md).  When the DataFrame is nothing but a scan of local Parquet files
(``spark.read.parquet(path)``, optionally with a ``select`` of some of its
columns; no filter, no computed column, no partition columns), the driver
reads the files' footers instead (:func:`scan_files`), splits the rows into
``num_proc`` contiguous ranges of equal size (:func:`split_rows`), and each
rank reads its own range of row groups (:class:`FileShare`).  Every other
DataFrame goes through Spark (``mapInArrow``) as before.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from hora import envvars
from hora.errors import HoraError
from hora.spark.partition import PartitionData, check_columns

log = logging.getLogger(__name__)

#: The variable that hands every rank the files, the columns and the rows of each rank (JSON).
HORA_SPARK_FILES = envvars.HORA_SPARK_FILES
#: Rows per Arrow batch read from a row group: Spark's own ``maxRecordsPerBatch`` default.
READ_BATCH = 10_000
#: Longer manifests go through Spark instead: one environment string may not exceed 128 KiB on Linux.
MAX_MANIFEST_CHARS = 100_000
_SPARK_TO_ARROW = {"ByteType": "int8", "ShortType": "int16", "IntegerType": "int32", "LongType": "int64",
                   "FloatType": "float", "DoubleType": "double", "BooleanType": "bool"}


def split_rows(total: int, num_proc: int) -> list[int]:
    """Rows of each rank when ``total`` rows are cut into ``num_proc`` contiguous ranges that differ by at most one."""
    return [total * (r + 1) // num_proc - total * r // num_proc for r in range(num_proc)]


def local_path(uri: str) -> str | None:
    """The local path of a ``file:`` URI or a plain path; None for any other scheme (HDFS, S3...)."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("", "file"):
        return urllib.parse.unquote(parsed.path)
    return None


def _same_type(spark_type: Any, arrow_type: Any) -> bool:
    """Whether the file's Arrow type is what Spark's schema says (Spark may have been given another schema)."""
    import pyarrow as pa

    kind = type(spark_type).__name__
    if kind in _SPARK_TO_ARROW:
        return str(arrow_type) == _SPARK_TO_ARROW[kind]
    if kind == "ArrayType" and (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
                                or pa.types.is_fixed_size_list(arrow_type)):
        return _same_type(spark_type.elementType, arrow_type.value_type)
    return False  # ML vectors and the rest: through Spark, which knows their encoding


def _plain_scan(df: Any) -> bool:
    """Whether ``df``'s optimized plan is a Parquet relation without partition columns, or a projection of
    some of its columns (nothing that filters, computes or renames).

    Table formats built on Parquet (Delta, Iceberg) have relations or file
    formats of other names, and their files may hold rows they deleted: they
    go through Spark.
    """
    plan = df._jdf.queryExecution().optimizedPlan()
    if plan.getClass().getSimpleName() == "Project":
        projections = plan.projectList()
        for index in range(projections.size()):
            if projections.apply(index).getClass().getSimpleName() != "AttributeReference":
                return False
        plan = plan.child()
    if plan.getClass().getSimpleName() != "LogicalRelation":
        return False
    relation = plan.relation()
    return (relation.getClass().getSimpleName() == "HadoopFsRelation"
            and relation.fileFormat().getClass().getSimpleName() == "ParquetFileFormat"
            and relation.partitionSchema().length() == 0)


def scan_files(df: Any) -> list[tuple[str, int]] | None:
    """The local Parquet files of ``df`` and their row counts, when the ranks can read them directly; else None.

    None (Spark hands the rows over) unless: the plan is a plain scan
    (:func:`_plain_scan`), every file is local (``file:``), and every file
    has ``df``'s columns with the types Spark reports.  The executors must
    see the files at the same paths, as Spark's own read of ``file:`` paths
    requires.
    """
    import pyarrow.parquet as pq

    try:
        if not _plain_scan(df):
            return None
        uris = list(df.inputFiles())
    except Exception as e:  # another Spark, or a plan shape this check does not know: Spark reads it
        log.debug("hora.spark: cannot inspect the DataFrame's plan (%s); Spark reads it", e)
        return None
    paths = [local_path(u) for u in sorted(uris)]
    if not paths or any(p is None for p in paths):
        return None
    files = []
    for path in paths:
        assert path is not None
        try:
            meta = pq.read_metadata(path)
        except OSError as e:
            log.debug("hora.spark: cannot read %s on the driver (%s); Spark reads the DataFrame", path, e)
            return None
        schema = meta.schema.to_arrow_schema()
        for field in df.schema.fields:
            index = schema.get_field_index(field.name)
            if index < 0 or not _same_type(field.dataType, schema.field(index).type):
                return None
        files.append((path, meta.num_rows))
    return files


def manifest(files: Sequence[tuple[str, int]], columns: Sequence[str], num_proc: int) -> str | None:
    """The JSON every rank gets in ``HORA_SPARK_FILES``; None when it is too long for an environment variable."""
    rows = split_rows(sum(n for _, n in files), num_proc)
    text = json.dumps({"files": [[p, int(n)] for p, n in files], "columns": list(columns), "rows": rows})
    return text if len(text) <= MAX_MANIFEST_CHARS else None


class FileShare(PartitionData):
    """A rank's contiguous range of rows of the DataFrame's Parquet files, read with pyarrow on each pass.

    Behaves as :class:`~hora.spark.partition.PartitionData` (``batches``,
    ``torch_dataset``, ``tf_dataset``...); a shuffle visits the range's
    row-group pieces in a random order and shuffles the rows inside each
    record batch.

    Attributes:
        files: ``(path, rows)`` of every file of the DataFrame, in order.
    """

    def __init__(self, files: Sequence[tuple[str, int]], columns: Sequence[str], rows_per_rank: Sequence[int],
                 rank: int) -> None:
        super().__init__("", rows_per_rank, rank)
        self.files = [(str(p), int(n)) for p, n in files]
        self._columns = list(columns)

    @property
    def columns(self) -> list[str]:
        """The DataFrame's columns, in order."""
        return list(self._columns)

    def _open(self, path: str) -> Any:
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path)
        except OSError as e:
            raise HoraError(
                f"rank {self.rank} cannot read {path}: with a DataFrame that only scans Parquet files, the ranks "
                "read the files themselves, so every executor must see them at the path the driver does (as "
                f"Spark's own reads of file: paths need): {e}") from e

    def pieces(self) -> list[tuple[str, int, int, int]]:
        """This rank's rows as ``(path, row group, rows to skip in it, rows to take)``, in file order."""
        start = sum(self.rows_per_rank[:self.rank])
        end = start + self.num_rows
        out = []
        offset = 0
        for path, rows in self.files:
            if offset + rows > start and offset < end:
                handle = self._open(path)
                meta = handle.metadata
                handle.close()
                group_start = offset
                for group in range(meta.num_row_groups):
                    count = meta.row_group(group).num_rows
                    lo, hi = max(start, group_start), min(end, group_start + count)
                    if hi > lo:
                        out.append((path, group, lo - group_start, hi - lo))
                    group_start += count
            offset += rows
        return out

    def record_batches(self, columns: Sequence[str] | None = None, rng: np.random.Generator | None = None
                       ) -> Generator[Any, None, None]:
        """This rank's rows as Arrow record batches of at most :data:`READ_BATCH` rows (see the base class)."""
        names = check_columns(columns, self._columns)
        pieces = self.pieces()
        order = np.arange(len(pieces))
        if rng is not None:
            rng.shuffle(order)
        opened: dict[str, Any] = {}
        try:
            for index in order:
                path, group, skip, take = pieces[int(index)]
                if path not in opened:
                    opened[path] = self._open(path)
                position = 0
                for record in opened[path].iter_batches(batch_size=READ_BATCH, row_groups=[group], columns=names):
                    lo, hi = max(skip - position, 0), min(skip + take - position, record.num_rows)
                    position += record.num_rows
                    if hi > lo:
                        yield record.slice(lo, hi - lo)
                    if position >= skip + take:
                        break
        finally:
            for handle in opened.values():
                handle.close()


def file_share(text: str, rank: int) -> FileShare:
    """Rank ``rank``'s share from the manifest in ``HORA_SPARK_FILES``."""
    spec = json.loads(text)
    return FileShare([tuple(f) for f in spec["files"]], spec["columns"], spec["rows"], rank)

