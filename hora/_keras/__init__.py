"""What hora.keras (Keras 3) and hora.tensorflow.keras (tf.keras, tf_keras) share, free of any framework import.

The callbacks' logic is written once here against what every Keras exposes
(``model.variables``, ``optimizer.learning_rate``, ``Variable.assign``,
``numpy.asarray(variable)``); each binding mixes it into its own Keras's
``Callback`` class.  Values cross ranks as NumPy arrays through the core.
"""
