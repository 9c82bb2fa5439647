"""The cause of a failure read from a task's log (launcher/run/cause.py): the exception, the user's own frame,
the lines around it, and the tasks a collective's abort blames; from real logs of TensorFlow, tf_keras and Keras 3,
and from text that is no log at all."""

import pytest

from launcher.run.cause import AROUND, MESSAGE_MAX, Cause, of_log, unhealthy
from launcher.run.failure import Failure, FailureKind, of_task

# tf_keras under MultiWorkerMirroredStrategy: a subclassed model's call raises inside fit (autograph's
# "in user code:" nests the real exception twice; the worker package, site-packages and generated files
# are not the user's)
TF_KERAS = """Traceback (most recent call last):
  File "<string>", line 1, in <module>
  File "/opt/mgpu/worker/__main__.py", line 114, in main
    train(config)
  File "/opt/mgpu/worker/runner.py", line 186, in run
    history = _fit(model, dict(x=train, epochs=epochs, steps_per_epoch=steps, validation_data=val,
              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/mgpu/worker/runner.py", line 264, in _fit
    history = model.fit(**fit_args)
              ^^^^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3/site-packages/tf_keras/src/utils/traceback_utils.py", line 70, in error_handler
    raise e.with_traceback(filtered_tb) from None
  File "/tmp/__autograph_generated_file6yc9ygx0.py", line 15, in tf__train_function
    retval_ = ag__.converted_call(ag__.ld(step_function), (ag__.ld(self), ag__.ld(iterator)), None, fscope)
    ^^^^^
  File "/tmp/__autograph_generated_filem490x5kg.py", line 22, in tf__call
    ag__.if_stmt(ag__.ld(inputs).shape[-1] != 3, if_body, else_body, get_state, set_state, (), 0)
  File "/tmp/__autograph_generated_filem490x5kg.py", line 18, in if_body
    raise ag__.converted_call(ag__.ld(ValueError), (f'Net wants 3 channels, got {ag__.ld(inputs).shape[-1]}',), None, fscope)
ValueError: in user code:

    File "/usr/lib/python3/site-packages/tf_keras/src/engine/training.py", line 1398, in train_function  *
        return step_function(self, iterator)
    File "/usr/lib/python3/site-packages/tf_keras/src/engine/training.py", line 1381, in step_function  **
        outputs = model.distribute_strategy.run(run_step, args=(data,))
    File "/usr/lib/python3/site-packages/tf_keras/src/engine/training.py", line 1370, in run_step  **
        outputs = model.train_step(data)
    File "/usr/lib/python3/site-packages/tf_keras/src/engine/training.py", line 1147, in train_step
        y_pred = self(x, training=True)
    File "/usr/lib/python3/site-packages/tf_keras/src/utils/traceback_utils.py", line 70, in error_handler
        raise e.with_traceback(filtered_tb) from None
    File "/tmp/__autograph_generated_filem490x5kg.py", line 22, in tf__call
        ag__.if_stmt(ag__.ld(inputs).shape[-1] != 3, if_body, else_body, get_state, set_state, (), 0)
    File "/tmp/__autograph_generated_filem490x5kg.py", line 18, in if_body
        raise ag__.converted_call(ag__.ld(ValueError), (f'Net wants 3 channels, got {ag__.ld(inputs).shape[-1]}',), None, fscope)

    ValueError: Exception encountered when calling layer 'net' (type Net).
    
    in user code:
    
        File "/home/ana/proj/badlayer.py", line 15, in call  *
            raise ValueError(f"Net wants 3 channels, got {inputs.shape[-1]}")
    
        ValueError: Net wants 3 channels, got 1
    
    
    Call arguments received by layer 'net' (type Net):
      • inputs=tf.Tensor(shape=(32, 8, 8, 1), dtype=float32)

"""

