"""Optimizers that run inside a KVStore (locally or on parameter servers): MXNet 1.9.1's eighteen, bit for bit.

The classes keep MXNet's names and arguments (``mx.optimizer.SGD`` ...,
:func:`create`), and each update rule follows MXNet 1.9.1's arithmetic
operation by operation, in the weight's dtype, so results agree to the last
bit (SGLD's noise aside).  The rules live by family: :mod:`.sgd` (SGD, ccSGD,
NAG, Signum, LARS, LBSGD), :mod:`.adaptive` (Adam, Adamax, Nadam, AdaGrad,
AdaDelta, RMSProp, FTML, Ftrl), :mod:`.lamb` and :mod:`.misc` (DCASGD, SGLD,
Test); :mod:`.base` holds the shared arithmetic and :mod:`.registry` the names.

Common rules, as in MXNet: clipping in a kernel is on when ``clip_gradient``
is a positive number, in the Python-level rules (AdaGrad, AdaDelta, Adamax,
Nadam, DCASGD, SGLD) whenever it is not None.  Update counts are kept per key
and ``num_update`` is their maximum, which is what a learning-rate scheduler
sees; a key's count is bumped before its rate is read (LBSGD reads it before).
State that MXNet keeps once per optimizer (Nadam's momentum schedule, LARS's
last two rates, the scheduler) is kept once per optimizer here too: on a
server it moves with each key's update in turn, as on MXNet's server.

Deviations, on purpose: row_sparse gradients reach these rules only on the
servers (:mod:`hora.kvstore.ps.rows`), where the rules that MXNet gives a lazy
or sparse kernel (SGD and Adam with ``lazy_update``, AdaGrad, Ftrl:
:meth:`Optimizer.lazy_rows`) update just the pushed rows, and every other rule
sees a dense gradient with zero rows; ``param_idx2name``/``sym``/
``param_dict`` are not taken (set :meth:`Optimizer.set_lr_mult` and
:meth:`Optimizer.set_wd_mult` by key, which is what MXNet's servers see).
SGD and Adam also update torch tensors in place; the other rules are NumPy and
update a tensor through a host copy.

Optimizers travel as :meth:`Optimizer.spec` dicts of plain data;
:func:`create_updater` validates one and returns an :class:`Updater`, whose
state is saved as msgpack (raw array bytes plus dtype and shape), never a pickle.
"""

from hora.kvstore.arrays import numpy_of as to_numpy
from hora.kvstore.lr_scheduler import (
    CosineScheduler,
    FactorScheduler,
    LRScheduler,
    MultiFactorScheduler,
    PolyScheduler,
)
from hora.kvstore.optimizer.adaptive import FTML, AdaDelta, AdaGrad, Adam, Adamax, Ftrl, Nadam, RMSProp
from hora.kvstore.optimizer.base import Optimizer
from hora.kvstore.optimizer.lamb import LAMB
from hora.kvstore.optimizer.misc import DCASGD, SGLD, Test
from hora.kvstore.optimizer.registry import BUILTIN, OPTIMIZERS, create, optimizer_from_spec, register
from hora.kvstore.optimizer.sgd import LARS, LBSGD, NAG, SGD, Signum, ccSGD
from hora.kvstore.optimizer.updater import Updater, create_updater, get_updater, updater_for

__all__ = ["Optimizer", "SGD", "ccSGD", "NAG", "Signum", "LARS", "LBSGD", "Adam", "Adamax", "Nadam", "AdaGrad",
           "AdaDelta", "RMSProp", "FTML", "Ftrl", "LAMB", "DCASGD", "SGLD", "Test", "BUILTIN", "OPTIMIZERS",
           "create", "optimizer_from_spec", "register", "create_updater", "get_updater", "updater_for", "Updater",
           "LRScheduler", "FactorScheduler", "MultiFactorScheduler", "PolyScheduler", "CosineScheduler", "to_numpy"]
