"""Rank 0 reduces a tensor the other ranks never submit: every rank must raise StallError, then exit."""

import time

import mxnet as mx

import hora.mxnet as hvd
from hora.errors import StallError

hvd.init()
start = time.monotonic()
try:
    hvd.allreduce(mx.nd.ones(2), name=f"only.rank{hvd.rank()}")
    print("NO ERROR")
except StallError as e:
    print(f"STALL after {time.monotonic() - start:.1f}s: {str(e).splitlines()[0]}")