# Keras 3 on JAX: the message a few lines below its lead-in, in bold
KERAS3 = """Traceback (most recent call last):
  File "/home/ana/proj/k3.py", line 14, in <module>
    m.fit(np.zeros((8, 2)), np.zeros((8, 2)), epochs=1, verbose=0)
  File "/venv/lib/python3.11/site-packages/keras/src/utils/traceback_utils.py", line 122, in error_handler
    raise e.with_traceback(filtered_tb) from None
  File "/home/ana/proj/k3.py", line 10, in call
    raise ValueError(f"Net wants 3 features, got {x.shape[-1]}")
ValueError: Exception encountered when calling Net.call().

\x1b[1mNet wants 3 features, got 2\x1b[0m

Arguments received by Net.call():
  • x=jnp.ndarray(shape=(8, 2), dtype=float32)
--------------------
For simplicity, JAX has removed its internal frames from the traceback of the following exception. Set JAX_TRACEBACK_FILTERING=off to include these.
"""

# the peer of a task stopped by SIGSTOP (TensorFlow 2.21): its all-reduce aborted by the coordination service
ABORT = """E0000 00:00:1795819394.664028   14733 base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort UNAVAILABLE: Error reported from /job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='\\"\\n\\n\\x06worker\\x10\\x01']
E0000 00:00:1795819394.664348   14733 ring_alg.cc:291] Aborting RingReduce with UNAVAILABLE: Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.
The error could be from a previous operation. Restart your program to reset. [type.googleapis.com/tensorflow.DerivedStatus='']
"""

PLAIN = """Traceback (most recent call last):
  File "/home/ana/train.py", line 40, in <module>
    main()
  File "/home/ana/train.py", line 31, in main
    rows = load(path)
           ^^^^^^^^^^
  File "/home/ana/data.py", line 7, in load
    return json.loads(text)
           ^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/json/__init__.py", line 346, in loads
    return _default_decoder.decode(s)
json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)
[mgpu task] training exited with code 1
"""

CHAINED = """Traceback (most recent call last):
  File "/home/ana/train.py", line 5, in read
    return open(p).read()
FileNotFoundError: [Errno 2] No such file or directory: 'x.csv'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/home/ana/train.py", line 9, in <module>
    read("x.csv")
  File "/home/ana/train.py", line 7, in read
    raise RuntimeError("no data: x.csv")
RuntimeError: no data: x.csv
"""


def test_tf_keras_names_the_innermost_exception_at_the_users_own_line():
    cause = of_log(TF_KERAS.splitlines())
    assert (cause.exception, cause.message) == ("ValueError", "Net wants 3 channels, got 1")
    assert (cause.file, cause.line, cause.function) == ("/home/ana/proj/badlayer.py", 15, "call")
    assert cause.words() == "ValueError: Net wants 3 channels, got 1 (at /home/ana/proj/badlayer.py:15, in call)"
    assert cause.lines[-1] == "    ValueError: Net wants 3 channels, got 1" and len(cause.lines) <= AROUND
    assert any("badlayer.py" in line for line in cause.lines) and not any("inputs=" in line for line in cause.lines)


def test_keras3_takes_the_message_below_its_lead_in_without_colours():
    cause = of_log(KERAS3.splitlines())
    assert cause.words() == "ValueError: Net wants 3 features, got 2 (at /home/ana/proj/k3.py:10, in call)"
    assert not any("\x1b" in line for line in cause.lines)


def test_plain_python_a_dotted_type_and_the_users_frame_above_the_library():
    cause = of_log(PLAIN.splitlines())
    assert cause.exception == "json.decoder.JSONDecodeError"
    assert cause.message == "Expecting value: line 1 column 1 (char 0)"
    assert (cause.file, cause.line, cause.function) == ("/home/ana/data.py", 7, "load")
    assert cause.lines[0].startswith('  File "/home/ana/train.py", line 31') and cause.lines[-1].startswith("json.")


