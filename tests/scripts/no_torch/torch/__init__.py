# Put this folder first on PYTHONPATH to make torch unimportable in a job: what a
# TensorFlow or MXNet user without torch has.
raise ImportError("torch is blocked in this test: hora must not need it here")
