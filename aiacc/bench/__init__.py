"""Benchmarks: ``python -m aiacc.bench {allreduce,fusion,train,report} ...`` (run under aiaccrun).

Benchmarks print figures; they never assert on time. Framework-specific
training benchmarks live in the adapters (``aiacc.<framework>.bench``) so that
this package never imports a framework.
"""
