"""Test and benchmark infrastructure that ships with hora: not used by training jobs.

:mod:`hora.testing.emulate` builds an emulated multi-host cluster (network
namespaces, shaped links, sshd per host) on one Linux machine, for the
multi-host tests in ``tests/cluster`` and for ``hora bench --emulate-hosts``.
"""
