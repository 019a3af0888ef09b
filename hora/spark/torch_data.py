"""The torch face of a rank's partition: an ``IterableDataset`` of batches (imported only when asked for)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info


class BatchDataset(IterableDataset):
    """Batches of a :class:`~hora.spark.partition.PartitionData` as dicts of tensors.

    Use it with ``DataLoader(dataset, batch_size=None)``: the batches are
    already made.  ``set_epoch`` changes the shuffle of the next pass, as
    ``DistributedSampler.set_epoch`` does.  With ``num_workers`` > 0 the
    loader's workers take every n-th batch each.
    """

    def __init__(self, partition: Any, batch_size: int, **kwargs: Any) -> None:
        super().__init__()
        self.partition = partition
        self.batch_size = batch_size
        self.kwargs = kwargs
        self.epoch = int(kwargs.pop("epoch", 0))

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently on the next pass (with ``shuffle=True``)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.partition.steps(self.batch_size, even=self.kwargs.get("even", True),
                                    drop_last=self.kwargs.get("drop_last", False))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = get_worker_info()
        batches = self.partition.batches(batch_size=self.batch_size, epoch=self.epoch, **self.kwargs)
        for index, batch in enumerate(batches):
            if worker is None or index % worker.num_workers == worker.id:
                yield {name: torch.from_numpy(array) for name, array in batch.items()}