def test_a_chained_exception_is_told_by_the_last_one_raised():
    cause = of_log(CHAINED.splitlines())
    assert cause.words() == "RuntimeError: no data: x.csv (at /home/ana/train.py:7, in read)"


def test_the_peers_abort_is_read_but_names_no_users_frame_and_blames_the_stopped_task():
    cause = of_log(ABORT.splitlines() + TF_KERAS.splitlines()[:1])  # a traceback header with nothing after
    assert cause is None
    assert unhealthy(ABORT.splitlines()) == [1]


@pytest.mark.parametrize("text, ranks", [
    ("The following tasks are unhealthy (stopped sending heartbeats):\n/job:jax_worker/replica:0/task:2\n"
     "/job:jax_worker/replica:0/task:3\nThe tasks have crashed.", [2, 3]),
    ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:4",
     [4]),
    ("Task /job:worker/replica:0/task:1 heartbeat timeout. This indicates that the remote task has failed", [1]),
    ("/job:worker/replica:0/task:1 is a name in an ordinary line", []),
    # task 0 (the chief, which hosts the service) SIGSTOPped: task 1's heartbeat to it timed out (TensorFlow 2.21)
    ("E0000 00:00:1795820800.189439   32678 base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort "
     "DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat", [0]),
    ("The following tasks are unhealthy (stopped sending heartbeats):\nnothing named here", []),
])
def test_unhealthy_tasks_in_the_coordination_services_words(text, ranks):
    assert unhealthy(text.splitlines()) == ranks


@pytest.mark.parametrize("lines", [
    [], None, ["no traceback here", "ValueError: looks like one, but no traceback above"],
    ["Traceback (most recent call last):"], ["Traceback (most recent call last):", "  File"],
    ["Traceback (most recent call last):", "x" * 10_000_000],
    ["Traceback (most recent call last):", '  File "/a.py", line 99999999999999999999, in f', "E: x"],
    ["\x00\ud800\x1b[31m" * 1000] * 1000, [1, 2.5, b"bytes"],
    ["Traceback (most recent call last):"] + ['  File "x", line 1, in ' + " *" * 480 + "y"] * 399,  # no backtracking
])
def test_any_text_gives_a_cause_or_none_never_an_error(lines):
    cause = of_log(lines)
    assert cause is None or isinstance(cause, Cause)
    assert isinstance(unhealthy(lines), list)


def test_a_long_message_and_a_huge_line_are_cut():
    cause = of_log(["Traceback (most recent call last):", '  File "/home/ana/t.py", line 3, in f',
                    "ValueError: " + "m" * 100_000])
    assert len(cause.message) == MESSAGE_MAX and cause.file == "/home/ana/t.py"
    assert all(len(line) <= 1000 for line in cause.lines)


def test_the_failure_carries_the_cause_as_fields_and_tells_it_first():
    failure = of_task(FailureKind.EXITED, "exited with code 1", 1, "task 1 (h:1)", "h", "h:/r/worker.log",
                      TF_KERAS.splitlines()[-15:], "RUN", 1, said=TF_KERAS.splitlines())
    assert failure.message.startswith("task 1 (h:1) exited with code 1: ValueError: Net wants 3 channels, got 1 "
                                      "(at /home/ana/proj/badlayer.py:15, in call). Every other task was stopped. "
                                      "Around it in its log (h:/r/worker.log):\n")
    data = failure.to_json()
    assert data["cause"]["exception"] == "ValueError" and data["cause"]["line"] == 15
    assert Failure.from_json(data) == failure
    assert Failure.from_json({**data, "cause": {"exception": 3}}).cause is None  # damaged: the failure stands
    hung = of_task(FailureKind.HUNG, "sent no progress", 1, "task 1 (h:1)", "h", "h:/r/worker.log",
                   TF_KERAS.splitlines(), "RUN")
    assert hung.cause is None and "Last lines of its log" in hung.message  # an old traceback is no hang's cause
