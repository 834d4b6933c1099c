"""Benchmarks: ``python -m aiacc.bench {allreduce,fusion,train,report,replay,cluster,scaling,predict} ...``.

Benchmarks print figures; they never assert on time. They live in the
repository's ``bench/`` directory, installed as ``aiacc.bench``: outside the
core (``aiacc/``, which imports no framework) and outside the adapters. A
module that needs a framework (``train_torch``, ``train_tensorflow``,
``train_mxnet``, ``c10d``, ``recovery``, ``replay``, ``scaling``) imports it when it is run, never at
``import aiacc.bench``, and none changes the process environment at import.
"""
