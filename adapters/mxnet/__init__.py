"""aiacc.mxnet: not written yet (see the issue tracker)."""
