"""A rank's share of ``hora.spark.run(fn, df=...)``: :func:`data`, whichever way it reached the rank.

The ranks read a plain Parquet scan's files themselves (:mod:`hora.spark.files`, a manifest in
``HORA_SPARK_FILES``); any other DataFrame arrives as a spilled Arrow file in the directory named by
``HORA_SPARK_DATA`` (:mod:`hora.spark.partition`).
"""

from __future__ import annotations

import json
import os

from hora import envvars
from hora.errors import HoraError
from hora.spark.files import file_share
from hora.spark.partition import META_FILE, PartitionData, rank_file


def data(directory: str | None = None) -> PartitionData:
    """This rank's partition of ``hora.spark.run(fn, df=...)``; call it inside ``fn`` (or the script).

    Raises:
        HoraError: the rank was not started by ``hora.spark.run`` with ``df=``.
    """
    rank_text = os.environ.get(envvars.HORA_RANK, "")
    if directory is None and rank_text.isdigit() and os.environ.get(envvars.HORA_SPARK_FILES):
        return file_share(os.environ[envvars.HORA_SPARK_FILES], int(rank_text))
    directory = directory or os.environ.get(envvars.HORA_SPARK_DATA)
    if not directory or not rank_text.isdigit():
        raise HoraError("hora.spark.data() is only available inside a rank of hora.spark.run(fn, df=...): "
                        "pass the DataFrame as df=")
    with open(os.path.join(directory, META_FILE), encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    rank = int(rank_text)
    return PartitionData(rank_file(directory, rank), rows, rank)
