"""aiacc.tensorflow.keras: not written yet."""
