"""The built-in runner on TensorFlow: MultiWorkerMirroredStrategy with tf-keras, its input pipelines, local replicas, checkpoints and step clock."""
