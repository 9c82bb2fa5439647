"""The built-in runner on Keras 3 with JAX (`KERAS_BACKEND=jax`): `keras.distribution.DataParallel` over every
device of every task. `python -m worker` picks it; JAX and Keras are imported inside `runner.run`, never here."""
